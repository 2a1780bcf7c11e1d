"""The model zoo's training steps under coexec with the arena: bit-equal to eager."""

from __future__ import annotations

import pytest

from coexec import runtime
from examples.models import ZOO
from tests.coexec.helpers import assert_same_as_eager

STEPS = 5  # 2 new traces (the first SGD step creates momentum), 1 covered, 2 co-executed


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_co_executes_in_its_planned_order_bit_equal_to_eager(name):
    """Each co-executed step runs its one block in the planned order, from the arena, and
    holds what the plan says (the simulator's peak, the whole arena counted): within 2%, and
    below eager PyTorch's peak for the same path."""
    ex = runtime.executor()
    hits0, misses0 = ex.stats().arena_hits, ex.stats().arena_misses
    tape = assert_same_as_eager(lambda: ZOO[name](1), lambda z, i: z.step(), STEPS, key=("zoo", name))
    assert tape.stats.coexec_steps == STEPS - 3 and tape.stats.fallbacks == 0
    plan = tape._program.schedule
    assert plan is not None and len(plan.paths) == tape.stats.traces
    assert tape.stats.planned_blocks == 1
    # every op is deferred to the step's one block, and each runs once, ahead of its launch
    # or at it
    run_ahead = tape.stats.run_ahead
    assert run_ahead.ahead + run_ahead.at_launch == tape.stats.last_ops
    # (no arena where one would hold more than the allocator: the LSTM's)
    assert ex.stats().arena_hits > hits0 or not plan.arena_bytes
    # planned with the lifetimes the executor gives values (after their last use in the
    # planned order, as Python let go of them in the block), every planned output finds its
    # bytes free: none goes to the allocator on top of the arena
    assert ex.stats().arena_misses == misses0
    planned, eager = tape.stats.planned_peak_bytes, plan.paths[-1].eager_peak
    assert tape.stats.peak_bytes <= 1.02 * planned < eager
