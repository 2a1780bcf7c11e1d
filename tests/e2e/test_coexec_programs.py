"""The program suite under coexec: 30 steps bit-equal to 30 eager steps from the same seed."""

from __future__ import annotations

import pytest

from examples.programs import PROGRAMS
from tests.coexec.helpers import assert_same_as_eager

STEPS = 30


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_program_is_bit_equal_to_eager_and_co_executes(program):
    tape = assert_same_as_eager(lambda: program(0), lambda p, i: p.step(i), STEPS)
    s = tape.stats
    assert s.steps == STEPS
    assert s.coexec_steps > STEPS // 2, s  # most steps co-execute
    assert s.traces <= 4, s  # every program's control flow repeats
    tracing_steps = STEPS - s.coexec_steps - s.fallbacks
    assert tracing_steps <= s.traces + 1, s  # tracing stopped at the first covered trace
