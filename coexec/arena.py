"""The arena a program's co-executed steps allocate from (DESIGN.md §5, ``interpret`` backend).

A storage is known across steps by its *key*: the TraceGraph node that makes it, the output
index, and the loop iterations it was made in. After each new trace, the program re-plans one
arena for all its observed paths (:func:`planner.arena.plan_arena`, validated per path by the
simulator), and the skeleton asks the executor to write each planned output in place, through
the op's ``out=`` variant, into a view of the arena at the planned offset.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from executor import laid_out, span_bytes, writes_in_place
from planner import LOCAL, PlanningGraph
from planner.arena import ArenaPlan, plan_arena, select_placed
from planner.remat import remat_replay
from tracegraph import Trace


def iterations(ctx: tuple) -> tuple:
    """The loop iterations part of a cursor context (instance numbers dropped)."""
    return tuple((loop, it) for loop, _inst, it in ctx)


def op_keys(places: Iterable[tuple[int, tuple]]) -> tuple[Hashable, ...]:
    """Keys of a path's ops that hold across steps, (node id, loop iterations) per op index,
    from where a walk over the graph placed them (the merge that added the path, or the
    skeleton's cursor): computed once per path, when it is observed."""
    return tuple((node_id, iterations(ctx)) for node_id, ctx in places)


def storage_keys(trace: Trace, g: PlanningGraph, keys: tuple) -> dict[int, Hashable]:
    """Keys of the storages a path allocates (storage id -> (node id, output, iterations)),
    from its ``keys`` (:func:`op_keys`)."""
    values = trace.values
    out: dict[int, Hashable] = {}
    for op in trace.ops:
        node_id, its = keys[op.index]
        for sid in g.ops[op.index].allocates:
            k = next(i for i, v in enumerate(op.outputs) if values[v].storage == sid)
            out[sid] = (node_id, k, its)
    return out


# the skeleton sweeps for dead placeholders every SWEEP_EVERY submissions, so a value may
# outlive its last tensor by that many ops: plans count it (arena and budget alike)
SWEEP_EVERY = 4


def lagged(g: PlanningGraph) -> PlanningGraph:
    """``g`` with every storage released :data:`SWEEP_EVERY` ops later: the skeleton learns
    that a tensor is gone only when it next sweeps (coexec/skeleton.py, ``Session.sweep``), so
    its value lives on until then, and a plan that reuses its bytes earlier finds them taken."""
    n = len(g)
    for s in g.storages.values():
        if s.release is not None:
            s.release = min(n - 1, s.release + SWEEP_EVERY)
    return g


def plan_program_arena(traces: Sequence[Trace], keys: Sequence[tuple]) -> ArenaPlan | None:
    """The arena over every observed path for the storages ops will write in place. Each is
    resident from its producer until the executor frees it, as a budget plan that drops nothing
    has it (``remat_replay``'s segments): when the program let go of its last tensor (in the
    trace) plus the sweep lag (:func:`lagged`), or its last use if later; not at its last use
    alone, or the next op planned over its bytes would find them taken and use the allocator,
    on top of the arena."""
    paths, resident = [], []
    for t, path_keys in zip(traces, keys):
        g, placeable, segments = _prepared(t, path_keys)
        paths.append((g, placeable))
        resident.append(segments)
    if not paths:
        return None
    # the arena is held whole: only what lowers the step's total goes in, an op's outputs
    # together (storage keys are (node, output, iterations))
    chosen = select_placed([(g, keys, r) for (g, keys), r in zip(paths, resident)], unit=lambda k: (k[0], k[2]))
    paths = [(g, {sid: k for sid, k in keys.items() if k in chosen}) for g, keys in paths]
    return plan_arena(paths, stretches=resident)


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trace -> _prepared's


def _prepared(trace: Trace, path_keys: tuple) -> tuple[PlanningGraph, dict, dict]:
    """A path's planning graph, its placeable storages' keys and their residency, made once
    per path: a program plans again over every path after each new one (read only after)."""
    got = _PREPARED.get(trace)
    if got is None or got[0] != path_keys:
        g = lagged(PlanningGraph.from_trace(trace))
        ok = placeable_storages(g, trace)
        placeable = {sid: k for sid, k in storage_keys(trace, g, path_keys).items() if sid in ok}
        got = (path_keys, g, placeable, remat_replay(g, list(range(len(g))), []).segments)
        _PREPARED[trace] = got
    return got[1:]


_PROBED: dict = {}  # (func, attrs, input metas, output metas) -> probe_out_variant's answer


def placeable_storages(g: PlanningGraph, trace: Trace) -> set[int]:
    """Local storages the skeleton will ask the executor to write in place into the arena:
    made by an op with an ``out=`` variant whose every output is a fresh storage
    (coexec/skeleton.py, ``_arena_out``), and which writes them as planned: not known to lay
    them out otherwise, and tried once per op key on stand-in values
    (:func:`probe_out_variant`, run by :func:`probe_path` when the path was observed)."""
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
        if _PROBED.get(_probe_key(rec, values), False):  # (not yet probed: not placed)
            out.update(made)
    return out


def probe_path(trace: Trace) -> None:
    """Try the ``out=`` variants of a path's ops that :func:`placeable_storages` will ask
    about, once per op key. On the step's thread, when the path is observed: a probe forks the
    RNG and catches warnings, which are process-wide, so planning (in the background, while
    steps run) only reads the answers."""
    values = trace.values
    for rec in trace.ops:
        if not rec.outputs or any(a is not None for a in rec.out_alias[: rec.n_returned]):
            continue
        ov = out_variant(rec.func)
        if ov is None or writes_in_place(ov[0]) is False:
            continue
        key = _probe_key(rec, values)
        if key not in _PROBED:
            _PROBED[key] = probe_out_variant(rec.func, rec.key.attrs, rec.key.metas, key[3])


def _probe_key(rec: Any, values: list) -> tuple:
    return (rec.func, rec.key.attrs, rec.key.metas, tuple(values[v].meta for v in rec.outputs))


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


_BINDINGS = (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg, torch._C._special, torch._C._fft)


def _python_binding(func: Any) -> Any | None:
    """``torch``'s Python binding of an ATen op: unlike the ``torch.ops`` overload, a call
    through it turns the kernel's C++ warnings into Python ones that a probe can see."""
    name = func._schema.name.split("::")[-1]
    return next((getattr(m, name) for m in _BINDINGS if hasattr(m, name)), None)


def probe_out_variant(func: Any, attrs: tuple, metas: tuple, outs: tuple) -> bool:
    """Does ``func``'s ``out=`` variant write outputs laid out as ``outs`` (their metas) into
    regions of exactly their bytes, as the executor hands them (a fixed-size storage each),
    without resizing them on the way? Tried once on stand-in values (ones; zeros for integers,
    valid indices) of the recorded shapes on the CPU, the RNG state kept, so that a plan knows
    which storages will really live in the arena before any step runs. Some kernels reshape
    their output on the way (``mse_loss.out`` computes elementwise into it before reducing):
    they fail on a larger input and warn on every call otherwise, so a warning is a no."""
    from tracegraph.schema import DEFAULT, TENSOR_ARG

    ov = out_variant(func)
    if ov is None or any(m.device.type != "cpu" for m in (*metas, *outs)):
        return False
    out_func, names = ov
    sch = func._schema
    tensors = iter(metas)

    def stand_in(m: Any) -> torch.Tensor:
        t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype)
        return t.zero_() if not (m.dtype.is_floating_point or m.dtype.is_complex) else t.fill_(1)

    def nbytes(m: Any) -> int:  # as the executor's region for it holds
        return max(span_bytes(m.shape, m.stride, m.dtype), m.dtype.itemsize)

    def region(m: Any) -> torch.Tensor:
        return laid_out(torch.frombuffer(bytearray(nbytes(m)), dtype=torch.uint8), m.shape, m.stride, m.dtype)

    try:
        named, positional, skipped, gap = {}, [], False, False
        for arg, attr in zip(sch.arguments, attrs):
            if attr is DEFAULT:
                skipped = skipped or not arg.kwarg_only
                continue
            if attr is TENSOR_ARG:
                v = stand_in(next(tensors))
            elif type(attr) is tuple and any(x is TENSOR_ARG for x in attr):
                v = [stand_in(next(tensors)) if x is TENSOR_ARG else _unhash(x) for x in attr]
            else:
                v = _unhash(attr)
            named[arg.name] = v
            if not arg.kwarg_only:
                gap = gap or skipped  # a positional after a defaulted one: by name only
                positional.append(v)
        placed = [region(m) for m in outs]
        binding = None if gap else _python_binding(func)
        kwarg_only = {a.name: named[a.name] for a in sch.arguments if a.kwarg_only and a.name in named}
        with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                called = binding is not None
                if called:
                    binding(*positional, **kwarg_only, out=placed[0] if len(placed) == 1 else tuple(placed))
            except TypeError:  # its Python signature differs from the schema
                called = False
            if not called:
                # the overload, whose C++ warnings stay in C++: empty outputs, which kernels
                # grow without a warning, and a check that they never grew past the plan
                placed = [torch.empty(0, dtype=m.dtype) for m in outs]
                out_func(**named, **dict(zip(names, placed)))
                if any(f.untyped_storage().nbytes() > nbytes(m) for f, m in zip(placed, outs)):
                    return False
    except (_Unknown, RuntimeError, TypeError, ValueError, IndexError):
        return False
    return not warned and all(
        tuple(f.shape) == tuple(m.shape) and tuple(f.stride()) == tuple(m.stride) for f, m in zip(placed, outs)
    )
