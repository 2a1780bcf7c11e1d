"""Why does the zoo's LSTM fail under coexec on CUDA (aten.set_.source_Storage)? One step under
coexec with the traceback of the error, its ATen ops as recorded, then the same with cuDNN off."""
import sys, traceback
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]) if len(sys.argv) < 2 else sys.argv[1])
import torch
import coexec
from examples.models import ZOO

dev = torch.device("cuda")
for cudnn in (True, False):
    torch.backends.cudnn.enabled = cudnn
    z = ZOO["lstm-lm"](4)
    z.model.to(dev)
    x, y = (t.to(dev) for t in z.inputs)
    tape = coexec.GradientTape(key=("lstm-probe", cudnn))
    def step():
        with tape:
            loss = z.loss(z.model(x), y); loss.backward(); z.optimizer.step(); z.optimizer.zero_grad()
            return loss.detach()
    print(f"== cudnn {cudnn}")
    for i in range(5):
        try:
            step()
            print(i, tape.stats.last_phase, tape.stats.fallbacks)
        except Exception as e:
            print(i, "ERROR", type(e).__name__, str(e)[:200])
            traceback.print_exc(limit=-12)
            break
    trace = getattr(getattr(tape, "_program", None), "graph", None)
    print("fallback reasons:", tape.stats.fallback_reasons[-2:])

from torch.utils._python_dispatch import TorchDispatchMode
class Log(TorchDispatchMode):
    def __init__(self): super().__init__(); self.ops = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func)); return func(*args, **(kwargs or {}))
torch.backends.cudnn.enabled = True
z = ZOO["lstm-lm"](4); z.model.to(dev); x, y = (t.to(dev) for t in z.inputs)
with Log() as log:
    out = z.model(x)
print("eager forward ops on cuda (cudnn):", log.ops[:40])
