"""Probe: why does the zoo's LSTM fail under coexec on CUDA (``aten.set_.source_Storage``)?

    python bench/cuda_lstm_probe.py          (on a machine with a GPU)

Five steps under coexec with cuDNN on (the error's traceback) and off, then the ATen ops of one
eager forward on CUDA as a dispatch mode sees them: ``empty`` and ``set_`` before
``_cudnn_rnn`` (cuDNN's flat weight buffer) are what the skeleton refuses.
"""

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import coexec
from examples.models import ZOO

DEV = torch.device("cuda")


def coexec_steps(cudnn: bool, steps: int = 5) -> None:
    """``steps`` co-executed steps with cuDNN on or off; the traceback of an error."""
    torch.backends.cudnn.enabled = cudnn
    z = ZOO["lstm-lm"](4)
    z.model.to(DEV)
    x, y = (t.to(DEV) for t in z.inputs)
    tape = coexec.GradientTape(key=("lstm-probe", cudnn))
    print(f"== cudnn {cudnn}")
    for i in range(steps):
        try:
            with tape:
                z.loss(z.model(x), y).backward()
                z.optimizer.step()
                z.optimizer.zero_grad()
            print(i, tape.stats.last_phase, tape.stats.fallbacks)
        except coexec.CoexecError as e:
            print(i, "CoexecError", str(e)[:200])
            traceback.print_exc(limit=-12)
            break
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
    coexec_steps(True)
    coexec_steps(False)
    print("eager forward ops on cuda (cudnn):", eager_forward_ops()[:40])
