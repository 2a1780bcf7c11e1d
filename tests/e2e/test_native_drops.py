"""Every example program with every value it makes dropped right after the op that made it
(the worker keeps no recipe for random ops or ops that write an argument, such as batch norm's
running statistics), so that every read of one makes it again: bit-equal to eager
(losses, parameters, buffers, optimizer state). The harshest memory plan there is, on the
programs' branches, loops, in-place updates, optimizers and gradient blocks."""

from __future__ import annotations

import pytest
import torch

from examples.programs import PROGRAMS
from executor import native
from executor.capture import Capture
from executor.step_plans import DropPlan, StepDescription
from tests.coexec.helpers import tensors_of

pytestmark = pytest.mark.skipif(not native.enabled(), reason="capture runs on the native module")


def drop_everything(d: StepDescription) -> DropPlan:
    after = {o.place: tuple(v for v, _ in o.values) for o in d.ops if o.values and not o.random}
    keep = frozenset(v for vs in after.values() for v in vs)
    return DropPlan(tuple(0 if o.at_once else o.op_id for o in d.ops), keep, after)


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_program_with_every_value_dropped_is_bit_equal(program) -> None:
    eager, captured = program(0), program(0)
    capture = Capture()
    remade = capture.counters.remade
    for i in range(10):
        if i == 3:
            capture.describe_next()
        rng = torch.get_rng_state()
        want = eager.step(i)
        torch.set_rng_state(rng)  # (the same draws for both: random ops are never dropped)
        with capture.step():
            got = captured.step(i)
        if i == 3:
            capture.follow(drop_everything(capture.description()))
        assert torch.equal(torch.as_tensor(want), torch.as_tensor(got)), f"step {i}: loss"
        for k, (a, b) in enumerate(zip(tensors_of(eager), tensors_of(captured))):
            assert torch.equal(a, b), f"step {i}: state tensor {k}"
    assert capture.counters.remade > remade
