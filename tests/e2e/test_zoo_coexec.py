"""The model zoo's training steps under coexec with the arena: bit-equal to eager."""

from __future__ import annotations

import pytest

from coexec import runtime
from examples.models import ZOO
from tests.coexec.helpers import assert_same_as_eager

STEPS = 5  # 2 new traces (the first SGD step creates momentum), 1 covered, 2 co-executed


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_co_executes_from_the_arena_bit_equal_to_eager(name):
    ex = runtime.executor()
    hits0, misses0 = ex.arena_hits, ex.arena_misses
    tape = assert_same_as_eager(lambda: ZOO[name](1), lambda z, i: z.step(), STEPS, key=("zoo", name))
    assert tape.stats.coexec_steps == STEPS - 3 and tape.stats.fallbacks == 0
    plan = tape._program.arena_plan
    assert plan is not None and len(plan.paths) == tape.stats.traces
    assert ex.arena_hits > hits0
    # planned with the lifetimes the executor gives values (until Python lets go of them, plus
    # the skeleton's sweep lag), every planned output finds its bytes free: none goes to the
    # allocator on top of the arena
    assert ex.arena_misses == misses0
