"""Plans are made in a child process (coexec/plan_process.py): the same plans as made here, each
trace sent once, forgotten when let go of, and plans made here when the child cannot be had."""

from __future__ import annotations

import gc
import os
import pickle

import pytest
import torch
import torch.nn.functional as F

import coexec
import planner.program
from coexec import planning
from coexec.plan_process import PlanProcess, dumps
from coexec.planning import PlanRequest, Planner, make_plan
from planner import PathInput, Site
from tests.coexec.helpers import run
from tests.coexec.test_planning import make, step
from tracegraph import record
from tracegraph.schema import DEFAULT, FED, TENSOR_ARG


def traced(n: int = 1) -> list:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(n):
        with record() as tr:
            loss = F.mse_loss(model(torch.randn(5, 8)), torch.zeros(5, 4))
            loss.backward()
            opt.step()
            print(loss.item(), end="")
        out.append(tr)
    return out


def orders(schedule) -> dict:
    """A schedule's blocks as values (blocks themselves compare by identity)."""
    return {k: (b.order, b.bound, b.new_bytes) for k, b in schedule.blocks.items()}


def as_path(tr) -> PathInput:
    return PathInput(tr, tuple(Site(i, ()) for i in range(len(tr.ops))))


def test_a_trace_crosses_the_pipe_with_its_ops_values_and_markers():
    (tr,) = traced()
    back = pickle.loads(dumps(tr))
    assert [op.func for op in back.ops] == [op.func for op in tr.ops]  # the same OpOverloads
    assert [op.key for op in back.ops] == [op.key for op in tr.ops]
    assert [v.meta for v in back.values] == [v.meta for v in tr.values]
    assert back.storage_bytes == tr.storage_bytes and back.released == tr.released
    assert all(pickle.loads(dumps(m)) is m for m in (DEFAULT, FED, TENSOR_ARG))


def test_plans_are_made_in_another_process_and_equal_those_made_here():
    losses, state, tape = run(make, step, 6, True, key="plan-process")
    eager_losses, eager_state, _ = run(make, step, 6, False)
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    program = tape._program
    assert program.plan_pid is not None and program.plan_pid != os.getpid()
    req = PlanRequest(1, tuple(program.paths), None, None, True)
    here = make_plan(req).schedule
    assert here is not None and program.schedule is not None
    assert program.schedule.offsets == here.offsets and orders(program.schedule) == orders(here)
    assert program.schedule.arena_bytes == here.arena_bytes
    # the CPU this process spent on those plans (pickling) is counted
    assert 0 < tape.stats.plan_local_seconds


def opened(job) -> list:
    return [(len(p.trace.ops), p.sites[:1]) for p in map(pickle.loads, job.new_paths.values())]


def test_each_trace_is_sent_once_and_forgotten_when_let_go_of():
    t1, t2 = map(as_path, traced(2))
    proc = PlanProcess()
    try:
        first = proc._job(PlanRequest(1, (t1,), None, None, True))
        second = proc._job(PlanRequest(2, (t1, t2), None, None, True))
        assert opened(first) == [(len(t1.trace.ops), (Site(0, ()),))]
        assert opened(second) == [(len(t2.trace.ops), (Site(0, ()),))]
        assert second.path_ids == (*first.path_ids, *second.new_paths)
        assert first.request.paths == () and second.request.number == 2
        gone = first.path_ids[0]
        del t1, first, second
        gc.collect()
        third = proc._job(PlanRequest(3, (t2,), None, None, True))
        assert third.forget == (gone,) and third.new_paths == {}
    finally:
        proc.close()


def test_a_path_is_pickled_on_the_thread_that_asks_and_sent_as_it_is():
    # the step's thread pickles a new path when it asks for a plan (Planner.submit), so the
    # planner thread does not take the GIL from the next step to do it
    (tr,) = map(as_path, traced())
    proc = PlanProcess()
    try:
        proc.encode(tr)
        payload = proc._encoded[id(tr.trace)]
        job = proc._job(PlanRequest(1, (tr,), None, None, True))
        assert [p is payload for p in job.new_paths.values()] == [True] and proc._encoded == {}
        proc.encode(tr)  # sent already: not again
        assert proc._encoded == {}
        (other,) = map(as_path, traced())
        proc.encode(other)
        key = id(other.trace)
        del other
        gc.collect()
        assert key not in proc._encoded  # let go of before any request: dropped
    finally:
        proc.close()


def test_a_child_that_died_is_replaced_and_sent_every_trace_again():
    paths = tuple(map(as_path, traced(2)))
    proc = PlanProcess()
    try:
        a = proc.plan(PlanRequest(1, paths, None, None, False))
        pid = a.pid
        proc._proc.kill()
        proc._proc.wait()
        b = proc.plan(PlanRequest(2, paths, None, None, False))
        assert a.error is None and b.error is None and b.pid not in (None, pid)
        assert b.request.number == 2 and len(b.request.paths) == 2
    finally:
        proc.close()


def test_without_a_planning_process_plans_are_made_here_and_it_is_said(monkeypatch):
    def no_processes(self):
        raise OSError("no processes here")

    coexec.wait_for_plans(60)
    planner = Planner()
    monkeypatch.setattr(planning, "PLANNER", planner)
    monkeypatch.setattr(coexec.tape, "PLANNER", planner)
    monkeypatch.setattr(PlanProcess, "start", no_processes)
    eager_losses, eager_state, _ = run(make, step, 6, False)
    with pytest.warns(RuntimeWarning, match=r"the planning process failed \(OSError: no processes"):
        losses, state, tape = run(make, step, 6, True, key="plan-process-none")
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert tape._program.schedule is not None and tape._program.plan_pid is None
    planner.close()


def test_each_path_is_prepared_once_however_often_it_is_planned(monkeypatch):
    _losses, _state, tape = run(make, step, 6, True, key="plan-process-prepared")
    paths = tuple(tape._program.paths)
    assert len(paths) >= 2
    built = []
    program_module = planner.program
    from_trace = program_module.PlanningGraph.from_trace
    monkeypatch.setattr(program_module, "_PREPARED", type(program_module._PREPARED)())
    monkeypatch.setattr(
        program_module.PlanningGraph, "from_trace", lambda t: built.append(t) or from_trace(t)
    )
    first = make_plan(PlanRequest(1, paths[:1], None, None, True))
    again = make_plan(PlanRequest(2, paths, None, None, True))
    assert [id(t) for t in built] == [id(p.trace) for p in paths]  # each path's graph built once
    monkeypatch.setattr(program_module, "_PREPARED", type(program_module._PREPARED)())
    anew = make_plan(PlanRequest(3, paths, None, None, True))  # every path built again
    assert first.schedule is not None and again.schedule.offsets == anew.schedule.offsets
    assert orders(again.schedule) == orders(anew.schedule)


def test_the_planning_process_starts_while_the_first_step_runs(monkeypatch):
    # it imports torch for a second or two: started with the first plan, the step after the
    # first ran beside that import and its plan came later
    import time

    coexec.wait_for_plans(60)
    planner = Planner()
    monkeypatch.setattr(planning, "PLANNER", planner)
    monkeypatch.setattr(coexec.tape, "PLANNER", planner)
    model = torch.nn.Linear(4, 2)
    with coexec.GradientTape(backend="interpret", key="plan-process-early"):
        deadline = time.monotonic() + 30
        while planner._process is None or planner._process.pid is None:
            assert time.monotonic() < deadline, "the planning process did not start"
            time.sleep(0.01)
        assert not planner._unfinished  # no plan asked for yet
        model(torch.randn(3, 4)).sum().backward()
    # without an arena or a budget there is nothing to plan: no process
    idle = Planner()
    monkeypatch.setattr(coexec.tape, "PLANNER", idle)
    with coexec.GradientTape(backend="interpret", key="plan-process-none-needed", arena=False):
        model(torch.randn(3, 4)).sum().backward()
    time.sleep(0.1)
    assert idle._process is None and idle._thread is None
    planner.close()


def test_a_module_of_the_users_named_like_one_the_child_imports_does_not_stop_it(tmp_path, monkeypatch):
    """The training script's directory is on ``sys.path``; the child does not import from it
    (an ``nt.py`` there stopped the child's ``import torch``)."""
    (tmp_path / "nt.py").write_text("raise RuntimeError('a module of the user named nt')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    proc = PlanProcess()
    try:
        result = proc.plan(PlanRequest(1, tuple(map(as_path, traced(1))), None, None, False))
        assert result.error is None and result.pid not in (None, os.getpid())
    finally:
        proc.close()


def test_the_child_starts_without_warnings_and_ends_when_the_pipe_closes() -> None:
    """``python -m coexec.plan_process`` made runpy warn on every start (the package imports the
    module before runpy runs it): users saw a RuntimeWarning whenever a plan was made."""
    import subprocess

    from coexec.plan_process import _child_path, child_command

    env = {**os.environ, "PYTHONPATH": _child_path()}
    done = subprocess.run(child_command(), input=b"", capture_output=True, env=env, timeout=120, check=False)
    assert done.returncode == 0 and done.stderr == b"", done.stderr.decode()
