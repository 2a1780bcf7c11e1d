"""A trace pickles as columns (tracegraph/wire.py): each distinct op key and metadata once, and
back as an equal trace, with plain ``pickle``."""

from __future__ import annotations

import pickle
from dataclasses import fields

import torch

from tracegraph import record
from tracegraph.trace import Trace
from tracegraph.wire import from_columns, to_columns


def looped() -> Trace:
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with record() as tr:
        x = torch.randn(2, 4)
        total = 0.0
        for _ in range(5):
            loss = lin(x).pow(2).mean()
            total += loss.item()
        loss.backward()
        opt.step()
    return tr


def same(a: object, b: object) -> bool:
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a))  # type: ignore[arg-type]


def test_a_trace_comes_back_equal_field_by_field():
    tr = looped()
    back = pickle.loads(pickle.dumps(tr))
    assert len(back.ops) == len(tr.ops) and len(back.values) == len(tr.values)
    assert all(same(a, b) for a, b in zip(back.ops, tr.ops))
    assert all(same(a, b) for a, b in zip(back.values, tr.values))
    assert all(same(a, b) for a, b in zip(back.fetches, tr.fetches)) and len(back.fetches) == 5
    assert [op.func for op in back.ops] == [op.func for op in tr.ops]  # the same OpOverloads
    assert all(type(v.meta.shape) is torch.Size for v in back.values)
    for name in ("externals", "storage_bytes", "alive_at_end", "released", "outside_loops", "status"):
        assert getattr(back, name) == getattr(tr, name), name
    assert back.complete and back.computed == tr.computed


def test_each_distinct_op_key_and_metadata_is_stored_once():
    tr = looped()
    cols = to_columns(tr)
    assert len(cols.keys) == len(set(op.key for op in tr.ops)) < len(tr.ops)
    metas = {v.meta for v in tr.values} | {m for op in tr.ops for m in op.key.metas}
    assert len(cols.metas) == len(metas) < len(tr.values)
    back = from_columns(cols)
    # ops with equal keys share one key object after the trip
    assert len({id(op.key) for op in back.ops}) == len(cols.keys)


def test_equal_keys_and_metadata_of_a_loop_are_one_object_each():
    # the recorder interns them (OpKey.of, TensorMeta.of): fewer objects for the garbage
    # collector, and the columns above are built by identity in C
    tr = looped()
    assert len({id(op.key) for op in tr.ops}) == len({op.key for op in tr.ops}) < len(tr.ops)
    assert len({id(v.meta) for v in tr.values}) == len({v.meta for v in tr.values}) < len(tr.values)
    # two traces of the same step share them too
    again = looped()
    assert {id(op.key) for op in again.ops} <= {id(op.key) for op in tr.ops}


def test_the_intern_tables_are_bounded(monkeypatch):
    from tracegraph import schema, trace

    monkeypatch.setattr(schema, "_METAS_MAX", 4)
    monkeypatch.setattr(trace, "_KEYS_MAX", 4)
    for n in range(1, 10):  # sizes never seen before: each a new meta and new keys
        with record():
            torch.zeros(n + 1000).add(1)
        assert len(schema._METAS) <= 4 and len(trace._KEYS) <= 4
