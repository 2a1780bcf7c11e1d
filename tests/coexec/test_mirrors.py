"""Mirrors (coexec/mirrors.py): fetches of tiny CPU tensors the skeleton computed too are
answered without waiting, with eager's values; a tensor some op the skeleton does not mirror
wrote, or a view of one, is waited for as before."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import coexec
from tests.coexec.helpers import assert_same_as_eager, train_step


def make_adamw():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(3)]
    return {"model": model, "opt": opt, "data": data}


def test_adamw_reads_its_step_counters_without_waiting_bit_equal_to_eager():
    """AdamW on a CPU reads ``state["step"]`` with ``.item()`` after adding 1, per parameter:
    the skeleton adds 1 to its copy and answers each of those fetches itself."""
    tape = assert_same_as_eager(make_adamw, train_step, 10)
    assert tape.stats.phase == "coexec" and tape.stats.fallbacks == 0
    assert tape.stats.last_phase == "coexec"
    assert tape.stats.mirrored_fetches == 4  # one per parameter


def make_counted():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(5, 4) for _ in range(2)]
    return {"model": model, "opt": opt, "data": data, "count": torch.zeros(()), "seen": torch.zeros(2)}


def counted_step(state: dict, i: int) -> torch.Tensor:
    """A chain of in-place ops on a tiny counter, a branch on its value, a counter written
    with a value the skeleton does not know, and a view of a tiny tensor read after its base
    was written."""
    model, opt, count, seen = state["model"], state["opt"], state["count"], state["seen"]
    x = state["data"][i % 2]
    opt.zero_grad()
    with torch.no_grad():
        count.add_(1).mul_(2)  # mirrored: both ops on the skeleton's copy
    scale = 0.5 if count.item() > 10 else 1.0  # answered by the skeleton
    loss = model(x).square().mean() * scale
    loss.backward()
    opt.step()
    with torch.no_grad():
        seen.add_(loss.detach())  # a value of the step: the skeleton does not know it
        seen[0].add_(1)  # a view of seen, written: seen is not known either way
    first = float(seen[1])  # waits for the executor
    return loss + first


def test_known_values_are_answered_and_unknown_ones_waited_for_bit_equal_to_eager():
    tape = assert_same_as_eager(make_counted, counted_step, 8)
    assert tape.stats.phase == "coexec" and tape.stats.fallbacks == 0
    assert tape.stats.last_phase == "coexec"
    assert tape.stats.mirrored_fetches == 1  # count.item() only


def make_shared():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buf = torch.zeros(4)
    return {"model": model, "opt": opt, "buf": buf, "head": buf[:2], "x": torch.randn(6, 3)}


def shared_step(state: dict, i: int) -> torch.Tensor:
    """``head`` is a view of ``buf`` made outside the step: after ``buf`` is written, ``head``
    is read from the executor's result, not from a copy taken before."""
    model, opt, buf, head = state["model"], state["opt"], state["buf"], state["head"]
    opt.zero_grad()
    with torch.no_grad():
        buf.add_(1)
    loss = F.mse_loss(model(state["x"]), torch.zeros(6, 1)) * head.sum().item()
    loss.backward()
    opt.step()
    return loss


def test_a_view_of_a_written_tensor_is_not_answered_from_a_copy():
    tape = assert_same_as_eager(make_shared, shared_step, 6)
    assert tape.stats.phase == "coexec" and tape.stats.fallbacks == 0
    assert tape.stats.last_phase == "coexec"
    assert tape.stats.mirrored_fetches == 0


def make_averaged():
    state = make_counted()
    state["ema"], state["target"] = torch.zeros(4), torch.randn(4)
    return state


def averaged_step(state: dict, i: int) -> torch.Tensor:
    """:func:`counted_step` and a tiny running average of tiny tensors nobody reads."""
    with torch.no_grad():
        state["ema"].mul_(0.9).add_(state["target"], alpha=0.1)
    return counted_step(state, i)


def test_only_ops_whose_values_python_reads_are_mirrored(monkeypatch):
    """The running average's ops could be mirrored (tiny CPU tensors the skeleton knows), but
    Python never reads them: only the counter's two ops, which ``count.item()`` reads, run on
    the skeleton's copies (a copy of each input and a second kernel call per op, for nothing,
    made 200 tiny in-place updates twice as slow: bench/skeleton_floor.py)."""
    import coexec.mirrors

    runs: list = []
    real = coexec.mirrors.Mirrors.mirror

    def counted(self, rec, *args, **kwargs):
        runs.append(str(rec.key.func))
        return real(self, rec, *args, **kwargs)

    monkeypatch.setattr(coexec.mirrors.Mirrors, "mirror", counted)
    tape = assert_same_as_eager(make_averaged, averaged_step, 6)
    assert tape.stats.last_phase == "coexec" and tape.stats.mirrored_fetches == 1
    assert runs[-2:] == ["aten.add_.Tensor", "aten.mul_.Tensor"] and len(runs) == 2 * tape.stats.coexec_steps
