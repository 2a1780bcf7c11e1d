"""``GradientTape(backend="native", memory_budget=...)``: a described step planned in the
background (``coexec/native_plans.py``), the steps after it following the plan (activations
dropped and made again on the worker), bit-equal to eager and within the budget."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

import coexec
from coexec import TapeStats, native_budget, native_plans
from executor import native

pytestmark = pytest.mark.skipif(not native.enabled(), reason="the native backend needs the native module")


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 4))
    data = [(torch.randn(256, 64), torch.randn(256, 4)) for _ in range(3)]
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=0.01), "data": data}


def _step(state: dict, i: int) -> torch.Tensor:
    model, opt = state["model"], state["opt"]
    x, y = state["data"][i % 3]
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _train_until_planned(tape: coexec.GradientTape, eager: dict, captured: dict, after: int) -> list[TapeStats]:
    """Steps in turn, eager and taped, asserting equal losses, until ``after`` steps have run
    with the plan in use (its planning process may take seconds to start), then equal
    parameters and optimizer state; the statistics after each planned step."""
    planned: list[TapeStats] = []
    i = 0
    deadline = time.monotonic() + 120
    while len(planned) < after:
        assert time.monotonic() < deadline, "no memory plan arrived in 120 s"
        want = _step(eager, i)
        with tape:
            got = _step(captured, i)
        assert torch.equal(want, got), f"step {i}"
        s = tape.stats
        if s.planned_peak_bytes is not None:
            planned.append(s)
            assert (s.recompute_seconds > 0) == (s.recomputed_ops > 0)
        else:
            time.sleep(0.02)  # (the planning process starting)
        i += 1
    for (name, a), b in zip(eager["model"].named_parameters(), captured["model"].parameters()):
        assert torch.equal(a, b), name
    for se, sc in zip(eager["opt"].state.values(), captured["opt"].state.values()):
        for k in se:
            assert torch.equal(se[k], sc[k]), k
    return planned


def test_steps_under_a_budget_recompute_and_stay_within_it() -> None:
    probe = coexec.GradientTape(backend="native", memory_budget=1, key=("native budget", "probe"))
    with pytest.raises(coexec.BudgetTooSmall) as small:
        _train_until_planned(probe, _state(), _state(), 1)
    smallest = small.value.smallest
    # between the smallest budget a plan meets and what the step holds unplanned
    budget = smallest + 64 * 256 * 4
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("native budget", "fits"))
    planned = _train_until_planned(tape, _state(), _state(), 4)
    s = tape.stats
    assert all(p.recomputed_ops > 0 for p in planned)
    assert s.planned_peak_bytes <= budget and s.peak_bytes <= budget and s.over_budget_steps == 0
    (row,) = tape.report()
    assert row["planned peak"] == s.planned_peak_bytes < row["eager peak"]
    assert row["recomputed"] > 0 and row["predicted seconds"] > 0 and row["arena"] is None


_AFTER_EAGER = """
import importlib.util, json, sys
import torch
spec = importlib.util.spec_from_file_location("nb", sys.argv[1])
nb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nb)
eager, captured = nb._state(), nb._state()
for i in range(2):  # (the program's first steps, eagerly: Adam's state made there)
    nb._step(eager, i)
    nb._step(captured, i)
import coexec
tape = coexec.GradientTape(backend="native", memory_budget=int(sys.argv[2]), key="after eager")
want = nb._step(eager, 2)
with tape:
    got = nb._step(captured, 2)
s = tape.stats
print(json.dumps([torch.equal(want, got), s.last_phase, s.recomputed_ops, s.peak_bytes, s.over_budget_steps]))
"""


def test_the_state_python_holds_counts_each_storage_once_and_skips_tensors_without_memory() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = native_plans._python_tensor_bytes()
    big = torch.zeros(1 << 18)  # (1 MiB)
    views = [big[1:], big.view(512, 512)]
    with FakeTensorMode():
        fake = torch.empty(1 << 20)  # (no memory: counted as none, not an error)
    assert native_plans._python_tensor_bytes() - before == 1 << 20
    del big, views, fake


def test_a_program_under_a_budget_starts_the_planning_process_before_its_first_plan() -> None:
    """The child that makes plans imports torch for a second or two: it starts with the
    program's budget, so the first plan, asked for two steps later, does not wait for that."""
    native_plans._child.close()
    assert native_plans._child._proc is None
    native_plans.NativeBudget(10**9, "here")
    proc = native_plans._child._proc
    assert proc is not None and proc.poll() is None


def test_a_first_budgeted_step_after_eager_ones_holds_the_budget() -> None:
    """A program's first step under a budget, in a fresh process, after eager steps: the model
    and the optimizer state were made before coexec loaded its allocator, which does not count
    them; its guard counts the storages Python's tensors hold too. (With the allocator's count
    alone, the guard took their bytes for room: 11% over the budget, nothing made again.)"""
    budget = _smallest("after eager probe", offload=False) + 64 * 256 * 4
    out = subprocess.run(
        [sys.executable, "-c", _AFTER_EAGER, __file__, str(budget)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    equal, phase, recomputed, peak, over = json.loads(out.stdout.strip().splitlines()[-1])
    assert equal and phase == "coexec" and recomputed > 0
    assert 0 < peak <= budget and over == 0, (peak, budget)


def test_the_smallest_budget_it_names_holds_and_a_planned_step_measures_what_it_planned() -> None:
    """One definition of a step's bytes (the state it found, and the bytes it made at their
    most) for the plan, the measured peak and BudgetTooSmall: at the smallest budget the error
    names, the planned steps hold it, and each measures its planned peak. (Counted from the
    allocator's live bytes, the steps' peaks were 12% under their plans: the gradients of the
    step before, let go of by ``zero_grad()`` without an op reading them, made room; and at the
    planner's smallest, the guard beside the plan dropped values it kept, 6% over the budget.)"""
    probe = coexec.GradientTape(backend="native", memory_budget=1, key=("native budget", "probe smallest"))
    with pytest.raises(coexec.BudgetTooSmall) as small:
        _train_until_planned(probe, _state(), _state(), 1)
    budget = small.value.smallest
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("native budget", "smallest"))
    _train_until_planned(tape, _state(), _state(), 3)
    s = tape.stats
    assert s.over_budget_steps == 0 and s.peak_bytes <= budget
    assert s.planned_peak_bytes <= budget - native_budget.UNSEEN_BYTES
    assert abs(s.peak_bytes - s.planned_peak_bytes) <= 0.01 * s.planned_peak_bytes, (s.peak_bytes, s.planned_peak_bytes)


def test_a_budget_no_plan_meets_names_the_smallest_at_the_next_step() -> None:
    tape = coexec.GradientTape(backend="native", memory_budget="1KiB", key=("native budget", "small"))
    state = _state()
    with pytest.raises(coexec.BudgetTooSmall, match="smallest feasible budget") as small:
        deadline = time.monotonic() + 120
        for i in range(10**6):
            assert time.monotonic() < deadline
            with tape:
                _step(state, i)
            time.sleep(0.02)
    assert small.value.budget == 1024 and small.value.smallest > 1024
    assert "this step has not run" in str(small.value)


def _smallest(key: str, offload: bool) -> int:
    probe = coexec.GradientTape(backend="native", memory_budget=1, key=("native budget", key), offload=offload)
    with pytest.raises(coexec.BudgetTooSmall) as small:
        _train_until_planned(probe, _state(), _state(), 1)
    return small.value.smallest


def test_offloading_parks_activations_in_the_host_pool_within_the_budget() -> None:
    """``offload=True`` on the native backend: at the smallest budget recomputation alone meets,
    the plan parks activations in the host pool instead (the worker copies their storage out
    and releases it, and copies it back before the backward reads it), bit-equal, each planned
    step within the budget and within 1% of its planned peak."""
    budget = _smallest("offload probe", offload=False)
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("native budget", "offload"), offload=True)
    parked = []
    eager, captured = _state(), _state()
    for _ in range(3):
        _train_until_planned(tape, eager, captured, 1)
        parked.append(tape.stats.offloaded_storages)
        s = tape.stats
        assert s.peak_bytes <= budget and s.over_budget_steps == 0
        assert abs(s.peak_bytes - s.planned_peak_bytes) <= 0.01 * s.planned_peak_bytes, (s.peak_bytes, s.planned_peak_bytes)
    assert all(p > 0 for p in parked), parked
    (row,) = tape.report()
    assert row["offloaded"] > 0 and row["planned peak"] <= budget - native_budget.UNSEEN_BYTES
    assert _smallest("offload probe 2", offload=True) <= budget


def test_a_parked_value_read_before_it_was_due_back_has_its_value() -> None:
    """A step that leaves the plan's path reads the hidden layers' outputs between the forward
    and the backward, where the plan had them parked: each comes back where it is read, its
    value eager's; and outputs Python keeps past a step's end come back before the next step
    reuses the pool."""
    budget = _smallest("early probe", offload=False)
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("native budget", "early"), offload=True)
    eager, captured = _state(), _state()
    _train_until_planned(tape, eager, captured, 2)
    outputs: dict[str, list] = {"eager": [], "captured": []}

    def keep(into: list):
        return lambda module, args, out: into.append(out)

    for name, state in (("eager", eager), ("captured", captured)):
        for layer in state["model"][:-1]:
            layer.register_forward_hook(keep(outputs[name]))

    def step_reading_hidden(state: dict, i: int) -> torch.Tensor:
        model, opt = state["model"], state["opt"]
        x, y = state["data"][i % 3]
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        hidden = torch.stack([h.sum() for h in outputs["eager" if state is eager else "captured"]])
        loss.backward()
        opt.step()
        return torch.cat([loss.detach().reshape(1), hidden.detach()])

    early0 = coexec.runtime.capture().counters.back_early
    for i in range(3):
        for o in outputs.values():
            o.clear()
        want = step_reading_hidden(eager, i)
        with tape:
            got = step_reading_hidden(captured, i)
        assert torch.equal(want, got), i
    assert coexec.runtime.capture().counters.back_early > early0
    # (a step that skips its backward, its hidden outputs kept: parked at its end, they come
    # back there, and are eager's after the steps after it reused the pool)
    for o in outputs.values():
        o.clear()
    early0 = coexec.runtime.capture().counters.back_early
    for name, state in (("eager", eager), ("captured", captured)):
        with tape if name == "captured" else contextlib.nullcontext():
            F.mse_loss(state["model"](state["data"][0][0]), state["data"][0][1])
    assert coexec.runtime.capture().counters.back_early > early0
    kept = {name: list(o) for name, o in outputs.items()}
    for o in outputs.values():
        o.clear()
    for i in range(3, 5):
        _step(eager, i)
        with tape:
            _step(captured, i)
    assert all(torch.equal(a, b) for a, b in zip(kept["eager"], kept["captured"]))
    for (name, a), b in zip(eager["model"].named_parameters(), captured["model"].parameters()):
        assert torch.equal(a, b), name


def test_each_dropped_storage_is_freed_after_its_own_last_need() -> None:
    """An op's outputs may be needed to different points before its recompute: the worker frees
    each after its own last need, as the simulator counts them (freeing both after the later
    one held a ResNet-50 weight gradient 2 MB past the plan, over its budget)."""
    from coexec.native_budget import drop_places
    from planner import Access, PlanningGraph, StorageFacts, plan_remat, replay

    ops = [
        Access("two", 1.0, (0,), (), (1, 2)),  # a and b
        Access("last_of_a", 1.0, (1,), (), (3,)),
        Access("last_of_b", 1.0, (2, 3), (), (4,)),
        Access("big", 1.0, (4,), (), (5,)),
        Access("shrink", 1.0, (5,), (), (6,)),
        Access("both_again", 1.0, (6, 1, 2), (), (7,)),
    ]
    sizes_released = ((100, 5), (100, 5), (10, 2), (10, 3), (300, 4), (10, 5))
    storages = [StorageFacts(10, True)] + [StorageFacts(n, False, released=r) for n, r in sizes_released]
    storages.append(StorageFacts(10, False, alive_at_end=True))
    g = PlanningGraph.from_accesses(ops, storages)
    kept = replay(g, list(range(len(g)))).peak
    plan = plan_remat(g, kept - 100)
    assert [c.op for c in plan.dropped] == [0]
    assert drop_places(plan) == {1: [1], 2: [2]}
    sim = replay(g, plan.order, dropped=plan.dropped)
    assert sim.live[2] == 100 + 10 + 10  # (b, and what last_of_a and last_of_b made: a is gone)


def _warned_until(tape: coexec.GradientTape, step, words: str) -> list:
    """Steps ``step(i)`` under ``tape`` until a RuntimeWarning with ``words`` comes (its
    planning process may take seconds to start), then 40 more; the warnings."""
    deadline = time.monotonic() + 120
    with pytest.warns(RuntimeWarning, match=words) as caught:
        for i in range(10**6):
            assert time.monotonic() < deadline, "no warning in 120 s"
            with tape:
                step(i)
            if any(words in str(c.message) for c in caught):
                break
            time.sleep(0.02)
        for j in range(i + 1, i + 40):  # (more of them, and replanned: no second warning)
            with tape:
                step(j)
    return [c for c in caught if words in str(c.message)]


def test_a_budget_whose_steps_run_ops_at_once_at_new_sizes_says_it_has_no_plan() -> None:
    """A step whose sizes are new at every step (a length drawn per step, here one never used
    elsewhere in the process) and which has an op the capture cannot answer without running it
    (a masked selection: its shape follows its data) runs that op at once, so it cannot be
    described: the budget has no plan, and a warning says so once (rather than the steps running
    at eager's peak in silence)."""
    torch.manual_seed(0)
    w = torch.randn(16, 8, requires_grad=True)
    tape = coexec.GradientTape(backend="native", memory_budget="1GB", key=("native budget", "sizes"))

    def step(i: int) -> None:
        h = torch.tanh(torch.randn(1000 + 13 * i, 16) @ w)
        (h[h > 0] ** 2).mean().backward()

    assert len(_warned_until(tape, step, "has no plan yet")) == 1
    assert tape.stats.planned_peak_bytes is None


def test_a_budget_whose_ops_change_every_step_says_its_plan_does_not_fit_them() -> None:
    """A step with one more layer at every step is described and planned, but no later step has
    the planned step's ops, so none follows the plan: a warning says so once."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    tape = coexec.GradientTape(backend="native", memory_budget="1GB", key=("native budget", "depth"))

    def step(i: int) -> None:
        h = torch.randn(64, 16)
        for _ in range(i + 1):
            h = torch.tanh(h @ w)
        h.sum().backward()

    assert len(_warned_until(tape, step, "did not follow")) == 1
    # (planned, and the latest step followed no plan: no planned peak for it)
    assert tape.stats.plans_made >= 1 and tape.stats.planned_peak_bytes is None


def test_a_plan_made_at_one_size_is_followed_at_others() -> None:
    """Following a plan asks for the planned step's ops, not its sizes: a step whose batch size
    changes follows a plan made at another size (recomputing what it drops, bit-equal)."""
    probe = coexec.GradientTape(backend="native", memory_budget=1, key=("native budget", "sized probe"))
    with pytest.raises(coexec.BudgetTooSmall) as small:
        _train_until_planned(probe, _state(), _state(), 1)
    budget = small.value.smallest + 64 * 256 * 4
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("native budget", "sized"))
    eager, captured = _state(), _state()
    for state in (eager, captured):  # (batches of 256 and 224 rows in turn)
        state["data"] = [(x[: 256 - 32 * (k % 2)], y[: 256 - 32 * (k % 2)]) for k, (x, y) in enumerate(state["data"])]
    planned = _train_until_planned(tape, eager, captured, 6)
    assert all(p.recomputed_ops > 0 for p in planned)


class _FakeCapture:
    """What NativeBudget asks of a capture: counters, whether the step followed the plan, and
    the described step (a stand-in: the plans are made by the fake _submit below)."""

    def __init__(self) -> None:
        self.counters = types.SimpleNamespace(remade=0, remade_seconds=0.0, misses=0, parked=0, placed=0)
        self.followed = False
        self.outgrew = False  # (a step that made a value larger than the plan's)
        self.described = 0
        self.cap = None

    def describe_next(self) -> None:
        self.described += 1

    def follow(self, drops, other_paths=()) -> None:
        self.followed = drops is not None

    @property
    def followed_path(self) -> int:
        return 0 if self.followed else -1

    def guard(self, cap: int) -> None:
        self.cap = cap

    def description(self):
        # (10 bytes existed before the step: its persistent state; the ops of _plan's path)
        ops = [types.SimpleNamespace(at_once=False, op_id=k) for k in (1, 2, 3)]
        return types.SimpleNamespace(storage_bytes=(10, 4), existed=(True, False), ops=ops)


class _FakeCpu:
    def __init__(self) -> None:
        self.peak = 0  # (of the bytes made in the step)
        self.live = 0
        self.made = 0  # (the bytes made in the step still alive)

    def reset_cpu_peak(self) -> None:
        pass

    def cpu_bytes(self) -> tuple[int, int]:
        return self.live, self.peak

    def cpu_bytes_made(self) -> tuple[int, int]:
        return self.made, self.peak


def _fake_step(b, capture: _FakeCapture, cpu: _FakeCpu, held: int, outgrew: bool = False):
    """A step of NativeBudget ``b`` on the fakes that held ``held`` bytes (``outgrew``: it made a
    value larger than the plan's, and stopped following it there): its stats."""
    b.before(capture, cpu)
    capture.outgrew = outgrew and capture.followed
    capture.followed = capture.followed and not outgrew
    cpu.peak = held
    stats = types.SimpleNamespace(peak_bytes=0, planned_peak_bytes=None, recomputed_ops=0,
                                  recompute_seconds=0.0, over_budget_steps=0)  # fmt: skip
    b.after(capture, cpu, stats)
    return stats


def _plan(eager_peak: int, planned_peak: int):
    from coexec.native_budget import NativeBudgetPlan
    from executor.step_plans import DropPlan

    drops = DropPlan((1, 2, 3), frozenset(), {})
    return NativeBudgetPlan(drops, 100, eager_peak, planned_peak, 0, 1, 0.0, 0.0, "test", 0.0)


def _answer(b, description, plan):
    """What the planning child answers NativeBudget ``b`` for ``description``: ``plan``, or, for
    the paths to plan together (a budget without an arena: coexec.native_budget.PathsToPlan, the
    described steps of the paths planned so far and the new one), the plans in use for the paths
    before and ``plan`` (or its BudgetTooSmall) for the new one."""
    if not isinstance(description, native_budget.PathsToPlan):
        return plan
    return [b.plan] * (len(description.planned) - 1) + [plan]


def test_the_plan_in_use_is_the_largest_steps_described(monkeypatch) -> None:
    """Sizes that change: a step that follows the plan and holds more than it planned (its sizes
    grew) has the next step described; a plan made for a smaller step than the one in use (by
    their unplanned peaks) is left unused."""
    from concurrent.futures import Future

    from coexec import native_plans

    plans = iter([_plan(150, 90), _plan(200, 95), _plan(120, 80)])

    def submit(description, budget, bandwidth, arena):
        f: Future = Future()
        f.set_result(_answer(b, description, next(plans)))
        return f

    monkeypatch.setattr(native_plans, "_submit", submit)
    monkeypatch.setattr(native_plans, "_python_tensor_bytes", lambda: 7)
    b = native_plans.NativeBudget(100, "here")
    capture, cpu = _FakeCapture(), _FakeCpu()

    def step(held: int):
        return _fake_step(b, capture, cpu, held)

    for i in range(native_plans.WARM_UP + 1):  # (the third step is described to be planned)
        # (the first step's state is not known: the guard counts all that was alive as it began,
        # the storages of Python's tensors, 7 bytes here; steps without a plan are described for
        # the state they find, 10 bytes, and the guard of the steps after keeps theirs within
        # what the budget leaves beside it)
        step(140)
        assert capture.cap == (93 if i == 0 else 90)
    assert capture.described == 3
    assert step(90).planned_peak_bytes == 90 and capture.followed  # plan 1 taken
    assert capture.cap == 100  # the guard: the budget less the state the plan counts (none here)
    step(90)  # (within what it planned: nothing described)
    assert capture.described == 3
    step(120)  # (followed, and held more than planned: the sizes grew)
    step(100)  # described
    assert capture.described == 4
    assert step(95).planned_peak_bytes == 95  # plan 2, of a larger step, taken
    step(150)  # outgrown again: the next described
    step(50)
    assert capture.described == 5
    assert step(50).planned_peak_bytes == 95  # plan 3, of a smaller step, left unused


def test_a_step_that_made_a_larger_value_than_planned_has_the_next_described(monkeypatch) -> None:
    """A step that stopped following the plan at a value larger than the planned step's (the
    capture's ``outgrew``) grew past it, whatever it held: the next step is described, the steps
    until its plan arrives follow none (the guard alone holds them), and it does not count as a
    step off the plan's path."""
    from concurrent.futures import Future

    from coexec import native_plans

    plans = iter([_plan(150, 90), _plan(200, 95)])
    waiting: list[tuple[Future, object]] = []

    def submit(description, budget, bandwidth, arena):
        f: Future = Future()
        waiting.append((f, description))
        return f

    def answer() -> None:
        f, description = waiting.pop()
        f.set_result(_answer(b, description, next(plans)))

    monkeypatch.setattr(native_plans, "_submit", submit)
    b = native_plans.NativeBudget(100, "here")
    capture, cpu = _FakeCapture(), _FakeCpu()
    for _ in range(native_plans.WARM_UP + 1):
        _fake_step(b, capture, cpu, 140)
    answer()
    assert _fake_step(b, capture, cpu, 90).planned_peak_bytes == 90 and capture.followed
    _fake_step(b, capture, cpu, 80, outgrew=True)  # (held less than planned: the sizes grew all the same)
    assert b.unfollowed == 0
    described = capture.described
    _fake_step(b, capture, cpu, 100)
    assert capture.described == described + 1
    assert _fake_step(b, capture, cpu, 100).planned_peak_bytes is None  # (the guard alone until the plan)
    answer()
    assert _fake_step(b, capture, cpu, 95).planned_peak_bytes == 95 and capture.followed


def test_state_a_first_step_makes_counts_as_state_for_the_steps_after_it(monkeypatch) -> None:
    """An optimizer's state is made in the first step: the step found 10 bytes of state and
    left 40 more alive, so the next step's guard leaves the budget less 50 for the bytes it makes
    (counted as found, the second step had 40 bytes too many and went 3% over on
    bench/dynamic_budget.py); the first step's peak counts the state it found."""
    monkeypatch.setattr(native_plans, "_python_tensor_bytes", lambda: 0)
    b = native_plans.NativeBudget(100, "here")
    capture, cpu = _FakeCapture(), _FakeCpu()
    b.before(capture, cpu)
    assert capture.cap == 100  # (nothing alive as it began: all of the budget)
    cpu.peak, cpu.made, cpu.live = 70, 40, 40
    stats = types.SimpleNamespace(peak_bytes=0, planned_peak_bytes=None, recomputed_ops=0,
                                  recompute_seconds=0.0, over_budget_steps=0)  # fmt: skip
    b.after(capture, cpu, stats)
    assert stats.peak_bytes == 10 + 70 and stats.over_budget_steps == 0
    b.before(capture, cpu)
    assert capture.cap == 100 - 50  # (the bytes the step makes: the budget less the state)


def _rows(state: dict, rows: list[int]) -> dict:
    """``state`` whose step ``i`` trains on a batch of ``rows[i]`` rows."""
    x, y = state["data"][0]
    state["data"] = [(torch.cat([x] * 2)[:n], torch.cat([y] * 2)[:n]) for n in rows]
    return state


def _step_i(state: dict, i: int) -> torch.Tensor:
    return _step({**state, "data": [state["data"][i]] * 3}, 0)


@pytest.fixture
def one_thread():
    """One intra-op thread, restored after (later tests compare eager with captures made at the
    process's count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_steps_larger_than_any_planned_stay_within_the_budget(one_thread) -> None:
    """Sizes that grow after the described step (batches of 192 rows, then 320: larger than any
    described or planned, 25% over the budget unguarded): from the first step on, the guard
    (``Capture.guard``) holds every step within 2% of the budget, before the plan arrives and
    after (issue 17), bit-equal to eager. (Where the worker ran right behind
    the skeleton's gradient block, values the block's issuing still held stayed after their last
    read and a step went up to 2x over, about one step in 150: ``Capture::issue_block``.)"""
    native.wait()  # (while the module loads, steps run eagerly and measure no peak)
    rows = [192] * 4 + [320] * 16
    probe = coexec.GradientTape(backend="native", memory_budget="100GB", key=("native budget", "growing probe"))
    state = _rows(_state(), rows)
    for i in range(6):
        with probe:
            _step_i(state, i)
    budget = int(0.8 * probe.stats.peak_bytes)  # (of a step of 320 rows)
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("native budget", "growing"))
    eager, captured = _rows(_state(), rows), _rows(_state(), rows)
    evicted0 = coexec.runtime.capture().counters.evicted
    held = []
    for i in range(len(rows)):
        expected = _step_i(eager, i)
        with tape:
            got = _step_i(captured, i)
        assert torch.equal(got, expected), f"step {i}"
        held.append(tape.stats.peak_bytes / budget)
    # (unguarded, these steps held 25% over. The guard counts a kernel's workspace as the most it
    # met, and a value made again for an op as its chain counted: a step may go a little over,
    # 0.6% here at most. Where the smaller step's plan arrived among the larger steps, a step
    # that followed it beside the guard went up to 9% over, until a step stopped following a
    # plan at its first value larger than the planned step's)
    said = " ".join(f"{h:.3f}" for h in held)  # (in step order: a failure says which steps)
    assert max(held) <= 1.02, said
    assert coexec.runtime.capture().counters.evicted > evicted0
    for a, b in zip(eager["model"].parameters(), captured["model"].parameters()):
        assert torch.equal(a, b)


def test_a_larger_steps_plan_that_cannot_meet_the_budget_leaves_the_steps_to_the_guard(monkeypatch) -> None:
    """A step larger than the planned one is described, and the steps after it run on the guard
    alone until its plan arrives; where the planner cannot meet the budget at its sizes (the guard
    may: it frees what the planner counts), they stay on the guard alone (the smaller step's plan
    is not followed), a warning says so once, training goes on, and larger steps are not described
    again."""
    from concurrent.futures import Future

    from coexec import native_plans
    from planner import BudgetTooSmall

    def submit(description, budget, bandwidth, arena):
        f: Future = Future()
        if submit.calls == 0:
            f.set_result(_plan(150, 90))
        else:  # (the paths planned together: the error is the described step's answer)
            f.set_result(_answer(b, description, BudgetTooSmall(budget, 130)))
        submit.calls += 1
        return f

    submit.calls = 0
    monkeypatch.setattr(native_plans, "_submit", submit)
    b = native_plans.NativeBudget(100, "here")
    capture, cpu = _FakeCapture(), _FakeCpu()

    def step(held: int):
        return _fake_step(b, capture, cpu, held)

    for _ in range(native_plans.WARM_UP + 1):
        step(140)
    assert step(90).planned_peak_bytes == 90  # plan 1 taken
    step(120)  # (outgrown: the next step is described)
    step(100)  # described; its plan cannot meet the budget
    with pytest.warns(RuntimeWarning, match="cannot be met by a plan at the sizes of a step larger"):
        assert step(100).planned_peak_bytes is None  # the guard alone
    assert not capture.followed and capture.cap == 100
    for _ in range(4):
        assert step(120).planned_peak_bytes is None  # no error; larger steps not described again
        assert not capture.followed and capture.cap == 100
    assert capture.described == 4 and submit.calls == 2  # (the unplanned steps' for their state)


def _branch_state(seed: int = 0) -> dict:
    """A trunk, three heads of 2, 4 and 6 layers and an output layer; 8 batches."""
    torch.manual_seed(seed)
    trunk = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh())
    heads = torch.nn.ModuleList(
        torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(128, 128), torch.nn.Tanh())])
        for depth in (2, 4, 6)
    )
    model = torch.nn.ModuleDict({"trunk": trunk, "heads": heads, "out": torch.nn.Linear(128, 1)})
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g)) for _ in range(8)]
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01), "data": data}


def _branch_step(state: dict, i: int) -> tuple[torch.Tensor, int]:
    """The head the trunk's output picks (a data-dependent 3-way branch): the loss and the head."""
    model, opt = state["model"], state["opt"]
    x, y = state["data"][i % 8]
    opt.zero_grad()
    h = model["trunk"](x)
    k = int(h.detach().sum().item() * 1000) % 3
    loss = F.mse_loss(model["out"](model["heads"][k](h)), y)
    loss.backward()
    opt.step()
    return loss.detach(), k


def test_each_branch_of_a_program_follows_its_own_plan() -> None:
    """A 3-way data-dependent branch under a budget: each branch taken is described and the
    paths are planned together (coexec/native_budget.py, ``plan_native_paths``); a step follows
    the plan of the branch it takes (``tape.stats.planned_path``), within that plan's peak and
    the budget (counting the parameters of the heads it did not take: each plan counts them),
    bit-equal to eager throughout. (With one plan at a time, steps of the other
    branches followed none, and the plan was made again for whichever branch came last.)"""
    cpu = native.wait()
    probe = _branch_state()
    tape = coexec.GradientTape(backend="native", memory_budget=10**10, key=("native budget", "branch probe"))
    # (a step's peak: the program's state, every head's parameters, as a plan counts it, and the
    # bytes the step made at their most)
    state = sum(p.untyped_storage().nbytes() for p in probe["model"].parameters())
    largest = 0
    for i in range(16):
        with tape:
            _branch_step(probe, i)
        largest = max(largest, state + cpu.cpu_bytes_made()[1])
    budget = int(0.9 * largest)  # (the largest branch recomputes; the others fit)
    eager, captured = _branch_state(), _branch_state()
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("native budget", "branches"))
    followed: dict[int, set[int]] = {}  # planned path -> heads of the steps that followed it
    recomputed = 0  # ops made again in followed steps
    held: list[int] = []  # what the process held in followed steps once every branch had a plan
    deadline = time.monotonic() + 120
    i, until = 0, None
    while until is None or i < until:
        assert time.monotonic() < deadline and i < 400, (i, followed)
        want, head = _branch_step(eager, i)
        with tape:
            got, _ = _branch_step(captured, i)
        assert torch.equal(want, got), f"step {i}"
        s = tape.stats
        if s.planned_path is not None:
            followed.setdefault(s.planned_path, set()).add(head)
            recomputed += s.recomputed_ops
            assert s.peak_bytes <= s.planned_peak_bytes <= budget, (i, s.peak_bytes, s.planned_peak_bytes)
            if until is not None:
                held.append(state + cpu.cpu_bytes_made()[1])
        if until is None and len(followed) == 3:
            until = i + 30  # (30 steps more, each path's plan counting the others' state)
        i += 1
    assert sorted(h for heads in followed.values() for h in heads) == [0, 1, 2]  # (one path per branch)
    assert recomputed > 0
    # (the parameters of the heads a step did not take held too, as each plan counts them)
    assert held and max(held) <= budget, (max(held), budget)
    for a, b in zip(eager["model"].parameters(), captured["model"].parameters()):
        assert torch.equal(a, b)
