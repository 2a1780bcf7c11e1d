"""The arena a program's co-executed steps allocate from (DESIGN.md §5, ``interpret`` backend).

A storage is known across steps by its *key*: the TraceGraph node that makes it, the output
index, and the loop iterations it was made in. After each new trace, the program re-plans one
arena for all its observed paths (:func:`planner.arena.plan_arena`, validated per path by the
simulator), and the skeleton asks the executor to write each planned output in place, through
the op's ``out=`` variant, into a view of the arena at the planned offset.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from planner import PlanningGraph
from planner.arena import ArenaPlan, plan_arena
from tracegraph import Cursor, Fetch, Trace, TraceGraph
from tracegraph.structure import in_order


def iterations(ctx: tuple) -> tuple:
    """The loop iterations part of a cursor context (instance numbers dropped)."""
    return tuple((loop, it) for loop, _inst, it in ctx)


def path_keys(graph: TraceGraph, trace: Trace, g: PlanningGraph) -> tuple[dict[int, Hashable], list[Hashable]]:
    """Keys of a path's storages (storage id -> key of every storage the trace allocates) and
    of its ops (op index -> (node id, loop iterations)), by walking it over the graph."""
    cursor = Cursor(graph, trace, mutate=False)
    keys: dict[int, Hashable] = {}
    op_keys: list[Hashable] = [None] * len(trace.ops)
    values = trace.values
    for x in in_order(trace):
        if isinstance(x, Fetch):
            cursor.fetch(x)
            continue
        node = cursor.op(x)
        its = iterations(cursor.placed[x.index][1])
        op_keys[x.index] = (node.id, its)
        for sid in g.ops[x.index].allocates:
            k = next(i for i, v in enumerate(x.outputs) if values[v].storage == sid)
            keys[sid] = (node.id, k, its)
    cursor.finish()
    return keys, op_keys


def storage_keys(graph: TraceGraph, trace: Trace, g: PlanningGraph) -> dict[int, Hashable]:
    """Key of every storage the trace allocates."""
    return path_keys(graph, trace, g)[0]


def plan_program_arena(graph: TraceGraph, traces: list[Trace]) -> ArenaPlan | None:
    paths = []
    for t in traces:
        g = PlanningGraph.from_trace(t)
        paths.append((g, storage_keys(graph, t, g)))
    if not paths:
        return None
    return plan_arena(paths)


_OUT_VARIANTS: dict[Any, Any] = {}


def out_variant(func: Any) -> tuple[Any, tuple[str, ...]] | None:
    """The ``out=`` overload of an ATen op with the same other arguments, and its out
    argument names; None if it has none."""
    found = _OUT_VARIANTS.get(func, False)
    if found is not False:
        return found
    found = None
    sch = func._schema
    want = [(a.name, str(a.type)) for a in sch.arguments]
    returns_tensors = all(isinstance(r.type, torch.TensorType) for r in sch.returns) and sch.returns
    if returns_tensors and not any(a.alias_info is not None and a.alias_info.is_write for a in sch.arguments):
        packet = func.overloadpacket
        for name in packet.overloads():
            cand = getattr(packet, name)
            cs = cand._schema
            outs = [a for a in cs.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
            rest = [(a.name, str(a.type)) for a in cs.arguments if a not in outs]
            if outs and rest == want and len(outs) == len(sch.returns):
                found = (cand, tuple(a.name for a in outs))
                break
    _OUT_VARIANTS[func] = found
    return found


def is_arena_backed(t: torch.Tensor, arena: torch.Tensor | None) -> bool:
    """Does ``t``'s memory lie in the arena? (Arena outputs have storages of their own over
    the arena's bytes, so the test is by address.)"""
    if arena is None or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return False
    try:
        p = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    base = arena.data_ptr()
    return base <= p < base + arena.numel()
