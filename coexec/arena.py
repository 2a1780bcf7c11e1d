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

from executor import span_bytes, writes_in_place
from planner import LOCAL, PlanningGraph
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


def plan_program_arena(graph: TraceGraph, traces: list[Trace]) -> ArenaPlan | None:
    """The arena over every observed path for the storages ops will write in place."""
    paths = []
    for t in traces:
        g = PlanningGraph.from_trace(t)
        ok = placeable_storages(g, t)
        paths.append((g, {sid: k for sid, k in path_keys(graph, t, g)[0].items() if sid in ok}))
    if not paths:
        return None
    return plan_arena(paths)


_PROBED: dict = {}  # (func, attrs, input metas, output metas) -> probe_out_variant's answer


def placeable_storages(g: PlanningGraph, trace: Trace) -> set[int]:
    """Local storages the skeleton will ask the executor to write in place into the arena:
    made by an op with an ``out=`` variant whose every output is a fresh storage
    (coexec/skeleton.py, ``_arena_out``), and which writes them as planned: not known to lay
    them out otherwise, and tried once per op key on stand-in values
    (:func:`coexec.arena.probe_out_variant`)."""
    values = trace.values
    out = set()
    for rec, op in zip(trace.ops, g.ops):
        made = [values[v].storage for v in rec.outputs]
        if not made or len(set(made)) != len(made) or not set(made) <= set(op.allocates):
            continue
        if not all(g.storages[sid].kind == LOCAL for sid in made):
            continue
        ov = out_variant(rec.func)
        if ov is None or writes_in_place(ov[0]) is False:
            continue
        metas = tuple(values[v].meta for v in rec.outputs)
        key = (rec.func, rec.key.attrs, rec.key.metas, metas)
        ok = _PROBED.get(key)
        if ok is None:
            ok = _PROBED[key] = probe_out_variant(rec.func, rec.key.attrs, rec.key.metas, metas)
        if ok:
            out.update(made)
    return out


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


class _Unknown(Exception):
    """An argument that cannot be rebuilt from its hashable stand-in."""


def _unhash(v: Any) -> Any:
    """The argument :func:`tracegraph.schema.hashable` stood in for (numbers, lists)."""
    if type(v) is tuple:
        if len(v) == 2 and v[0] in (int, float, bool):
            return v[1]
        if len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], str):
            raise _Unknown(v)  # a generator or an object known only by its repr
        return [_unhash(x) for x in v]
    return v


def probe_out_variant(func: Any, attrs: tuple, metas: tuple, outs: tuple) -> bool:
    """Does ``func``'s ``out=`` variant write outputs laid out as ``outs`` (their metas)
    without ever needing more bytes than they hold (arena regions cannot grow)? Tried once on
    stand-in values (ones; zeros for integers, valid indices) of the recorded shapes on the
    CPU, the RNG state kept, so that a plan knows which storages will really live in the arena
    before any step runs: some kernels grow their output on the way (``mse_loss.out`` computes
    elementwise into it before reducing)."""
    from tracegraph.schema import DEFAULT, TENSOR_ARG, schema_of

    ov = out_variant(func)
    if ov is None or any(m.device.type != "cpu" for m in (*metas, *outs)):
        return False
    out_func, names = ov
    sch = schema_of(func)
    tensors = iter(metas)

    def stand_in(m: Any) -> torch.Tensor:
        t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype)
        return t.zero_() if not (m.dtype.is_floating_point or m.dtype.is_complex) else t.fill_(1)

    try:
        kwargs = {}
        for name, attr in zip(sch.arg_names, attrs):
            if attr is DEFAULT:
                continue
            if attr is TENSOR_ARG:
                v = stand_in(next(tensors))
            elif type(attr) is tuple and any(x is TENSOR_ARG for x in attr):
                v = [stand_in(next(tensors)) if x is TENSOR_ARG else _unhash(x) for x in attr]
            else:
                v = _unhash(attr)
            kwargs[name] = v
        grown = [torch.empty(0, dtype=m.dtype) for m in outs]  # empty: kernels grow them quietly
        kwargs.update(zip(names, grown))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            out_func(**kwargs)
    except (_Unknown, RuntimeError, TypeError, ValueError, IndexError):
        return False
    # as planned, and never larger on the way: an arena region cannot grow
    return all(
        tuple(f.shape) == tuple(m.shape) and tuple(f.stride()) == tuple(m.stride)
        and f.untyped_storage().nbytes() <= max(m.dtype.itemsize, span_bytes(m.shape, m.stride, m.dtype))
        for f, m in zip(grown, outs)
    )  # fmt: skip
