"""Plain PyTorch code inside a co-executed step behaves as eager (issue 14, items 1-6): printing
tensors made in the step, ``torch.save``/``copy.deepcopy`` of them and of model state,
``torch.tensor([r])`` of a 0-d tensor from the step, batches from a ``DataLoader`` with workers,
sparse embeddings, and an op failing on data inside the user's ``try``.

Each program runs eagerly and under coexec from the same seed; everything it prints, saves and
returns, and the final state, must be equal bit for bit, and the pattern must have run in
co-executed steps (not only while tracing)."""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import coexec

from tests.coexec.helpers import tensors_of

_keys = itertools.count()


def run_program(make, step, steps: int, use_coexec: bool):
    """Runs ``step(state, i, out)`` ``steps`` times; ``out`` collects what the program shows
    (printed text, saved bytes). Returns (out, final state tensors, tape)."""
    state = make()
    key = ("ordinary", next(_keys))
    tape = coexec.GradientTape(backend="interpret", key=key, timeout=30.0) if use_coexec else None
    out: list = []
    for i in range(steps):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            if tape is None:
                step(state, i, out)
            else:
                with tape:
                    step(state, i, out)
        out.append(text.getvalue())
    return out, [t.detach().clone() for t in tensors_of(state)], tape


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.requires_grad == b.requires_grad and torch.equal(a, b)
        )  # fmt: skip
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_as_eager(make, step, steps: int = 8, min_coexec: int = 3) -> coexec.GradientTape:
    eager_out, eager_state, _ = run_program(make, step, steps, False)
    co_out, co_state, tape = run_program(make, step, steps, True)
    for i, (a, b) in enumerate(zip(co_out, eager_out)):
        assert same(a, b), f"item {i} differs:\ncoexec {a!r}\neager  {b!r}"
    assert len(co_out) == len(eager_out)
    for i, (a, b) in enumerate(zip(co_state, eager_state)):
        assert torch.equal(a, b), f"state tensor {i} differs"
    s = tape.stats
    assert s.coexec_steps + s.fallbacks >= min_coexec, s
    return tape


def make_linear():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    return SimpleNamespace(lin=lin, opt=torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9))


def linear_step(s, i):
    s.opt.zero_grad()
    torch.manual_seed(100 + i)
    out = s.lin(torch.randn(8, 4))
    loss = out.pow(2).mean()
    loss.backward()
    s.opt.step()
    return out, loss


def test_printing_tensors_made_in_the_step():
    def step(s, i, out):
        h, loss = linear_step(s, i)
        print(i, h.sum(0))  # 1-D, with grad_fn
        print(h.detach()[:2])  # 2-D
        print(loss, f"{loss:.4f}", repr(h.sum(0).detach()))
        print(torch.arange(3) * i)  # int64, no grad
        out.append(loss.item())

    tape = assert_as_eager(make_linear, step)
    assert tape.stats.fallbacks == 0 and tape.stats.traces <= 2


def test_printing_a_tensor_kept_from_a_coexecuted_step():
    s = make_linear()
    tape = coexec.GradientTape(backend="interpret", key=("ordinary", "kept"))
    for i in range(4):
        with tape:
            h, loss = linear_step(s, i)
            kept = h.sum(0)
    assert tape.stats.coexec_steps >= 1
    eager = torch.tensor(kept.tolist(), requires_grad=True) * 1.0  # same values, a grad_fn
    assert repr(kept) == repr(eager).replace("MulBackward0", "SumBackward1")


def test_torch_save_and_deepcopy_of_state_and_of_tensors_made_in_the_step():
    def step(s, i, out):
        h, loss = linear_step(s, i)
        buf = io.BytesIO()
        torch.save({"model": s.lin.state_dict(), "opt": s.opt.state_dict(), "h": h, "loss": loss}, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        snapshot = copy.deepcopy(s.lin.state_dict())  # a checkpoint kept in memory
        copied = copy.deepcopy(h.detach())
        plain = [*loaded["model"].values(), loaded["h"], loaded["loss"], *snapshot.values(), copied]
        assert all(type(t) is torch.Tensor for t in plain)  # plain tensors, not placeholders
        out.extend([loaded, snapshot, copied])
        with pytest.raises(RuntimeError, match="Only Tensors created explicitly by the user"):
            copy.deepcopy(h)  # eager refuses a non-leaf: so does coexec

    tape = assert_as_eager(make_linear, step)
    assert tape.stats.fallbacks == 0 and tape.stats.traces <= 2  # not a new trace per step


def test_torch_tensor_of_tensors_made_in_the_step():
    def step(s, i, out):
        h, loss = linear_step(s, i)
        r = h.detach().sum() * 0.5  # a 0-d tensor of the step (actor-critic's R)
        returns = torch.tensor([r, loss.item(), 1.0])
        out.append(returns)
        out.append(torch.tensor(r))
        out.append(torch.as_tensor([r, r]))
        out.append((returns * 2).sum().item())

    tape = assert_as_eager(make_linear, step)
    assert tape.stats.fallbacks == 0 and tape.stats.traces <= 2


def test_torch_tensor_of_a_length_that_varies_does_not_crash():
    def step(s, i, out):
        h, loss = linear_step(s, i)
        rewards = [float(x) for x in h.detach()[: 2 + i % 3, 0]]
        out.append(torch.tensor(rewards).sum().item())

    assert_as_eager(make_linear, step, steps=10, min_coexec=1)


def test_dataloader_with_workers_inside_the_step():
    def make():
        torch.manual_seed(0)
        lin = nn.Linear(4, 3)
        data = TensorDataset(torch.randn(64, 4), torch.randn(64, 3))
        loader = DataLoader(data, batch_size=8, num_workers=2)
        return SimpleNamespace(lin=lin, opt=torch.optim.SGD(lin.parameters(), lr=0.1), it=iter(loader))

    def step(s, i, out):
        x, y = next(s.it)  # built by a worker in shared memory
        s.opt.zero_grad()
        loss = (s.lin(x) - y).pow(2).mean()
        loss.backward()
        s.opt.step()
        out.append(loss.item())

    tape = assert_as_eager(make, step)
    assert tape.stats.fallbacks == 0 and tape.stats.traces <= 3


def test_sparse_embedding_with_sgd():
    def make():
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True)
        return SimpleNamespace(emb=emb, opt=torch.optim.SGD(emb.parameters(), lr=0.1))

    def step(s, i, out):
        idx = torch.tensor([[1, 2, 3], [4, 5, 1]])
        s.opt.zero_grad()
        loss = s.emb(idx).pow(2).sum()
        loss.backward()
        out.append(s.emb.weight.grad.coalesce().values().clone())
        s.opt.step()
        out.append(loss.item())

    tape = assert_as_eager(make, step)
    assert tape.stats.fallbacks == 0 and tape.stats.traces <= 2


def test_an_op_failing_on_data_inside_the_users_try_is_caught_there():
    def make():
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4)
        return SimpleNamespace(emb=emb, opt=torch.optim.SGD(emb.parameters(), lr=0.1))

    def step(s, i, out):
        idx = torch.tensor([1, 2, 3 if i % 3 else 12])  # out of range on steps 0, 3, 6
        s.opt.zero_grad()
        try:
            h = s.emb(idx)
        except IndexError as e:
            print("caught", type(e).__name__)
            h = s.emb(idx.clamp(max=9))
        loss = h.pow(2).sum()
        loss.backward()
        s.opt.step()
        out.append(loss.item())

    tape = assert_as_eager(make, step, steps=9)
    # steps 3 and 6 co-executed up to the failing op, then went on eagerly
    assert tape.stats.fallbacks == 2 and "IndexError raised by aten::embedding" in tape.stats.last_fallback


def test_an_op_failing_outside_any_try_still_fails_the_step():
    """No ``try`` around the op: the error leaves the step, as in eager (where it surfaces is
    covered in test_errors.py), and the next step runs normally."""
    s = SimpleNamespace(emb=nn.Embedding(10, 4))
    tape = coexec.GradientTape(backend="interpret", key=("ordinary", "no-try"), timeout=30.0)
    for i in range(4):
        idx = torch.tensor([1, 12 if i == 3 else 2])
        with pytest.raises(Exception) if i == 3 else contextlib.nullcontext() as raised:
            with tape:
                loss = s.emb(idx).sum()
                loss.backward()
    assert "index out of range" in str(raised.value) + str(raised.value.__cause__)
    with tape:
        loss = s.emb(torch.tensor([1, 2])).sum()
    assert torch.isfinite(loss).item()


def test_set_to_a_storage_falls_back_and_planning_goes_on(recwarn):
    """``t.set_(storage)`` (cuDNN's LSTM does it for its flat weight buffer on a GPU): the
    op's key holds the storage by size, so steps match one another, and the path pickles for
    the planning process (an ``UntypedStorage`` does not load back: the process died, and
    every later plan was made in the user's process)."""

    def make():
        state = make_linear()
        state.src, state.buf = torch.randn(8), torch.empty(0)
        return state

    def step(s, i, out):
        with torch.no_grad():
            s.buf.set_(s.src.untyped_storage())
        h, loss = linear_step(s, i)
        out.append((loss * s.buf.sum()).item())

    tape = assert_as_eager(make, step)
    coexec.wait_for_plans()
    assert tape.stats.traces <= 3
    assert not [w for w in recwarn if "planning process failed" in str(w.message)]


_LIB = torch.library.Library("coexec_test_flat", "DEF")
_LIB.define("weighted_sum(Tensor x, Tensor w) -> Tensor")


def _weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """As cuDNN's LSTM does with its weights (``try_get_weight_buf``): an empty tensor set to
    the weights' storage, used as a flat buffer if it is large enough, else the weights."""
    buf = torch.empty(0, dtype=w.dtype, device=w.device).set_(w.untyped_storage())
    if buf.numel() >= w.numel():
        return (x * buf[: w.numel()].view_as(w)).sum()
    return (x * w).sum()


_LIB.impl("weighted_sum", _weighted_sum, "CompositeImplicitAutograd")


def test_a_call_that_sets_an_empty_tensor_of_the_step_to_a_storage_runs_as_eager():
    """Inside a torch-level call (a composite op), ``set_`` of an empty tensor the step made,
    onto a storage: the step falls back there, the real tensor is set, and the call, which
    sees the tensor still empty, takes its other way to the same values (cuDNN's LSTM on a GPU
    raised ``CoexecError`` here)."""

    def make():
        state = make_linear()
        state.w = torch.randn(8, 3)  # (cuDNN: the weights, whose storage is real)
        return state

    def step(s, i, out):
        s.opt.zero_grad()
        torch.manual_seed(100 + i)
        x = s.lin(torch.randn(8, 4))
        loss = torch.ops.coexec_test_flat.weighted_sum(x.tanh(), s.w)
        loss.backward()
        s.opt.step()
        out.append(loss.item())

    tape = assert_as_eager(make, step)
    assert tape.stats.fallbacks >= 1
    assert any("set_" in r for r in tape.stats.fallback_reasons)


def test_deepcopy_of_a_model_inside_the_step_makes_parameters_as_eager():
    """``copy.deepcopy(model)`` in a co-executed step (an EMA model, a snapshot of the best
    one): each copied parameter is ``nn.Parameter(p.data.clone())`` of a tensor of the step.
    Once the step co-executed past the copy, ``Parameter`` raised (its path for tensor
    subclasses ran a ``detach`` eager never ran, and the step fell back there)."""

    def make():
        state = make_linear()
        state.ema = copy.deepcopy(state.lin)
        return state

    def step(s, i, out):
        h, loss = linear_step(s, i)
        snapshot = copy.deepcopy(s.lin)
        with torch.no_grad():
            for pe, p in zip(s.ema.parameters(), snapshot.parameters()):
                pe.mul_(0.9).add_(p, alpha=0.1)
        assert all(type(p) is nn.Parameter for p in snapshot.parameters())
        out.append([p.detach().clone() for p in snapshot.parameters()])
        out.append(loss.item())

    tape = assert_as_eager(make, step)
    assert tape.stats.coexec_steps >= 3 and tape.stats.fallbacks == 0


def test_lazy_conjugate_and_negative_views_compute_as_eager():
    """``z.conj()`` is a view with the conjugate bit, ``z.conj().imag`` one with the negative
    bit; dispatch resolves them before an op reads them. Placeholders did not carry the bits,
    so ``z * z.conj()`` computed z * z once the step co-executed (a loss off by 2, silently),
    and ``.real`` of a placeholder was its own method of that name."""

    def step(s, i, out):
        s.opt.zero_grad()
        torch.manual_seed(100 + i)
        h = s.lin(torch.randn(8, 4))
        z = torch.complex(h, torch.ones_like(h))
        loss = (z * z.conj()).real.mean() + (z.conj().imag * h).mean()
        loss.backward()
        s.opt.step()
        out.append(loss.item())

    tape = assert_as_eager(make_linear, step)
    assert tape.stats.coexec_steps >= 3 and tape.stats.fallbacks == 0


def make_gru():
    torch.manual_seed(0)
    gru, head = nn.GRU(4, 5, batch_first=True), nn.Linear(5, 2)
    opt = torch.optim.SGD([*gru.parameters(), *head.parameters()], lr=0.1)
    lengths = [torch.tensor(v) for v in ([6, 4, 3], [5, 5, 2], [6, 2, 1])]
    return SimpleNamespace(gru=gru, head=head, opt=opt, lengths=lengths)


@pytest.mark.parametrize("pad", [False, True])
def test_a_gru_over_a_packed_sequence_runs_as_eager(pad):
    """``pack_padded_sequence`` makes its ``batch_sizes`` in the step, and the GRU's C++ reads
    them from the tensor's data (a placeholder has none: it raised); the lengths decide the
    packed data's shape, so that op's result is waited for; ``pad_packed_sequence`` fills
    the lengths it returns through a C++ pointer, so the step falls back there."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    def step(s, i, out):
        torch.manual_seed(100 + i)
        x = torch.randn(3, 6, 4)
        packed = pack_padded_sequence(x, s.lengths[i % 3], batch_first=True, enforce_sorted=False)
        seq, h = s.gru(packed)
        feat = h[0]
        if pad:
            padded, lens = pad_packed_sequence(seq, batch_first=True)
            feat = feat + padded.sum(1) / lens[:, None]
        loss = s.head(feat).pow(2).mean()
        s.opt.zero_grad()
        loss.backward()
        s.opt.step()
        out.append(loss.item())

    tape = assert_as_eager(make_gru, step, steps=9)
    if pad:
        assert tape.stats.fallbacks >= 3
        assert "_pad_packed_sequence fills the tensors it makes in C++" in tape.stats.fallback_reasons[-1]
    else:
        assert tape.stats.coexec_steps >= 3 and tape.stats.fallbacks == 0


def _clip_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)) for _ in range(3)]
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "data": data}


def _clip_step(state: dict, i: int) -> torch.Tensor:
    model, opt = state["model"], state["opt"]
    x, y = state["data"][i % 3]
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    opt.step()
    return loss


def test_gradient_clipping_takes_the_path_eager_takes():
    """``clip_grad_norm_`` picks ``_foreach_norm`` by the gradients' exact type: placeholders
    count as tensors there (coexec/placeholder.py), so a co-executed step takes the traced
    steps' path (before: the per-tensor loop, a fallback and one more trace)."""
    from tests.coexec.helpers import assert_same_as_eager

    tape = assert_same_as_eager(_clip_state, _clip_step, 8)
    s = tape.stats
    assert (s.traces, s.fallbacks, s.coexec_steps) == (1, 0, 6), s
    assert any(n.name == "aten::_foreach_norm.Scalar" for n in tape.graph.nodes())
