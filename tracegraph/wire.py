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

from typing import Any, NamedTuple

import torch

from .schema import TensorMeta
from .trace import Fetch, OpKey, OpRecord, Trace, Value

_tuple_new = tuple.__new__


class TraceColumns(NamedTuple):
    """A trace's fields with its metadata and op keys as indices into tables."""

    metas: tuple[tuple, ...]  # distinct TensorMetas: (shape as a tuple, dtype, ...)
    keys: tuple[tuple, ...]  # distinct OpKeys: (op name, overload, attrs, meta indices, loc)
    values: tuple[tuple, ...]  # per value: (vid, producer, out_index, meta index, storage)
    ops: tuple[tuple, ...]  # per op: its OpRecord fields, the key as an index
    fetches: tuple[tuple, ...]
    externals: tuple[int, ...]
    storage_bytes: dict[int, int]
    alive_at_end: frozenset
    released: dict[int, int]
    computed: bool
    outside_loops: frozenset
    status: str
    error: BaseException | None


def to_columns(trace: Trace) -> TraceColumns:
    metas: dict[TensorMeta, int] = {}
    keys: dict[OpKey, int] = {}
    key_rows: list[tuple] = []

    def meta_index(m: TensorMeta) -> int:
        i = metas.get(m)
        if i is None:
            i = metas[m] = len(metas)
        return i

    def key_index(k: OpKey) -> int:
        i = keys.get(k)
        if i is None:
            i = keys[k] = len(keys)
            func = k.func
            row = (func._schema.name, func._overloadname, k.attrs, tuple(map(meta_index, k.metas)), k.loc)
            key_rows.append(row)
        return i

    values = tuple(
        (v.vid, v.producer, v.out_index, meta_index(v.meta), v.storage) for v in trace.values
    )  # fmt: skip
    ops = tuple(
        (
            op.index, key_index(op.key), op.inputs, op.outputs, op.writes, op.python_result,
            op.backward_of, op.out_alias, op.n_returned, op.out_struct, op.seconds,
        )  # fmt: skip
        for op in trace.ops
    )
    meta_rows = tuple(
        (tuple(m.shape), m.dtype, m.device, m.layout, m.stride, m.requires_grad) for m in metas
    )  # fmt: skip
    return TraceColumns(
        metas=meta_rows,
        keys=tuple(key_rows),
        values=values,
        ops=ops,
        fetches=tuple((f.kind, f.vid, f.after, f.loc) for f in trace.fetches),
        externals=tuple(trace.externals),
        storage_bytes=trace.storage_bytes,
        alive_at_end=trace.alive_at_end,
        released=trace.released,
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
    values = [Value(vid, p, k, metas[m], s) for vid, p, k, m, s in c.values]
    ops = [OpRecord(i, keys[k], *rest) for i, k, *rest in c.ops]
    return Trace(
        ops=ops,
        values=values,
        fetches=[Fetch(*f) for f in c.fetches],
        externals=list(c.externals),
        storage_bytes=c.storage_bytes,
        alive_at_end=c.alive_at_end,
        released=c.released,
        computed=c.computed,
        outside_loops=c.outside_loops,
        status=c.status,
        error=c.error,
    )
