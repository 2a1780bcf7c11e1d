"""A trace as plain columns, for pickling (plans are made in another process).

Pickling a :class:`~tracegraph.trace.Trace` object by object costs a Python call or a
``__reduce__`` per op, op key, value and tensor metadata (each ``torch.device`` and
``torch.Size`` is its own object): 0.35 s for a 9,500-op trace, on the training process's
planner thread, holding the GIL while steps run. Most of those objects repeat: an op in a loop
has an equal key and equal metadata in every iteration. :func:`to_columns` stores each distinct
key and metadata once and everything else as tuples of ints, which pickle without calling
Python; :func:`from_columns` builds an equal trace back.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, NamedTuple, Sequence

import torch

from .schema import TensorMeta
from .trace import Fetch, OpKey, OpRecord, Trace, Value

_tuple_new = tuple.__new__


class TraceColumns(NamedTuple):
    """A trace's fields as columns, its metadata and op keys as indices into tables."""

    metas: tuple[tuple, ...]  # distinct TensorMetas: (shape as a tuple, dtype, ...)
    keys: tuple[tuple, ...]  # distinct OpKeys: (op name, overload, attrs, meta indices, loc)
    values: tuple[tuple, ...]  # one column per field of _VALUE_FIELDS, metadata as indices
    ops: tuple[tuple, ...]  # one column per field of _OP_FIELDS, the key as indices
    fetches: tuple[tuple, ...]
    externals: tuple[int, ...]
    storage_bytes: dict[int, int]
    alive_at_end: frozenset
    released: dict[int, int]
    in_try: frozenset
    computed: bool
    outside_loops: frozenset
    status: str
    error: BaseException | None


_VALUE_FIELDS = ("vid", "producer", "out_index", "meta", "storage")
_OP_FIELDS = (
    "index", "key", "inputs", "outputs", "writes", "python_result", "backward_of", "out_alias",
    "n_returned", "out_struct", "seconds",
)  # fmt: skip


def _indices(objs: Sequence, table: dict) -> tuple[int, ...]:
    """Each of ``objs`` as its index in ``table`` (object -> index; equal objects share one,
    new ones are added). Looked up by identity first, in C (equal metadata is mostly one
    object: TensorMeta.of interns it), then each distinct object by value."""
    firsts = dict(zip(map(id, objs), objs))
    by_id = {i: table.setdefault(o, len(table)) for i, o in firsts.items()}
    return tuple(map(by_id.__getitem__, map(id, objs)))


def to_columns(trace: Trace) -> TraceColumns:
    """``trace`` as columns (in C where it can: one Python call per distinct object)."""
    metas: dict[TensorMeta, int] = {}
    keys: dict[OpKey, int] = {}
    values = [tuple(map(attrgetter(f), trace.values)) for f in _VALUE_FIELDS]
    values[3] = _indices(values[3], metas)
    ops = [tuple(map(attrgetter(f), trace.ops)) for f in _OP_FIELDS]
    ops[1] = _indices(ops[1], keys)
    key_rows = tuple(
        (k.func._schema.name, k.func._overloadname, k.attrs, _indices(k.metas, metas), k.loc) for k in keys
    )  # fmt: skip
    meta_rows = tuple(
        (tuple(m.shape), m.dtype, m.device, m.layout, m.stride, m.requires_grad, m.bits) for m in metas
    )  # fmt: skip
    return TraceColumns(
        metas=meta_rows,
        keys=key_rows,
        values=tuple(values),
        ops=tuple(ops),
        fetches=tuple((f.kind, f.vid, f.after, f.loc) for f in trace.fetches),
        externals=tuple(trace.externals),
        storage_bytes=trace.storage_bytes,
        alive_at_end=trace.alive_at_end,
        released=trace.released,
        in_try=frozenset(trace.in_try),
        computed=trace.computed,
        outside_loops=trace.outside_loops,
        status=trace.status,
        error=trace.error,
    )


def _op(name: str, overload: str) -> Any:
    ns, op = name.split("::")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def from_columns(c: TraceColumns) -> Trace:
    metas = [_tuple_new(TensorMeta, (torch.Size(m[0]), *m[1:])) for m in c.metas]
    keys = [
        OpKey(_op(name, overload), attrs, tuple(metas[i] for i in ms), loc)
        for name, overload, attrs, ms, loc in c.keys
    ]  # fmt: skip
    vids, producers, out_indices, meta_indices, storages = c.values
    values = list(map(Value, vids, producers, out_indices, map(metas.__getitem__, meta_indices), storages))
    index, key_indices, *rest = c.ops
    ops = list(map(OpRecord, index, map(keys.__getitem__, key_indices), *rest))
    return Trace(
        ops=ops,
        values=values,
        fetches=[Fetch(*f) for f in c.fetches],
        externals=list(c.externals),
        storage_bytes=c.storage_bytes,
        alive_at_end=c.alive_at_end,
        released=c.released,
        in_try=set(c.in_try),
        computed=c.computed,
        outside_loops=c.outside_loops,
        status=c.status,
        error=c.error,
    )
