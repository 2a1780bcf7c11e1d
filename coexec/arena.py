"""The runtime's side of the arena (DESIGN.md §5): which ops can write into it, and how.

The plan (``planner.plan_program``) gives each placed storage one offset, known across steps
by its ``planner.StorageKey`` (the TraceGraph node that makes it, the output, the loop
iterations); the skeleton asks the executor to write each planned output in place, through
the op's ``out=`` variant, into a view of the arena at that offset. What this module tells the
planner, per observed path, is which ops can do that (:func:`writable_ops`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from executor import laid_out, span_bytes, writes_in_place
from planner import Site
from tracegraph import Trace


def iterations(ctx: tuple) -> tuple:
    """The loop iterations part of a cursor context (instance numbers dropped)."""
    return tuple((loop, it) for loop, _inst, it in ctx)


def sites(places: Iterable[tuple[int, tuple]]) -> tuple[Site, ...]:
    """The :class:`planner.Site` of each op of a path (node id, loop iterations), from where a
    walk over the graph placed it (the merge that added the path, or the skeleton's cursor):
    computed once per path, when it is observed."""
    return tuple(Site(node_id, iterations(ctx)) for node_id, ctx in places)


# the skeleton sweeps for dead placeholders every SWEEP_EVERY submissions, so a value may
# outlive its last tensor by that many ops when ops run as they are issued: plans count it
# (planner.Settings.sweep_lag); blocks are swept when they close
SWEEP_EVERY = 4


def sweep_every(budget: int | None) -> int:
    """How many submissions apart a step's skeleton sweeps, and so the lag its plans count:
    every one under a memory budget (its ops run as issued, and every dead value a plan counts
    on for longer raises the budgets it can meet: docs/coexec.md, The executor), else every
    SWEEP_EVERY."""
    return SWEEP_EVERY if budget is None else 1


_PROBED: dict = {}  # (func, attrs, input metas, output metas) -> probe_out_variant's answer


def writable_ops(trace: Trace) -> frozenset:
    """The ops of a path whose ``out=`` variant writes their outputs as the arena plans them:
    every output fresh, and the variant, tried once per op key on stand-in values
    (:func:`probe_out_variant`), lays them out as planned without resizing. On the step's
    thread, when the path is observed: a probe forks the RNG and catches warnings, which are
    process-wide, so planning (in the background, while steps run) only reads the answer."""
    values = trace.values
    found = set()
    for rec in trace.ops:
        if not rec.outputs or any(a is not None for a in rec.out_alias[: rec.n_returned]):
            continue
        ov = out_variant(rec.func)
        if ov is None or writes_in_place(ov[0]) is False:
            continue
        key = _probe_key(rec, values)
        if key not in _PROBED:
            _PROBED[key] = probe_out_variant(rec.func, rec.key.attrs, rec.key.metas, key[3])
        if _PROBED[key]:
            found.add(rec.index)
    return frozenset(found)


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
