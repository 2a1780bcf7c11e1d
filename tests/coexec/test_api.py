"""The GradientTape API: per-step tapes, gradient(), escaping placeholders, fetches, sync."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from coexec import Placeholder


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    data = [(torch.randn(16, 6), torch.randn(16, 1)) for _ in range(3)]
    return model, data


def test_a_new_tape_each_step_shares_one_program():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(6):
        x, y = data[i % 3]
        with coexec.GradientTape(backend="interpret") as tape:  # tf.GradientTape style: one a step
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            grads = tape.gradient(loss, model.parameters())
            opt.step()
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_grads = torch.autograd.grad(ref_loss, list(ref.parameters()))
        for p, g in zip(ref.parameters(), ref_grads):
            p.grad = g
        ref_opt.step()
        assert loss.item() == ref_loss.item()
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert tape.stats.steps == 6 and tape.stats.coexec_steps == 4 and tape.stats.traces == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_gradient_returns_none_for_unused_sources_and_one_tensor_for_one_source():
    w = torch.randn(3, requires_grad=True)
    unused = torch.randn(3, requires_grad=True)
    frozen = torch.randn(3)
    tape = coexec.GradientTape(backend="interpret", key="grad-shapes")
    with tape:
        loss = (w * 2).sum()
        g_w, g_unused, g_frozen = tape.gradient(loss, [w, unused, frozen], retain_graph=True)
        single = tape.gradient(loss, w)
    assert torch.equal(g_w, torch.full((3,), 2.0)) and g_unused is None and g_frozen is None
    assert isinstance(single, torch.Tensor) and torch.equal(single, g_w)
    assert torch.equal(w.grad, torch.full((3,), 4.0))  # accumulated twice into .grad


def co_step(tape, model, opt, x, y, out):
    with tape:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        out.append(loss)  # escapes into a user list
        loss.backward()
        opt.step()
    return loss


def test_placeholders_that_escape_behave_like_their_tensors():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tape = coexec.GradientTape(backend="interpret", key="escape")
    kept: list = []
    for i in range(5):
        loss = co_step(tape, model, opt, *data[i % 3], kept)
    assert tape.stats.coexec_steps >= 2
    assert isinstance(loss, Placeholder)  # co-executed
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref_kept: list = []
    for i in range(5):
        ref_loss = co_step_eager(ref, ref_opt, *data[i % 3], ref_kept)
    assert repr(loss) == repr(ref_loss) and str(loss) == str(ref_loss)
    assert f"{loss:.6f}" == f"{ref_loss:.6f}"
    assert loss.item() == ref_loss.item() and loss.tolist() == ref_loss.tolist()
    assert np.array_equal(loss.detach().numpy(), ref_loss.detach().numpy())
    assert torch.equal(loss * 2 + 1, ref_loss * 2 + 1)
    assert [t.item() for t in kept] == [t.item() for t in ref_kept]
    restored = pickle.loads(pickle.dumps(loss.detach()))
    assert type(restored) is torch.Tensor and torch.equal(restored, ref_loss.detach())
    buf = io.BytesIO()
    torch.save({"loss": loss.detach()}, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf)["loss"], ref_loss.detach())
    # persistent state holds real tensors, not placeholders
    for p in model.parameters():
        assert type(p.grad) is torch.Tensor
    for st in opt.state.values():
        assert all(type(v) is torch.Tensor for v in st.values())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def co_step_eager(model, opt, x, y, out):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    out.append(loss)
    loss.backward()
    opt.step()
    return loss


def printing_body(model, x, y):
    h = model(x)
    loss = F.mse_loss(h, y)
    print("loss is", loss)
    print(f"{loss.item():.5f}", loss.detach().numpy().round(5), h[:2].tolist() and "ok")
    loss.backward()


def test_prints_inside_a_coexecuted_step_match_eager(capsys):
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    tape = coexec.GradientTape(backend="interpret", key="prints")
    for i in range(5):
        with tape:
            printing_body(model, *data[i % 3])
    co_out = capsys.readouterr().out
    for i in range(5):
        printing_body(ref, *data[i % 3])
    # two traces (the second step accumulates into existing .grad), one covered, two co-executed
    assert tape.stats.coexec_steps == 2
    assert co_out == capsys.readouterr().out


def test_lazy_sync_runs_on_and_synchronize_binds():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tape = coexec.GradientTape(backend="interpret", key="lazy", sync="none")
    losses = []
    for i in range(6):
        losses.append(co_step(tape, model, opt, *data[i % 3], []))
    coexec.synchronize()
    ref_losses = [co_step_eager(ref, ref_opt, *data[i % 3], []) for i in range(6)]
    assert [t.item() for t in losses] == [t.item() for t in ref_losses]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())
    assert tape.stats.coexec_steps == 4


def test_stats_fields():
    tape = coexec.GradientTape(backend="interpret", key="stats")
    s = tape.stats
    assert (s.steps, s.traces, s.fallbacks, s.coexec_steps, s.phase) == (0, 0, 0, 0, "tracing")
    assert set(s.seconds) == {"tracing", "coexec", "eager"}


def fetching_body(model, x, y):
    h = model(x)
    loss = F.mse_loss(h, y)
    reads = [
        loss.item(), bool(loss > 0.5), float(loss), int(loss * 100), loss.tolist(),
        h.detach().numpy().sum(), np.asarray(h.detach()).shape, repr(loss), f"{loss:.4f}",
        h.cpu().sum().item(), h[0].tolist(), str(h.shape), len(h),
    ]  # fmt: skip
    loss.backward()
    return reads


def test_every_fetch_kind_reads_the_eager_value():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    tape = coexec.GradientTape(backend="interpret", key="fetch-kinds")
    got = []
    for i in range(5):
        with tape:
            got.append(fetching_body(model, *data[i % 3]))
    want = [fetching_body(ref, *data[i % 3]) for i in range(5)]
    assert tape.stats.coexec_steps >= 2 and tape.stats.fallbacks == 0
    assert got == want


def test_a_kept_placeholder_does_not_keep_its_step_alive():
    import gc

    from coexec.skeleton import Session

    model, data = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tape = coexec.GradientTape(backend="interpret", key="keep-alive")
    kept = []
    for i in range(5):
        kept.append(co_step(tape, model, opt, *data[i % 3], []))
    assert isinstance(kept[-1], Placeholder)
    assert kept[-1]._session is None and kept[-1]._real is not None
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) is Session]
    assert not alive, f"{len(alive)} step sessions still alive"
