"""``GradientTape(backend="native")``: steps captured by executor/capture.py train bit-equal to
eager (the example programs, those whose sizes change, ``tape.gradient``), count in the tape's
statistics, raise what the step raised, and run eagerly while the native module is not built."""

from __future__ import annotations

import re

import pytest
import torch

import coexec
from coexec.native_traces import COVERED_IN_A_ROW
from examples.dynamic_programs import DYNAMIC_PROGRAMS
from examples.programs import PROGRAMS
from executor import native
from executor.capture import is_placeholder
from tests.coexec.helpers import assert_same_as_eager, train_step

pytestmark = pytest.mark.skipif(
    not native.enabled(), reason="the native backend needs the native module"
)

STEPS = 10


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_program_is_bit_equal_to_eager(program) -> None:
    tape = assert_same_as_eager(lambda: program(0), lambda p, i: p.step(i), STEPS, backend="native")
    s = tape.stats
    assert (s.steps, s.coexec_steps, s.fallbacks) == (STEPS, STEPS, 0)
    assert s.last_phase == "coexec" and 0 < s.native_ops <= s.last_ops
    # its traced steps merged into the graph (tests/coexec/test_native_traces.py)
    assert 1 <= s.traces <= tape.graph.traces and tape.graph.stats()["nodes"] > 0


def test_backward_after_a_known_path_is_a_gradient_block() -> None:
    """From the first step not traced on (a traced step runs the engine, its ops logged one by
    one: coexec/native_traces.py; a static program's first 1 + COVERED_IN_A_ROW steps are
    traced) ``loss.backward()`` runs no autograd engine; the stats say so, and the training is
    eager's."""
    program = next(p for p in PROGRAMS if p.name == "static_mlp")
    eager, captured = program(0), program(0)
    tape = coexec.GradientTape(backend="native", key=("native", "blocks"))
    blocks = []
    traced = 1 + COVERED_IN_A_ROW
    for i in range(traced + 3):
        want = eager.step(i)
        with tape:
            got = captured.step(i)
        blocks.append(tape.stats.gradient_blocks)
        assert torch.equal(want, got)
    assert blocks == [0] * traced + [1, 1, 1]


@pytest.mark.parametrize("program", DYNAMIC_PROGRAMS, ids=[p.name for p in DYNAMIC_PROGRAMS])
def test_program_whose_sizes_change_is_bit_equal_to_eager(program) -> None:
    """Each new size is a miss, run at once as eager; no trace limit to reach."""
    tape = assert_same_as_eager(lambda: program(0), lambda p, i: p.step(i), 12, backend="native")
    assert tape.stats.coexec_steps == 12


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
    data = [(torch.randn(8, 6), torch.randn(8, 2)) for _ in range(3)]
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=0.01), "data": data}


def test_tape_gradient_is_bit_equal_to_eager() -> None:
    def step(state: dict, i: int, tape: coexec.GradientTape | None = None) -> torch.Tensor:
        model, opt = state["model"], state["opt"]
        x, y = state["data"][i % 3]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if tape is None:
            for p, g in zip(
                model.parameters(), torch.autograd.grad(loss, list(model.parameters()))
            ):
                p.grad = g
        else:
            tape.gradient(loss, model.parameters())
        opt.step()
        return loss

    eager, captured = _state(), _state()
    tape = coexec.GradientTape(backend="native", key=("native", "gradient"))
    blocks = []
    for i in range(8):
        want = step(eager, i)
        with tape:
            got = step(captured, i, tape)
        blocks.append(tape.stats.gradient_blocks)
        assert got.item() == want.item()
    # (the steps traced run the engine, test above: Adam's first step makes its state, so two
    # traces, then three covered)
    traced = tape._program.native_traces.traced
    assert traced == 2 + COVERED_IN_A_ROW
    assert blocks[traced:] == [1] * (8 - traced)  # (its torch.autograd.grad answered by a gradient block)
    for a, b in zip(eager["model"].parameters(), captured["model"].parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad) and not is_placeholder(b.grad)


def test_an_error_in_the_step_is_raised_unchanged_and_the_next_step_runs() -> None:
    state = _state()
    tape = coexec.GradientTape(backend="native", key=("native", "error"))
    with tape:
        train_step(state, 0)
    with pytest.raises(KeyError, match="boom"), tape:
        train_step(state, 1)
        raise KeyError("boom")
    with tape:
        loss = train_step(state, 2)
    assert torch.isfinite(loss) and tape.stats.steps == 3


def _gather(w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.index_select(w, 0, index)


def test_a_failure_on_the_worker_is_eagers_error_naming_the_line() -> None:
    w = torch.randn(5, 2)
    tape = coexec.GradientTape(backend="native", key=("native", "worker failure"))
    with tape:
        _gather(w, torch.tensor([0, 1]))
    line = _gather.__code__.co_firstlineno + 1
    with pytest.raises(IndexError, match="index out of range") as raised, tape:
        _gather(w, torch.tensor([0, 7]))
    assert any(re.search(rf"test_native_backend\.py:{line} in _gather", n) for n in raised.value.__notes__)


def test_debug_says_which_steps_met_new_ops(capsys) -> None:
    state = _state()
    state["data"][2] = (torch.randn(5, 6), torch.randn(5, 2))  # (a batch of another size)
    tape = coexec.GradientTape(backend="native", key=("native", "debug"), debug=True)
    for i in range(6):
        with tape:
            train_step(state, i)
    lines = [x for x in capsys.readouterr().err.splitlines() if "were new at their line" in x]
    # step 0 meets every op (unless a test before ran these lines: the cache is the process's),
    # step 2 the other size; steps 3-5 repeat the sizes of 0-2
    steps = [x.split(": step ")[1].split(":")[0] for x in lines]
    assert steps in (["0", "2"], ["2"])


def test_debug_says_why_a_backward_ran_the_engine(capsys) -> None:
    state = _state()
    tape = coexec.GradientTape(backend="native", key=("native", "debug engine"), debug=True)
    for i in range(4):
        with tape:
            x, y = state["data"][i % 3]
            state["opt"].zero_grad()
            h = state["model"](x)
            h.register_hook(lambda g: g)
            torch.nn.functional.mse_loss(h, y).backward()
            state["opt"].step()
    lines = [x for x in capsys.readouterr().err.splitlines() if "ran the autograd engine" in x]
    assert len(lines) == 4 and "hooks" in lines[-1]


def test_steps_run_eagerly_until_the_native_module_is_built(monkeypatch) -> None:
    monkeypatch.setattr(native, "ready", lambda: None)
    state = _state()
    tape = coexec.GradientTape(backend="native", key=("native", "not built"))
    with tape:
        loss = train_step(state, 0)
    assert not is_placeholder(loss)
    s = tape.stats
    assert (s.steps, s.coexec_steps, s.last_phase, s.phase) == (1, 0, "eager", "eager")


def test_sync_none_on_the_native_backend_ends_each_step_with_its_values_computed() -> None:
    """``sync="none"`` lets a step run on; a native step ends computed anyway, so state read
    after the block without ``coexec.synchronize()`` (an optimizer step outside it, gradients
    zeroed in place and accumulated by the step: the fuzzer's seed 3005) is eager's."""

    def run(tape: coexec.GradientTape | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(6):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            opt.zero_grad(set_to_none=False)
            if tape is None:
                torch.nn.functional.mse_loss(model(x), y).backward()
            else:
                with tape:
                    torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # (outside the step, no synchronize)
        return [p.detach().clone() for p in model.parameters()]

    tape = coexec.GradientTape(backend="native", sync="none", key=("native", "sync none"))
    got = run(tape)
    assert tape.backend == "native" and tape.stats.coexec_steps == 6
    for a, b in zip(run(None), got):
        assert torch.equal(a, b)


def test_native_and_interpreted_steps_of_one_model_keep_their_order() -> None:
    """An interpreted step left running (``sync="none"``) finishes before a native step starts:
    both update the same parameters."""
    eager, mixed = _state(), _state()
    lazy = coexec.GradientTape(backend="interpret", sync="none", key=("native", "mixed lazy"))
    captured = coexec.GradientTape(backend="native", key=("native", "mixed native"))
    for i in range(6):
        train_step(eager, i)
        with lazy if i % 2 else captured:
            train_step(mixed, i)
    coexec.synchronize()
    for a, b in zip(eager["model"].parameters(), mixed["model"].parameters()):
        assert torch.equal(a, b)
