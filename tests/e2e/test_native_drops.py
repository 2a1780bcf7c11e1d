"""Every example program with every value it makes dropped right after the op that made it
(the worker keeps no recipe for random ops or ops that write an argument, such as batch norm's
running statistics), so that every read of one makes it again: bit-equal to eager
(losses, parameters, buffers, optimizer state). The harshest memory plan there is, on the
programs' branches, loops, in-place updates, optimizers and gradient blocks. And the same
programs with every storage parked in the host pool right after the op that made it, brought
back only where it is read (offloading's harshest plan)."""

from __future__ import annotations

import pytest
import torch

from examples.programs import PROGRAMS
from executor import native
from executor.capture import Capture
from executor.step_plans import DropPlan, Park, StepDescription
from tests.coexec.helpers import tensors_of

pytestmark = pytest.mark.skipif(not native.enabled(), reason="capture runs on the native module")


def drop_everything(d: StepDescription) -> DropPlan:
    after = {o.place: tuple(v for v, _ in o.values) for o in d.ops if o.values and not o.random}
    keep = frozenset(v for vs in after.values() for v in vs)
    return DropPlan(tuple(0 if o.at_once else o.op_id for o in d.ops), keep, after)


def park_everything(d: StepDescription) -> DropPlan:
    """Each storage the step made parked after the op that made it, never brought back by the
    plan (due after the step's last op): every read brings one back early."""
    values: dict[int, list[int]] = {}
    made_at: dict[int, int] = {}
    for o in d.ops:
        for v, sid in o.values:
            values.setdefault(sid, []).append(v)
            made_at.setdefault(sid, o.place)
    parks, offset = [], 0
    for sid, vs in values.items():
        parks.append(Park(tuple(vs), made_at[sid], len(d.ops), offset, d.storage_bytes[sid]))
        offset += d.storage_bytes[sid]
    return DropPlan(tuple(0 if o.at_once else o.op_id for o in d.ops), frozenset(), {}, parks=tuple(parks))


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
@pytest.mark.parametrize(("plan", "counter"), [(drop_everything, "remade"), (park_everything, "back_early")], ids=["drop", "park"])
def test_program_with_every_value_dropped_or_parked_is_bit_equal(program, plan, counter) -> None:
    eager, captured = program(0), program(0)
    capture = Capture()
    before = getattr(capture.counters, counter)
    for i in range(10):
        if i == 3:
            capture.describe_next()
        rng = torch.get_rng_state()
        want = eager.step(i)
        torch.set_rng_state(rng)  # (the same draws for both: random ops are never dropped)
        with capture.step():
            got = captured.step(i)
        if i == 3:
            capture.follow(plan(capture.description()))
        assert torch.equal(torch.as_tensor(want), torch.as_tensor(got)), f"step {i}: loss"
        for k, (a, b) in enumerate(zip(tensors_of(eager), tensors_of(captured))):
            assert torch.equal(a, b), f"step {i}: state tensor {k}"
    assert getattr(capture.counters, counter) > before
