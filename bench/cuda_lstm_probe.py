"""Probe: why does the zoo's LSTM fail under coexec on CUDA (``aten.set_.source_Storage``)?

    python bench/cuda_lstm_probe.py          (on a machine with a GPU)

Six steps under coexec with cuDNN on and off, beside eager (bit-equal or not; an error's traceback), then the ATen ops of one
eager forward on CUDA as a dispatch mode sees them: ``empty`` and ``set_`` before
``_cudnn_rnn`` (cuDNN's flat weight buffer) are what the skeleton refuses.
"""

import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import coexec
from examples.models import ZOO

DEV = torch.device("cuda")


def coexec_steps(cudnn: bool, steps: int = 6) -> None:
    """``steps`` co-executed steps with cuDNN on or off beside an eager copy: per step the
    phase, fallbacks and whether loss and parameters are bit-equal; an error's traceback."""
    torch.backends.cudnn.enabled = cudnn
    ze, zc = ZOO["lstm-lm"](4), ZOO["lstm-lm"](4)
    for z in (ze, zc):
        z.model.to(DEV)
    x, y = (t.to(DEV) for t in zc.inputs)
    tape = coexec.GradientTape(backend="interpret", key=("lstm-probe", cudnn))

    def step(z):
        loss = z.loss(z.model(x), y)
        loss.backward()
        z.optimizer.step()
        z.optimizer.zero_grad()
        return loss.detach()

    print(f"== cudnn {cudnn}")
    for i in range(steps):
        le = step(ze)
        try:
            with tape:
                lc = step(zc)
        except coexec.CoexecError as e:
            print(i, "CoexecError", str(e)[:200])
            traceback.print_exc(limit=-12)
            break
        same = torch.equal(le, lc) and all(
            torch.equal(a, b) for a, b in zip(ze.model.parameters(), zc.model.parameters())
        )
        print(i, tape.stats.last_phase, "fallbacks", tape.stats.fallbacks, "bit-equal", same)
    print("fallback reasons:", tape.stats.fallback_reasons[-2:])


class Log(TorchDispatchMode):
    """The ATen ops that reach a dispatch mode (as the skeleton's sees them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def eager_forward_ops() -> list[str]:
    torch.backends.cudnn.enabled = True
    z = ZOO["lstm-lm"](4)
    z.model.to(DEV)
    with Log() as log:
        z.model(z.inputs[0].to(DEV))
    return log.ops


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    coexec_steps(True)
    coexec_steps(False)
    print("eager forward ops on cuda (cudnn):", eager_forward_ops()[:40])
