"""Probe: common PyTorch patterns inside a training step, eager against coexec.

    python bench/plain_patterns.py [--steps 8] [--only NAME,...]

Each pattern is a small training step (three model families: an MLP with dropout and AdamW, an
embedding model with Adam, a sequence model with a transformer layer, attention and RNNs) that
uses one thing a real program does inside its step: gradient clipping, autocast, ``.numpy()``,
LR schedulers, evaluation under ``no_grad``, gradient accumulation, both kinds of checkpointing,
``GradScaler``, an EMA made with ``copy.deepcopy``, sampling, distributions, custom
``autograd.Function``s, hooks, ``autograd.grad`` with ``create_graph``, a ``DataLoader``,
padding masks, packed sequences, ``nonzero``/``masked_select``/``unique``, FFT, linear algebra,
complex numbers, dtype casts. Each runs ``--steps`` steps eagerly and under
``coexec.GradientTape(backend="interpret")`` from the same seed; a line per pattern says whether
the values it returns and the final parameters (and buffers) are bit-equal, or the error coexec
raised, with the tape's co-executed steps, fallbacks and traces. (Patterns written while looking
for crashes: each bug they found has its own test in tests/coexec/test_ordinary_code.py.)
"""
# ruff: noqa: B006

from __future__ import annotations

import argparse
import copy
import io
import math
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

import coexec


def update(opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """The usual end of a step: zero the gradients, backward, step; the loss's value."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def kept(store: dict, make):
    """What a pattern keeps across steps (a scheduler, an EMA model), made at its first step
    (``store`` is emptied between the eager and the coexec run)."""
    if "it" not in store:
        store["it"] = make()
    return store["it"]


# -- an MLP with dropout and AdamW --
def a_make(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt


a_X = [torch.randn(6, 8) for _ in range(3)]
a_Y = [torch.randint(0, 4, (6,)) for _ in range(3)]


def pa_clip(m, opt, i):
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    opt.zero_grad()
    loss.backward()
    n = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
    opt.step()
    return loss.item() + n.item()


def pa_autocast(m, opt, i):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    return update(opt, loss)


def pa_numpy(m, opt, i):
    out = m(a_X[i % 3])
    loss = F.cross_entropy(out, a_Y[i % 3])
    update(opt, loss)
    return float(out.detach().numpy().sum()) + sum(out.argmax(1).tolist())


def pa_sched(m, opt, i, _s={}):
    s = kept(_s, lambda: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    update(opt, loss)
    s.step()
    return loss.item()


def pa_eval(m, opt, i):
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    update(opt, loss)
    m.eval()
    with torch.no_grad():
        acc = (m(a_X[(i + 1) % 3]).argmax(1) == a_Y[(i + 1) % 3]).float().mean()
    m.train()
    return loss.item() + acc.item()


def pa_accum(m, opt, i):
    tot = 0.0
    for k in range(2):
        loss = F.cross_entropy(m(a_X[(i + k) % 3]), a_Y[(i + k) % 3]) / 2
        loss.backward()
        tot += loss.item()
    opt.step()
    opt.zero_grad()
    return tot


def pa_ckpt(m, opt, i):
    from torch.utils.checkpoint import checkpoint

    h = checkpoint(m[0], a_X[i % 3], use_reentrant=False)
    loss = F.cross_entropy(m[3](m[2](m[1](h))), a_Y[i % 3])
    return update(opt, loss)


def pa_scaler(m, opt, i, _s={}):
    sc = kept(_s, lambda: torch.amp.GradScaler("cpu", init_scale=1024.0))
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    opt.zero_grad()
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    return loss.item()


def pa_deepcopy_ema(m, opt, i, _s={}):
    ema = kept(_s, lambda: copy.deepcopy(m))
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    update(opt, loss)
    snapshot = copy.deepcopy(m)  # each step too (the best model so far, say)
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), snapshot.parameters()):
            pe.mul_(0.9).add_(p, alpha=0.1)
    return loss.item()


def pa_multinomial(m, opt, i):
    out = m(a_X[i % 3])
    a = torch.multinomial(out.softmax(-1), 1).squeeze(1)
    loss = F.cross_entropy(out, a)
    return update(opt, loss)


def pa_inplace_param(m, opt, i):
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    update(opt, loss)
    with torch.no_grad():
        m[0].weight.clamp_(-0.5, 0.5)
    return loss.item()


def pa_state_dict(m, opt, i):
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    update(opt, loss)
    sd = m.state_dict()
    buf = io.BytesIO()
    torch.save({"m": sd, "o": opt.state_dict()}, buf)
    return loss.item() + len(buf.getvalue())


def pa_wnorm(m, opt, i, _s={}):
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3]) + 1e-3 * sum(p.norm() for p in m.parameters())
    return update(opt, loss)


def pa_grad_print(m, opt, i):
    loss = F.cross_entropy(m(a_X[i % 3]), a_Y[i % 3])
    opt.zero_grad()
    loss.backward()
    s = str(m[0].weight.grad[0, :3])
    opt.step()
    return loss.item() + len(s)


# -- an embedding model with Adam --
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, idx):
        return self.fc(self.ln(self.emb(idx)).mean(1))


def b_make(seed=0):
    torch.manual_seed(seed)
    m = Net()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    return m, opt


b_X = [torch.randint(0, 20, (5, 7)) for _ in range(3)]
b_Y = [torch.randint(0, 4, (5,)) for _ in range(3)]


def b_base(m, i):
    return F.cross_entropy(m(b_X[i % 3]), b_Y[i % 3])


def pb_buffer_update(m, opt, i):
    loss = b_base(m, i)
    update(opt, loss)
    m.count += 1
    return loss.item() + m.count.item()


def pb_nan_check(m, opt, i):
    loss = b_base(m, i)
    if torch.isnan(loss):
        return 0.0
    return update(opt, loss)


def pb_math(m, opt, i):
    loss = b_base(m, i)
    update(opt, loss)
    return math.exp(loss.item()) + float(loss)


def pb_grad_list(m, opt, i):
    loss = b_base(m, i)
    opt.zero_grad()
    loss.backward()
    gn = torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None]).norm()
    opt.step()
    return gn.item()


def pb_zero_grad_none_false(m, opt, i):
    loss = b_base(m, i)
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return loss.item()


def pb_torch_no_grad_metrics(m, opt, i, _h={}):
    _hist = kept(_h, list)
    loss = b_base(m, i)
    update(opt, loss)
    with torch.no_grad():
        _hist.append(loss.detach())
        avg = torch.stack(_hist[-3:]).mean()
    return avg.item()


def pb_param_groups_lr(m, opt, i):
    for g in opt.param_groups:
        g["lr"] = 1e-2 * (0.9**i)
    loss = b_base(m, i)
    return update(opt, loss)


def pb_requires_grad_toggle(m, opt, i):
    m.emb.weight.requires_grad_(i % 2 == 0)
    loss = b_base(m, i)
    return update(opt, loss)


def pb_loss_dict(m, opt, i):
    out = m(b_X[i % 3])
    losses = {"ce": F.cross_entropy(out, b_Y[i % 3]), "reg": out.pow(2).mean() * 0.01}
    total = sum(losses.values())
    opt.zero_grad()
    total.backward()
    opt.step()
    return {k: v.item() for k, v in losses.items()}["ce"]


def pb_one_hot(m, opt, i):
    out = m(b_X[i % 3])
    t = F.one_hot(b_Y[i % 3], 4).float()
    loss = F.binary_cross_entropy_with_logits(out, t)
    return update(opt, loss)


def pb_topk_index(m, opt, i):
    out = m(b_X[i % 3])
    v, idx = out.topk(2, dim=1)
    loss = v.sum() + out[torch.arange(5), b_Y[i % 3]].sum()
    update(opt, loss)
    return loss.item() + idx.sum().item()


def pb_where_mask(m, opt, i):
    out = m(b_X[i % 3])
    mask = out > 0
    loss = torch.where(mask, out, out * 0.1).sum()
    update(opt, loss)
    return loss.item() + mask.sum().item()


def pb_inplace_act(m, opt, i):
    h = m.ln(m.emb(b_X[i % 3])).mean(1)
    h = F.relu(h, inplace=True) if False else F.relu(h)
    out = m.fc(h)
    loss = F.cross_entropy(out, b_Y[i % 3])
    return update(opt, loss)


def pb_sgd_nesterov_wd(m, opt, i, _o={}):
    o = kept(
        _o,
        lambda: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4
        ),
    )
    loss = b_base(m, i)
    return update(o, loss)


def pb_rmsprop(m, opt, i, _o={}):
    o = kept(_o, lambda: torch.optim.RMSprop(m.parameters(), lr=0.01))
    loss = b_base(m, i)
    return update(o, loss)


def pb_generator(m, opt, i):
    g = torch.Generator().manual_seed(i)
    noise = torch.randn(5, 4, generator=g)
    loss = (m(b_X[i % 3]) + noise).pow(2).mean()
    return update(opt, loss)


class Sq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def pb_custom_fn(m, opt, i):
    loss = Sq.apply(m(b_X[i % 3])).mean()
    return update(opt, loss)


def pb_module_hook(m, opt, i, _h={}):
    if id(m) not in _h:
        _h[id(m)] = m.fc.register_full_backward_hook(lambda mod, gi, go: None)
    loss = b_base(m, i)
    return update(opt, loss)


def pb_tensor_hook_clip(m, opt, i):
    out = m(b_X[i % 3])
    out.register_hook(lambda g: g.clamp(-0.1, 0.1))
    loss = F.cross_entropy(out, b_Y[i % 3])
    return update(opt, loss)


def pb_distributions(m, opt, i):
    logits = m(b_X[i % 3])
    d = torch.distributions.Categorical(logits=logits)
    a = d.sample()
    loss = -(d.log_prob(a) * 0.5).mean() - 0.01 * d.entropy().mean()
    return update(opt, loss)


def pb_autograd_grad_penalty(m, opt, i):
    e = m.ln(m.emb(b_X[i % 3])).mean(1).detach().requires_grad_(True)
    out = m.fc(e)
    (g,) = torch.autograd.grad(out.sum(), e, create_graph=True)
    loss = F.cross_entropy(out, b_Y[i % 3]) + 0.1 * g.pow(2).mean()
    return update(opt, loss)


def pb_retain_graph(m, opt, i):
    out = m(b_X[i % 3])
    l1 = F.cross_entropy(out, b_Y[i % 3])
    l2 = out.pow(2).mean()
    opt.zero_grad()
    l1.backward(retain_graph=True)
    l2.backward()
    opt.step()
    return l1.item() + l2.item()


def pb_reentrant_ckpt(m, opt, i):
    from torch.utils.checkpoint import checkpoint

    e = m.emb(b_X[i % 3])
    h = checkpoint(m.ln, e, use_reentrant=True)
    out = m.fc(h.mean(1))
    loss = F.cross_entropy(out, b_Y[i % 3])
    return update(opt, loss)


def pb_dataloader(m, opt, i, _dl={}):
    from torch.utils.data import DataLoader, TensorDataset

    it = kept(
        _dl,
        lambda: iter(
            DataLoader(TensorDataset(torch.cat(b_X * 4), torch.cat(b_Y * 4)), batch_size=5)
        ),
    )
    x, y = next(it)
    loss = F.cross_entropy(m(x), y)
    return update(opt, loss)


# -- a sequence model --
class SeqNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.fc = nn.Linear(16, 3)


def c_make(seed=0):
    torch.manual_seed(seed)
    m = SeqNet()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return m, opt


c_X = [torch.randn(4, 6, 16) for _ in range(3)]
c_Y = [torch.randint(0, 3, (4,)) for _ in range(3)]
c_LENS = [torch.tensor([6, 5, 3, 2]), torch.tensor([6, 6, 4, 1]), torch.tensor([5, 4, 4, 2])]


def c_fin(m, opt, h, i):
    loss = F.cross_entropy(m.fc(h), c_Y[i % 3])
    return update(opt, loss)


def pc_encoder(m, opt, i):
    return c_fin(m, opt, m.enc(c_X[i % 3]).mean(1), i)


def pc_encoder_mask(m, opt, i):
    mask = torch.arange(6)[None] >= c_LENS[i % 3][:, None]
    return c_fin(m, opt, m.enc(c_X[i % 3], src_key_padding_mask=mask).mean(1), i)


def pc_mha(m, opt, i):
    h, w = m.mha(c_X[i % 3], c_X[i % 3], c_X[i % 3])
    return c_fin(m, opt, h.mean(1), i) + w.sum().item()


def pc_sdpa(m, opt, i):
    q = c_X[i % 3].view(4, 6, 2, 8).transpose(1, 2)
    h = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(4, 6, 16)
    return c_fin(m, opt, m.enc.linear1.weight[:16, :16].sum() * 0 + h.mean(1), i)


def pc_gru_packed(m, opt, i):
    packed = pack_padded_sequence(c_X[i % 3], c_LENS[i % 3], batch_first=True, enforce_sorted=False)
    out, hn = m.gru(packed)
    out, _ = pad_packed_sequence(out, batch_first=True)
    return c_fin(m, opt, hn[0], i)


def pc_lstm(m, opt, i):
    out, (hn, _cn) = m.lstm(c_X[i % 3])
    return c_fin(m, opt, hn[0] + out.mean(1), i)


def pc_pad_sequence(m, opt, i):
    seqs = [c_X[i % 3][k, : int(c_LENS[i % 3][k])] for k in range(4)]
    h = pad_sequence(seqs, batch_first=True).sum(1)
    return c_fin(m, opt, h, i)


def pc_nonzero_select(m, opt, i):
    h = m.enc(c_X[i % 3]).mean(1)
    sel = torch.nonzero(h.sum(1) > 0).squeeze(1)
    loss = F.cross_entropy(m.fc(h)[sel], c_Y[i % 3][sel]) if sel.numel() else m.fc(h).sum() * 0
    return update(opt, loss)


def pc_masked_select(m, opt, i):
    h = m.fc(c_X[i % 3].mean(1))
    v = h.masked_select(h > 0)
    loss = v.sum() + F.cross_entropy(h, c_Y[i % 3])
    return update(opt, loss)


def pc_unique(m, opt, i):
    u, c = torch.unique(c_Y[i % 3], return_counts=True)
    w = torch.zeros(3).index_add_(0, u, c.float())
    loss = F.cross_entropy(m.fc(c_X[i % 3].mean(1)), c_Y[i % 3], weight=1.0 / (w + 1))
    return update(opt, loss)


def pc_fft(m, opt, i):
    h = torch.fft.rfft(m.fc(c_X[i % 3]).transpose(1, 2), dim=-1).abs().mean(-1)
    loss = F.cross_entropy(h, c_Y[i % 3])
    return update(opt, loss)


def pc_linalg(m, opt, i):
    h = m.fc.weight @ m.fc.weight.T + torch.eye(3)
    inv = torch.linalg.inv(h)
    ld = torch.linalg.slogdet(h)[1]
    loss = F.cross_entropy(m.fc(c_X[i % 3].mean(1)) @ inv, c_Y[i % 3]) + 0.01 * ld
    return update(opt, loss)


def pc_complex(m, opt, i):
    z = torch.complex(m.fc(c_X[i % 3].mean(1)), torch.ones(4, 3))
    loss = (z * z.conj()).real.mean()
    return update(opt, loss)


def pc_half_cast(m, opt, i):
    h = m.fc(c_X[i % 3].mean(1)).to(torch.bfloat16).float()
    loss = F.cross_entropy(h, c_Y[i % 3])
    return update(opt, loss)


FAMILIES = {"pa": a_make, "pb": b_make, "pc": c_make}


def patterns() -> dict:
    return {k: v for k, v in globals().items() if k[:3] in ("pa_", "pb_", "pc_") and callable(v)}


def run(prog, make, steps: int, use: bool):
    for d in prog.__defaults__ or ():  # a pattern's state across steps (a scheduler, an EMA)
        if isinstance(d, dict):
            d.clear()
    m, opt = make()
    torch.manual_seed(123)
    key = ("plain-patterns", prog.__name__)
    tape = coexec.GradientTape(backend="interpret", key=key) if use else None
    vals = []
    for i in range(steps):
        if tape is None:
            vals.append(prog(m, opt, i))
        else:
            with tape:
                vals.append(prog(m, opt, i))
    state = [p.detach().clone() for p in m.parameters()] + [b.clone() for b in m.buffers()]
    return vals, state, tape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    only = set(filter(None, args.only.split(",")))
    bad = 0
    for name, prog in patterns().items():
        if only and name not in only:
            continue
        make = FAMILIES[name[:2]]
        try:
            ev, es, _ = run(prog, make, args.steps, False)
            cv, cs, tape = run(prog, make, args.steps, True)
        except Exception as e:  # noqa: BLE001 (reported, not raised: the next pattern runs)
            bad += 1
            print(f"{name}: ERROR {type(e).__name__}: {str(e)[:200]}")
            traceback.print_exc(limit=-3)
            continue
        same = ev == cv and all(torch.equal(a, b) for a, b in zip(es, cs))
        bad += not same
        s = tape.stats
        print(
            f"{name}: {'bit-equal' if same else 'DIFFERS'}; {s.coexec_steps} co-executed, {s.fallbacks} fallbacks, {s.traces} traces"
        )
    print(f"{bad} pattern(s) not bit-equal or failing")


if __name__ == "__main__":
    main()
