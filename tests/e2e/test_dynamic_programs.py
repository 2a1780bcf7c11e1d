"""The programs whose sizes change between steps (examples/dynamic_programs.py, issue 17)
under coexec: bit-equal to eager from the same seed. Where a size repeats (an epoch's shorter
last chunk, a loader's smaller last batch) it is one more path and the program co-executes;
where it does not (a length drawn per step, an episode's length, a number of boxes) today each
new size is a new trace, and after ``max_traces`` the program runs eagerly, still bit-equal
(``python bench/dynamic_sizes.py`` measures both)."""

from __future__ import annotations

import pytest

from examples.dynamic_programs import DYNAMIC_PROGRAMS, Reinforce
from tests.coexec.helpers import assert_same_as_eager

STEPS = 20
REPEATING = {"word_lm_last_chunk", "classifier_last_batch"}


class ShortReinforce(Reinforce):
    """Episodes of 12-20 steps: each step here waits for its plans (tests/coexec/helpers.py),
    and planning the 200-step episodes' traces makes the full program take minutes (the slow
    case below)."""

    name = "reinforce_short"
    max_steps = 20


CASES = [
    *(p for p in DYNAMIC_PROGRAMS if p is not Reinforce),
    ShortReinforce,
    pytest.param(Reinforce, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("program", CASES, ids=[*(p.name for p in CASES[:-1]), "reinforce"])
def test_program_with_changing_sizes_is_bit_equal_to_eager(program):
    tape = assert_same_as_eager(lambda: program(0), lambda p, i: p.step(i), STEPS)
    s = tape.stats
    assert s.steps == STEPS
    if program.name in REPEATING:
        assert s.traces <= 4 and s.phase == "coexec", s
        assert s.coexec_steps >= STEPS - 6, s
