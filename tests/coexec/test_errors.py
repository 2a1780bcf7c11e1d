"""Errors surface in the user's thread at the user's line; nothing hangs; misuse is explained."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import coexec
from coexec import runtime

HERE = __file__


def innermost_line_here(excinfo) -> int:
    """The line of the innermost traceback entry that lies in this test file."""
    entries = [e for e in excinfo.traceback if str(e.path) == HERE]
    return entries[-1].lineno + 1  # pytest's lineno is 0-based


def make():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    return SimpleNamespace(lin=lin, opt=torch.optim.SGD(lin.parameters(), lr=0.1), x=torch.randn(8, 4))


def plain_step(s, raise_now=False, w_extra=None):
    s.opt.zero_grad()
    h = s.lin(s.x)
    if w_extra is not None:
        h = h @ w_extra  # THE SHAPE LINE
    loss = h.pow(2).mean()
    if raise_now and loss.item() > 0:
        raise ValueError("bad batch")  # THE RAISE LINE
    loss.backward()
    s.opt.step()
    return loss


def run_step(tape, s, **kwargs):
    with tape:
        return plain_step(s, **kwargs)


def warm_tape(s, key):
    tape = coexec.GradientTape(backend="interpret", key=key, timeout=5.0)
    for _ in range(3):
        run_step(tape, s)
    assert tape.stats.phase == "coexec"
    return tape


def line_of(marker: str) -> int:
    return next(i for i, t in enumerate(open(HERE), 1) if marker in t and "line_of" not in t)


def test_user_exception_in_a_coexecuted_step_has_its_normal_traceback():
    s = make()
    tape = warm_tape(s, "user-exception")
    with pytest.raises(ValueError, match="bad batch") as excinfo:
        run_step(tape, s, raise_now=True)
    assert innermost_line_here(excinfo) == line_of("# THE RAISE LINE")
    assert tape.stats.fallbacks == 0  # it was co-executed up to the raise
    run_step(tape, s)  # the runtime is consistent: the next step co-executes
    assert tape.stats.coexec_steps == 2


def test_shape_error_in_an_op_points_at_the_op():
    s = make()
    tape = warm_tape(s, "shape-error")
    with pytest.raises(RuntimeError, match="cannot be multiplied") as excinfo:
        run_step(tape, s, w_extra=torch.randn(5, 3))
    assert innermost_line_here(excinfo) == line_of("# THE SHAPE LINE")


def test_an_op_failing_on_the_executor_is_raised_at_the_line_that_issued_it():
    s = make()
    idx = torch.zeros(8, 4, dtype=torch.long)
    tape = coexec.GradientTape(backend="interpret", key="executor-error", timeout=5.0)
    for i in range(4):
        if i == 3:
            idx[0, 0] = 99  # only the data changes: the skeleton cannot see it
        try:
            with tape:
                s.opt.zero_grad()
                h = s.lin(s.x)
                g = h.gather(0, idx)  # THE GATHER LINE
                loss = g.pow(2).mean()
                loss.backward()
                s.opt.step()
        except coexec.ExecutorError as e:
            err = e
            tb_lines = []
            tb = e.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code.co_filename == HERE:
                    tb_lines.append(tb.tb_lineno)
                tb = tb.tb_next
    assert tape.stats.coexec_steps >= 1
    assert tb_lines[-1] == line_of("# THE GATHER LINE")
    assert "out of bounds" in str(err.__cause__)
    assert str(err).startswith("aten.gather.default failed on the executor")


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_dead_or_stuck_executor_is_an_error_within_the_timeout(fault):
    s = make()
    tape = warm_tape(s, f"fault-{fault}")
    tape.timeout = 1.0
    released = []
    real_step = s.opt.step

    def faulty_step():  # the fault goes into the queue mid-step, after the backward's ops
        released.append(runtime.executor().inject_fault(fault))
        real_step()

    s.opt.step = faulty_step
    t0 = time.monotonic()
    with pytest.raises((coexec.ExecutorDied, coexec.ExecutorTimeout)):
        run_step(tape, s)
    s.opt.step = real_step
    assert time.monotonic() - t0 < 5.0
    released[0].release.set()  # let a stuck thread go
    tape.timeout = 5.0
    loss = run_step(tape, s)  # a fresh executor runs the next step
    assert torch.isfinite(loss).item() and runtime.executor().alive
    assert tape.stats.coexec_steps >= 1


def test_nested_tapes_are_refused():
    outer = coexec.GradientTape(backend="interpret", key="outer")
    inner = coexec.GradientTape(backend="interpret", key="inner")
    with outer:
        with pytest.raises(coexec.CoexecUsageError, match="do not nest"):
            with inner:
                pass


def test_gradient_of_a_non_scalar_needs_output_gradients():
    w = torch.randn(3, requires_grad=True)
    tape = coexec.GradientTape(backend="interpret", key="nonscalar")
    with tape:
        y = w * 2
        with pytest.raises(coexec.CoexecUsageError, match="non-scalar target needs output_gradients"):
            tape.gradient(y, [w])
        (g,) = tape.gradient(y, [w], output_gradients=torch.ones(3))
    assert torch.equal(g, torch.full((3,), 2.0))


def test_a_tape_from_another_thread_is_refused():
    tape = coexec.GradientTape(backend="interpret", key="thread")
    errors = []

    def use():
        try:
            with tape:
                pass
        except coexec.CoexecUsageError as e:
            errors.append(str(e))

    t = threading.Thread(target=use)
    t.start()
    t.join()
    assert errors and "another thread" in errors[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_traces": 0}, "max_traces"),
        ({"sync": "sometimes"}, "sync must be one of"),
        ({"backend": "tpu"}, "backend must be one of"),
        ({"timeout": 0}, "timeout must be positive"),
    ],
)
def test_bad_options_are_explained(kwargs, match):
    with pytest.raises(ValueError, match=match):
        coexec.GradientTape(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_traces": True}, r"max_traces must be an int .*got True"),
        ({"max_traces": 2.5}, r"max_traces must be an int .*got 2.5"),
        ({"timeout": "10"}, r"timeout must be a number of seconds, got '10'"),
        ({"timeout": True}, r"timeout must be a number of seconds, got True"),
        ({"key": [1]}, r"key must be hashable .*got \[1\]; use a tuple or a string"),
        ({"key": {"run": 1}}, r"key must be hashable"),
        ({"debug": "yes"}, r"debug must be True or False, got 'yes'"),
        ({"arena": "on"}, r"arena must be True, False or None"),
        ({"offload": 1}, r"offload must be True, False or None"),
    ],
)
def test_options_of_the_wrong_type_are_refused_when_the_tape_is_made(kwargs, match):
    """Not at the first step, where a wrong key used to fail (unhashable in the registry)."""
    with pytest.raises(TypeError, match=match):
        coexec.GradientTape(**kwargs)


def test_max_traces_caps_tracing_with_one_warning():
    w = torch.randn(4, requires_grad=True)
    tape = coexec.GradientTape(backend="interpret", key="cap", max_traces=2)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on") as rec:
        for i in range(6):
            with tape:
                y = w * 1
                for _ in range(i):  # a different path every step
                    y = y.sin() if _ % 2 else y.cos() + i
                y.sum().backward()
    assert len(rec) == 1
    assert tape.stats.phase == "eager" and tape.stats.traces == 2 and tape.stats.steps == 6
