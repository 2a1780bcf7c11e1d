"""One arena across exclusive branches (DESIGN.md §3, "Addresses across the TraceGraph"): storages
that no observed path holds at once share arena bytes, and every path runs within its plan."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from examples.programs import LossBranch
from planner import StorageKey, plan_program
from tests.coexec.helpers import assert_same_as_eager

WIDE = 4096  # the branch temporary's width: 32 x 4096 floats, 512 KiB


def make():
    torch.manual_seed(0)
    return SimpleNamespace(
        inp=nn.Linear(16, 64),
        wide=nn.Linear(64, WIDE),
        out=nn.Linear(WIDE, 1),
        data=[(torch.randn(32, 16), torch.randn(32, 1)) for _ in range(3)],
    )


def three_way(s, i):
    """A 3-way switch on the step number: each branch makes its own wide temporary."""
    x, y = s.data[i % 3]
    h = s.inp(x)
    if i % 3 == 0:
        t = torch.sin(s.wide(h))
    elif i % 3 == 1:
        t = torch.cos(s.wide(h)) * 0.5
    else:
        t = torch.tanh(s.wide(h)) + 1.0
    loss = F.mse_loss(s.out(t), y)
    loss.backward()
    for p in (*s.inp.parameters(), *s.wide.parameters(), *s.out.parameters()):
        p.data.add_(p.grad, alpha=-1e-4)  # plain SGD: no optimizer state, so one path per branch
        p.grad = None
    return loss.detach()


def branch_temporaries(program, nbytes: int) -> list[set]:
    """Per observed path, the keys of the storages of exactly ``nbytes`` that only it makes."""
    per_path = []
    for path in program.paths:
        values = path.trace.values
        keys = set()
        for op in path.trace.ops:
            for k, vid in enumerate(op.outputs):
                meta = values[vid].meta
                if meta.shape.numel() * meta.dtype.itemsize == nbytes and values[vid].producer == op.index:
                    site = path.sites[op.index]
                    keys.add(StorageKey(site.node, k, site.iterations))
        per_path.append(keys)
    return [keys - set().union(*(o for o in per_path if o is not keys)) for keys in per_path]


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_a_three_way_switch_places_its_branches_temporaries_over_the_same_bytes():
    big = 32 * WIDE * 4
    tape = assert_same_as_eager(make, three_way, 15, key="branch-arena-3")
    program, s = tape._program, tape.stats
    assert s.traces == 3 and s.coexec_steps >= 9 and s.fallbacks == 0
    schedule = program.schedule
    own = branch_temporaries(program, big)
    assert all(own), own  # each branch makes wide storages no other path makes
    spans = [[(schedule.offsets[k], schedule.offsets[k] + big) for k in keys if k in schedule.offsets] for keys in own]
    assert all(spans), "the branch temporaries are in the arena"
    for i in range(3):  # each branch's temporaries lie over another branch's bytes
        others = [b for j in range(3) if j != i for b in spans[j]]
        assert any(overlap(a, b) for a in spans[i] for b in others)
    # the arena holds the three branches in the room of fewer than two of them at once
    assert schedule.arena_bytes < 2 * big * max(map(len, own))
    assert s.peak_bytes <= s.planned_peak_bytes  # the latest step, on its planned path


def test_the_two_paths_of_loss_branch_share_one_arena_and_each_runs_within_its_plan():
    tape = assert_same_as_eager(lambda: LossBranch(0), lambda p, i: p.step(i), 16, key="branch-arena-2")
    program = tape._program
    schedule = program.schedule
    assert len(schedule.paths) == len(program.paths) == 2
    # one arena for both paths, smaller than the two paths' arenas side by side
    alone = [plan_program([path]).arena_bytes for path in program.paths]
    assert max(alone) <= schedule.arena_bytes < sum(alone)
    # a co-executed step on each path measures within its path's plan
    peaks = {}
    state = LossBranch(0)
    from coexec import GradientTape, wait_for_plans

    again = GradientTape(backend="interpret", key="branch-arena-2-again")
    for i in range(16):
        with again:
            state.step(i)
        wait_for_plans()
        s = again.stats
        if s.last_phase == "coexec" and s.planned_path is not None:
            peaks.setdefault(s.planned_path, []).append((s.peak_bytes, s.planned_peak_bytes))
    assert sorted(peaks) == [0, 1], peaks  # co-executed steps on both paths
    assert all(measured <= planned for steps in peaks.values() for measured, planned in steps)
