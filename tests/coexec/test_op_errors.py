"""An op's error on the default backend is eager's (type and message), raised at the line that
called the op into whatever ``try`` the program wrote, and a program that catches it trains
as eager does (issue 51, §2 and §3): an op called inside a ``try`` that may catch its error
runs at once (``executor/try_scopes.py``), as does every op of a step called inside one."""

from __future__ import annotations

import contextlib
import os
import re
import sysconfig
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from executor import native
from executor.try_scopes import try_scopes

pytestmark = pytest.mark.skipif(not native.enabled(), reason="the default backend's capture")


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx)).mean()


def _make() -> tuple[Model, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # every third batch has an index past the table: its embedding raises IndexError
    batches = [torch.randint(0, 100 if i % 3 else 120, (16,)) for i in range(6)]
    for i in range(0, 6, 3):
        batches[i][3] = 110
    return model, opt, batches


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def handled_inside(within, steps: int):
    """``try: h = emb(idx) / except IndexError: h = emb(idx.clamp(max=99))`` in the step."""
    model, opt, batches = _make()
    losses, caught = [], 0
    for i in range(steps):
        idx = batches[i % len(batches)]
        with within():
            try:
                h = model.emb(idx)
            except IndexError:
                caught += 1
                h = model.emb(idx.clamp(max=99))
            loss = model.out(h).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses, _state(model, opt), caught


def skipped_outside(within, steps: int):
    """``try: <the whole step under the tape> / except IndexError: continue``: a failing step
    must leave the optimizer as eager leaves it (no step, no new state)."""
    model, opt, batches = _make()
    losses, caught = [], 0
    for i in range(steps):
        idx = batches[i % len(batches)]
        try:
            with within():
                opt.zero_grad()
                loss = model(idx)
                loss.backward()
                opt.step()
        except IndexError:
            caught += 1
            continue
        losses.append(loss.item())
    return losses, _state(model, opt), caught


def _train_step(model, opt, idx, within):
    with within():
        opt.zero_grad()
        loss = model(idx)
        loss.backward()
        opt.step()
    return loss


def skipped_a_frame_above(within, steps: int):
    """The ``try`` in the caller of the function whose ``with`` holds the step."""
    model, opt, batches = _make()
    losses, caught = [], 0
    for i in range(steps):
        try:
            loss = _train_step(model, opt, batches[i % len(batches)], within)
        except IndexError:
            caught += 1
            continue
        losses.append(loss.item())
    return losses, _state(model, opt), caught


def _update_then_fail(model, opt, idx, losses: list) -> None:
    """A step whose op fails after the optimizer's update (on every third batch): the update and
    the in-place op before the failing one stay, the one after it and the Python after it never
    run."""
    opt.zero_grad()
    loss = model.out(model.emb(idx.clamp(max=99))).mean()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.emb.weight.mul_(0.5)
        model.emb(idx)  # (out of range on every third batch)
        model.out.bias.add_(1.0)
    losses.append(loss)  # (the step's Python after the failing op: eager never runs it there)


def suppressed_after_the_update(within, steps: int):
    """``with contextlib.suppress(IndexError):`` around the step's ``with`` in its own frame (no
    ``try`` in any frame)."""
    model, opt, batches = _make()
    losses, caught = [], 0
    for i in range(steps):
        done = False
        with contextlib.suppress(IndexError):
            with within():
                _update_then_fail(model, opt, batches[i % len(batches)], losses)
                done = True
        caught += not done
    return [loss.item() for loss in losses], _state(model, opt), caught


@contextlib.contextmanager
def _skipping_bad_batches():
    try:
        yield
    except IndexError:
        pass


def skipped_by_a_manager_after_the_update(within, steps: int):
    """The step's ``with`` inside a ``@contextmanager`` of the program's own that catches the
    error around its ``yield`` and goes on."""
    model, opt, batches = _make()
    losses, caught = [], 0
    for i in range(steps):
        done = False
        with _skipping_bad_batches():
            with within():
                _update_then_fail(model, opt, batches[i % len(batches)], losses)
            done = True
        caught += not done
    return [loss.item() for loss in losses], _state(model, opt), caught


@pytest.mark.parametrize(
    "program",
    [
        handled_inside,
        skipped_outside,
        skipped_a_frame_above,
        suppressed_after_the_update,
        skipped_by_a_manager_after_the_update,
    ],
)
def test_a_caught_op_error_trains_as_eager(program) -> None:
    want_losses, want_state, want_caught = program(contextlib.nullcontext, 12)
    tape = coexec.GradientTape()
    got_losses, got_state, got_caught = program(lambda: tape, 12)
    assert tape.backend == "native" and tape.stats.coexec_steps == 12
    assert (got_caught, len(got_state)) == (want_caught, len(want_state)) and want_caught == 4
    assert got_losses == want_losses
    for a, b in zip(got_state, want_state):
        assert torch.equal(a, b)


def _lookup(table: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    return table(idx)


def test_an_uncaught_op_error_is_eagers_with_a_traceback_to_its_line() -> None:
    """Outside any try the op runs on the worker: its error comes where the step next waits (here
    its end), as eager's exception and message, the traceback going on to the line that called
    it, and a note saying so."""
    table = nn.Embedding(10, 4)
    bad = torch.tensor([1, 12])
    with pytest.raises(IndexError) as eager:
        _lookup(table, bad)
    tape = coexec.GradientTape()
    with tape:
        _lookup(table, torch.tensor([1, 2])).sum()
    with pytest.raises(IndexError) as captured, tape:
        _lookup(table, bad).sum()
    assert str(captured.value) == str(eager.value)
    line = _lookup.__code__.co_firstlineno + 1
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(captured.value.__traceback__)]
    assert (__file__, line, "_lookup") in frames
    assert any(re.search(rf"{re.escape(__file__)}:{line} in _lookup", n) for n in captured.value.__notes__)
    with tape:  # (the tape goes on)
        assert _lookup(table, torch.tensor([3])).shape == (1, 4)


def test_ops_in_a_handled_try_run_at_once_and_others_on_the_worker() -> None:
    table = nn.Embedding(10, 4)
    tape = coexec.GradientTape()
    for _ in range(3):
        with tape:
            a = table(torch.tensor([1, 2])).sum()
            a.item()
    plain = tape.stats.native_ops
    for _ in range(3):
        with tape:
            try:
                a = table(torch.tensor([1, 2])).sum()
            except KeyboardInterrupt:  # (no op raises it: ops stay on the worker)
                raise
            a.item()
    assert tape.stats.native_ops == plain
    for _ in range(3):
        with tape:
            try:
                a = table(torch.tensor([1, 2])).sum()
            except _LossSpike:  # (a class of the program's own, as examples' try_except's)
                pass
            a.item()
    assert tape.stats.native_ops == plain
    for _ in range(3):
        with tape:
            try:
                a = table(torch.tensor([1, 2])).sum()
            except (IndexError, RuntimeError):
                raise
            a.item()
    assert tape.stats.native_ops < plain


def _scopes_of(source: str, resolve: bool = False) -> tuple[bool, bool]:
    namespace: dict = {}
    exec(compile(source, "<spans>", "exec"), namespace)  # noqa: S102 (the test's own source)
    scopes = try_scopes(namespace["f"].__code__, namespace if resolve else None)
    return bool(scopes.catching), bool(scopes.swallowing)


class _LossSpike(Exception):
    """A program's own exception: no op raises it."""


@pytest.mark.parametrize(
    ("source", "catches"),
    [
        ("class Spike(Exception): pass\ndef f(x):\n try:\n  x = x + 1\n except Spike:\n  pass\n return x", False),
        # (a subclass of RuntimeError of the program's own: an op raises RuntimeError, not it)
        ("class Spike(RuntimeError): pass\ndef f(x):\n try:\n  x = x + 1\n except Spike:\n  pass\n return x", False),
        ("import coexec\ndef f(x):\n try:\n  x = x + 1\n except coexec.BudgetTooSmall:\n  pass\n return x", False),
        ("class Spike(Exception): pass\ndef f(x):\n try:\n  x = x + 1\n except (Spike, KeyError):\n  pass\n return x", False),
        ("class Spike(Exception): pass\ndef f(x):\n try:\n  x = x + 1\n except (Spike, IndexError):\n  pass\n return x", True),
        ("import torch\ndef f(x):\n try:\n  x = x + 1\n except torch.OutOfMemoryError:\n  pass\n return x", True),
        ("def f(x):\n try:\n  x = x + 1\n except RuntimeError:\n  pass\n return x", True),
        ("def f(x):\n try:\n  x = x + 1\n except NotDefinedYet:\n  pass\n return x", True),
        ("Spike = RuntimeError\ndef f(x):\n try:\n  x = x + 1\n except Spike:\n  pass\n return x", True),
        ("def f(x, e):\n try:\n  x = x + 1\n except e:\n  pass\n return x", True),
    ],
)
def test_a_class_of_the_programs_own_cannot_catch_an_ops_error(source: str, catches: bool) -> None:
    assert _scopes_of(source, resolve=True) == (catches, catches)
    assert _scopes_of(source, resolve=False) == (True, True)  # (not looked up: it may)


@pytest.mark.parametrize(
    ("source", "catches", "swallows"),
    [
        ("def f(x):\n try:\n  x = x + 1\n except IndexError:\n  pass\n return x", True, True),
        ("def f(x):\n try:\n  x = x + 1\n except:\n  pass\n return x", True, True),
        ("def f(x):\n try:\n  x = x + 1\n except:\n  print(x)\n  raise\n return x", True, False),
        ("def f(x):\n try:\n  x = x + 1\n except (KeyError, StopIteration):\n  pass\n return x", False, False),
        ("def f(x):\n try:\n  x = x + 1\n except KeyError:\n  pass\n except Exception:\n  pass\n return x", True, True),
        ("def f(x):\n try:\n  x = x + 1\n except KeyError:\n  pass\n except Exception as e:\n  print(e)\n  raise\n return x", True, False),
        ("def f(x):\n try:\n  x = x + 1\n except Exception as e:\n  raise ValueError() from e\n return x", True, False),
        ("def f(x):\n try:\n  x = x + 1\n except Exception:\n  if x:\n   raise\n return x", True, True),
        ("def f(x):\n try:\n  x = x + 1\n except KeyboardInterrupt:\n  raise\n return x", False, False),
        ("def f(x):\n try:\n  x = x + 1\n finally:\n  print(x)\n return x", False, False),
        ("def f(x, cm):\n with cm:\n  x = x + 1\n return x", False, False),
        ("def f(x, cm):\n try:\n  with cm:\n   x = x + 1\n except ValueError:\n  pass\n return x", True, True),
        ("import torch\ndef f(x):\n try:\n  x = x + 1\n except torch.OutOfMemoryError:\n  pass\n return x", True, True),
    ],
)
def test_which_trys_may_catch_and_swallow_an_ops_error(source: str, catches: bool, swallows: bool) -> None:
    assert _scopes_of(source) == (catches, swallows)


@pytest.mark.parametrize(
    ("source", "swallows"),
    [
        ("import contextlib\ndef f(x):\n with contextlib.suppress(IndexError):\n  x = x + 1\n return x", True),
        ("from contextlib import suppress\ndef f(x):\n with suppress(IndexError, RuntimeError):\n  x = x + 1\n return x", True),
        ("import contextlib\nclass Quiet(contextlib.suppress): pass\ndef f(x):\n with Quiet(IndexError):\n  x = x + 1\n return x", True),
        # (the suppress around the step's own `with`, two managers in one statement)
        ("import contextlib\ndef f(x, tape):\n with contextlib.suppress(IndexError):\n  with tape:\n   x = x + 1\n return x", True),
        ("import contextlib\ndef f(x, tape):\n with tape, contextlib.suppress(IndexError):\n  x = x + 1\n return x", True),
        ("import contextlib\ndef f(x):\n with contextlib.nullcontext():\n  x = x + 1\n return x", False),
        ("import torch\ndef f(x):\n with torch.no_grad():\n  x = x + 1\n return x", False),
        ("def f(x):\n with open(x) as fh:\n  x = x + 1\n return x", False),
        ("import torch\ndef f(x):\n with torch.autocast('cpu'):\n  x = x + 1\n return x", False),
        # (its __exit__ returns its base's: torch's managers hand errors on)
        ("import torch\ndef f(x):\n with torch.cuda.amp.autocast(enabled=False):\n  x = x + 1\n return x", False),
        ("def f(x, cm):\n with cm:\n  x = x + 1\n return x", False),
        # (a manager of the program's own: by what its __exit__ may return)
        ("class Skip:\n def __enter__(self): pass\n def __exit__(self, *e): return True\n"
         "def f(x):\n with Skip():\n  x = x + 1\n return x", True),
        ("class Skip:\n def __enter__(self): pass\n def __exit__(self, t, *e): return t is IndexError\n"
         "def f(x):\n with Skip():\n  x = x + 1\n return x", True),
        ("class Timer:\n def __enter__(self): pass\n def __exit__(self, *e): print(e)\n"
         "def f(x):\n with Timer():\n  x = x + 1\n return x", False),
        ("class Timer:\n def __enter__(self): pass\n def __exit__(self, *e): return False\n"
         "def f(x):\n with Timer():\n  x = x + 1\n return x", False),
        ("import contextlib\ndef f(x):\n with contextlib.ExitStack():\n  x = x + 1\n return x", True),
        # (a @contextmanager generator: by whether it catches and goes on around its yield)
        ("import contextlib\n@contextlib.contextmanager\ndef skip():\n try:\n  yield\n except IndexError:\n  print('skipped')\n"
         "def f(x):\n with skip():\n  x = x + 1\n return x", True),
        ("import contextlib\n@contextlib.contextmanager\ndef timed():\n try:\n  yield\n finally:\n  print('done')\n"
         "def f(x):\n with timed():\n  x = x + 1\n return x", False),
        ("import contextlib\n@contextlib.contextmanager\ndef logged():\n try:\n  yield\n except Exception as e:\n  print(e)\n  raise\n"
         "def f(x):\n with logged():\n  x = x + 1\n return x", False),
    ],
)
def test_a_with_whose_manager_may_swallow_catches_and_swallows(source: str, swallows: bool) -> None:
    assert _scopes_of(source, resolve=True) == (swallows, swallows)


def logged_and_raised(within, steps: int):
    """A try above the step's ``with`` that logs and re-raises: the error reaches it at the step's
    end all the same, so the step runs on the worker."""
    model, opt, batches = _make()
    losses = []
    for i in range(steps):
        try:
            loss = _train_step(model, opt, batches[1 + i % 2], within)  # (batches 1, 2: in range)
        except IndexError as e:
            print("failed:", e)
            raise
        losses.append(loss.item())
    return losses, _state(model, opt), 0


def test_a_try_above_the_step_that_re_raises_keeps_its_ops_on_the_worker() -> None:
    want_losses, want_state, _ = logged_and_raised(contextlib.nullcontext, 6)
    tape = coexec.GradientTape()
    got_losses, got_state, _ = logged_and_raised(lambda: tape, 6)
    assert got_losses == want_losses and all(torch.equal(a, b) for a, b in zip(got_state, want_state))
    assert tape.stats.native_ops > tape.stats.last_ops // 2  # (not every op at once)
    model, opt, batches = _make()
    with pytest.raises(IndexError, match="index out of range") as raised:
        try:
            _train_step(model, opt, batches[0], lambda: tape)
        except IndexError:
            raise
    assert raised.value.__notes__  # (raised at the step's end, from the worker)


def test_an_op_error_comes_at_the_next_read_as_eagers() -> None:
    """Read by ``.item()`` later in the step, the failed op's error comes there: eager's
    IndexError, noting the op's line; the step and the tape go on being usable."""
    table = nn.Embedding(10, 4)
    tape = coexec.GradientTape()
    for _ in range(2):
        with tape:
            (_lookup(table, torch.tensor([1, 2])) * 2).sum().item()
    with pytest.raises(IndexError) as raised, tape:  # (a with, not a try: the op runs on the worker)
        h = _lookup(table, torch.tensor([1, 12]))
        (h * 2).sum().item()
    assert str(raised.value) == "index out of range in self"
    assert any("in _lookup" in n for n in raised.value.__notes__)
    assert traceback.extract_tb(raised.value.__traceback__)[0].name == "test_an_op_error_comes_at_the_next_read_as_eagers"
    with tape:
        total = _lookup(table, torch.tensor([1, 2])).sum().item()
    assert total == table(torch.tensor([1, 2])).sum().item()


def _runner_in_installed_code():
    """``run(f)``: calls ``f`` and returns the name of what it raised, as a notebook's cell runner
    or a trainer's handler does, in a file the capture takes for installed code (the standard
    library's folder: such a ``try`` does not make the step's ops run at once)."""
    where = os.path.join(sysconfig.get_paths()["stdlib"], "_coexec_test_runner.py")
    namespace: dict = {}
    source = "def run(f):\n try:\n  f()\n except Exception as e:\n  return type(e).__name__\n"
    exec(compile(source, where, "exec"), namespace)  # noqa: S102 (the test's own source)
    return namespace["run"]


@pytest.mark.parametrize("foreach", [False, True])
def test_what_ops_run_ahead_wrote_after_a_failing_op_is_given_back(foreach: bool) -> None:
    """Adam's ``step_t += 1`` runs ahead of the worker (small real tensors; with ``foreach`` one
    ``_foreach_add_`` over a list of them); when an op queued before it fails and the error is
    caught outside the program's code, the step counts must be eager's, or every later update's
    bias correction differs."""
    run = _runner_in_installed_code()
    batches = [torch.tensor([1, 2, 3])] * 3 + [torch.tensor([1, 12, 3]), torch.tensor([4, 5, 6])]

    def train(within):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=foreach)

        def step(idx):
            with within():
                opt.zero_grad()
                model(idx).mean().backward()
                opt.step()

        raised = [run(lambda idx=idx: step(idx)) for idx in batches]
        return raised, _state(model, opt)

    want_raised, want_state = train(contextlib.nullcontext)
    # (a key per case: on the default backend a `with` line's statistics count every tape's steps)
    tape = coexec.GradientTape(key=("give back", foreach))
    got_raised, got_state = train(lambda: tape)
    assert tape.backend == "native" and tape.stats.coexec_steps == 5
    assert got_raised == want_raised == [None, None, None, "IndexError", None]
    assert [float(t) for t in got_state if t.dim() == 0] == [4.0, 4.0, 4.0]  # (a step count per parameter)
    for a, b in zip(got_state, want_state):
        assert torch.equal(a, b)
