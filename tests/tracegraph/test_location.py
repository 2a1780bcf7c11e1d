"""Locations stay the same from step to step, however the interpreter specialises the code."""

from __future__ import annotations

import torch

from tracegraph import TraceGraph, record

HIDDEN = (torch.zeros(2, 3), torch.zeros(2, 3))


def step() -> None:
    hidden = tuple(h.detach() for h in HIDDEN)  # a generator run by a call to a builtin type
    torch.stack([h + 1 for h in hidden]).sum()


def test_a_call_the_interpreter_specialises_keeps_its_location():
    """On Python 3.11 a specialised ``tuple(generator)`` makes the call in its ``PRECALL``:
    before the fix, the generator's frame stood at another offset after some steps, so its loop
    was a new loop and the step a new trace."""
    g = TraceGraph()
    for i in range(40):
        with record() as t:
            step()
        assert g.merge(t) == (i == 0), f"step {i} made a new trace"
