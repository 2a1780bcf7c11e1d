"""The recorder: ops, value flow, storages, fetch points, backward locations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracegraph import RecordError, record
from tracegraph.location import BWD


def names(trace) -> list[str]:
    return [op.name for op in trace.ops]


def test_records_ops_in_order_with_value_flow_and_external_inputs():
    w = torch.randn(3, 3)
    x = torch.randn(2, 3)
    with record() as tr:
        h = x @ w
        y = h.relu()
        z = y + h
    assert names(tr) == ["aten::mm", "aten::relu", "aten::add.Tensor"]
    mm, relu, add = tr.ops
    assert [tr.values[v].external for v in mm.inputs] == [True, True]
    assert relu.inputs == mm.outputs
    assert add.inputs == (relu.outputs[0], mm.outputs[0])
    assert len(tr.externals) == 2 and tr.complete
    assert tr.values[add.outputs[0]].meta.shape == z.shape


def test_the_same_external_tensor_is_one_feed():
    w = torch.randn(3)
    with record() as tr:
        _ = w + w
        _ = w * 2
    assert len(tr.externals) == 1
    assert tr.ops[0].inputs == (tr.externals[0], tr.externals[0])


def test_views_share_their_base_storage_and_mutation_is_recorded():
    x = torch.randn(4, 4)
    with record() as tr:
        base = x.clone()
        v = base.view(16)
        v.add_(1.0)
        base.sum()
    clone, view, add_, total = tr.ops
    st = lambda vid: tr.values[vid].storage  # noqa: E731
    assert st(view.outputs[0]) == st(clone.outputs[0])
    assert add_.writes == (0,) and st(add_.outputs[0]) == st(clone.outputs[0])
    assert st(clone.outputs[0]) != st(clone.inputs[0])
    # the sum reads `base`, whose storage the in-place add wrote: same storage id
    assert st(total.inputs[0]) == st(add_.outputs[0])


def test_batch_norm_running_stats_are_recorded_as_written():
    bn = torch.nn.BatchNorm1d(3)
    with record() as tr:
        bn(torch.randn(4, 3))
    (op,) = [op for op in tr.ops if op.name == "aten::native_batch_norm"]
    written = {tr.values[op.inputs[i]].meta.shape for i in op.writes}
    assert len(op.writes) == 2 and written == {(3,)}


def test_python_numbers_in_tensor_positions_are_attributes_not_inputs():
    x = torch.randn(3)
    with record() as tr:
        _ = 0.5 * x
        _ = x * 0.5
        _ = x + 1
    assert [len(op.inputs) for op in tr.ops] == [1, 1, 1]
    assert (float, 0.5) in tr.ops[0].key.attrs and (int, 1) in tr.ops[2].key.attrs


def test_numbers_keep_their_type_in_the_key():
    x = torch.ones(3, dtype=torch.int64)
    with record() as tr:
        for c in (1, 1.0):
            _ = x + c
    a, b = tr.ops
    assert a.key != b.key  # int + 1 stays int64; int + 1.0 becomes float


@pytest.mark.parametrize(
    "read, kind",
    [
        (lambda t: t.item(), "item"),
        (lambda t: bool(t > 0), "bool"),
        (lambda t: float(t), "float"),
        (lambda t: int(t), "int"),
        (lambda t: t.tolist(), "tolist"),
        (lambda t: t.detach().numpy(), "numpy"),
        (lambda t: np.asarray(t.detach()), "numpy"),
        (lambda t: repr(t), "repr"),
        (lambda t: f"{t:.3f}", "format"),
        (lambda t: t.cpu(), "cpu"),
    ],
)
def test_fetch_points(read, kind):
    x = torch.randn(5)
    with record() as tr:
        s = x.sum()
        read(s)
    assert [f.kind for f in tr.fetches][-1] == kind
    assert tr.fetches[-1].after == len(tr.ops)  # after every op that ran before it


def test_printing_a_tensor_records_a_fetch_not_the_formatting_ops():
    x = torch.randn(3, 3)
    with record() as tr:
        y = x.exp()
        print(y)
    assert names(tr) == ["aten::exp"]
    (fetch,) = tr.fetches
    assert fetch.kind == "repr" and fetch.vid == tr.ops[0].outputs[0]


def test_backward_ops_point_to_the_forward_op_and_its_line():
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    with record() as tr:
        h = x @ w  # line A
        loss = h.tanh().sum()
        loss.backward()
    fwd = {op.name: op for op in tr.ops if op.backward_of is None}
    grads = [op for op in tr.ops if op.backward_of is not None]
    assert grads and all(op.is_backward for op in grads)
    tanh_bwd = next(op for op in grads if op.name == "aten::tanh_backward")
    assert tr.ops[tanh_bwd.backward_of] is fwd["aten::tanh"]
    mm_grads = [op for op in grads if op.backward_of == fwd["aten::mm"].index]
    assert [op.name for op in mm_grads] == ["aten::t", "aten::mm"]
    # the location of a gradient op names the forward line it differentiates
    assert repr(mm_grads[-1]).endswith(repr(fwd["aten::mm"]).split(" at ")[1])
    assert "grad of" in repr(mm_grads[-1])
    assert any(c == BWD for c, _ in mm_grads[-1].key.loc)


def test_random_ops_are_flagged():
    with record() as tr:
        torch.nn.functional.dropout(torch.ones(8), 0.5)
    assert any(op.random for op in tr.ops)


def test_the_same_op_on_two_lines_has_two_keys_and_in_a_loop_one():
    x = torch.randn(3)
    with record() as tr:
        _ = x.sin()
        _ = x.sin()
        for _i in range(2):
            _ = x.sin()
    a, b, c, d = tr.ops
    assert a.key != b.key and c.key == d.key


def test_a_step_that_raises_leaves_a_failed_trace():
    with pytest.raises(ZeroDivisionError):
        with record() as tr:
            torch.ones(2).exp()
            1 / 0
    assert tr.status == "failed" and isinstance(tr.error, ZeroDivisionError)
    # the modes are gone: recording again works
    with record() as tr2:
        torch.ones(2).exp()
    assert tr2.complete and names(tr2) == ["aten::ones", "aten::exp"]


def test_recording_does_not_nest_and_is_single_use():
    r = record()
    with r:
        with pytest.raises(RecordError, match="already active"):
            with record():
                pass
    with pytest.raises(RecordError, match="already used"):
        with r:
            pass


def test_recording_changes_no_results():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def step(m):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    import copy

    m2 = copy.deepcopy(model)
    ref_loss, ref_grads = step(model)
    with record():
        loss, grads = step(m2)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_trace_holds_no_tensors():
    import gc
    import weakref

    x = torch.randn(100)
    with record() as tr:
        y = x.exp()
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None  # the trace did not keep the op's output alive
    assert len(tr.values) == 2
