"""The native backend's plans for a program's paths (``coexec/native_budget.py``): each path's
plan counts the program's state that the other paths write, as a described step names it."""

from __future__ import annotations

from coexec.native_budget import other_states, planning_graph
from executor.step_plans import DescribedOp, StepDescription


def _path(updated: list[tuple[int, int]], batch: tuple[int, int]) -> StepDescription:
    """A described step that reads a batch (storage 0, ``batch`` = (id, bytes)) and updates in
    place the parameters ``updated`` ((id, bytes) each, storages 1..), one op each."""
    ops = [
        DescribedOp(j, "aten::add_", 1, 0.0, False, False, (0,), (1 + j,), (), ()) for j in range(len(updated))
    ]
    storages = [batch, *updated]
    return StepDescription(
        tuple(ops), tuple(n for _, n in storages), (True,) * len(storages), frozenset(), {}, frozenset(),
        tuple(i for i, _ in storages),
    )  # fmt: skip


def test_a_path_counts_the_state_the_other_paths_write() -> None:
    """Two branches share a trunk (id 10) and each updates a head of its own (ids 20, 30): each
    path's plan counts the other's head. Batches (made before the step, read, never written)
    are not state: each step has another."""
    left = _path([(10, 100), (20, 7)], (1, 1000))
    right = _path([(10, 100), (30, 50)], (2, 1000))
    assert other_states([left, right]) == [50, 7]
    assert other_states([left]) == [0]
    assert other_states([left, left]) == [0, 0]  # (the same path twice: nothing beside it)


def test_the_other_paths_state_is_persistent_in_the_planning_graph() -> None:
    d = _path([(10, 100)], (1, 1000))
    assert planning_graph(d, 50).persistent_bytes == planning_graph(d).persistent_bytes + 50
