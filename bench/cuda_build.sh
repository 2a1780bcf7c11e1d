#!/usr/bin/env bash
# Does the native module compile against a CUDA build of torch, with the CUDA toolkit, and does a
# captured step stay bit-equal on that torch? For machines without a GPU (nvcc is enough); not
# part of CI, which pins the CPU build (constraints.txt).
#
#     bash bench/cuda_build.sh [VENV]      (default VENV: /tmp/coexec-cuda-venv)
#
# It makes VENV if missing and installs torch==2.14.1 there (on this project's machines pip takes
# a CUDA build of it from the local disk, about 5 GB), then this checkout, editable. It builds
# executor/native.py's sources the way native.py does, but with `with_cuda=True` (the CUDA
# include paths and libraries; the linker keeps only those the module uses, none yet) and with
# ATen/cuda/CUDAContext.h included first in every source, so the module's headers are known to
# compile beside CUDA's, and loads it. Then, in a process of its own, eight captured CPU steps
# (the runtime's own module, as native.py builds it) against eager, bit for bit. The module the
# runtime builds for itself stays the plain one (native.py) until code of the module needs CUDA.
# The whole CPU suite on that torch: TORCH_EXTENSIONS_DIR=/tmp/coexec-cuda-ext VENV/bin/python -m pytest
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/coexec-cuda-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.14.1
fi
"$PY" -m pip install -q -c <(echo torch==2.14.1) -e ".[test]" ninja
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/coexec-cuda-ext}
export PYTHONPATH=$PWD
# (no GPU to ask for its architecture: the lent machines' H100/H200 one; the toolkit's own folder)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
t0=$(date +%s)
"$PY" - <<'EOF'
import sys, time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from executor import native, structured_meta

print("torch", torch.__version__, "cuda", torch.version.cuda, "CUDA_HOME", cpp_extension.CUDA_HOME, flush=True)
if not torch.version.cuda or cpp_extension.CUDA_HOME is None:
    sys.exit("cuda_build: needs a CUDA build of torch and the CUDA toolkit (nvcc)")
name = native._NAME + "_cuda"
where = Path(cpp_extension._get_build_directory(name, False))
where.mkdir(parents=True, exist_ok=True)
structured_meta.write(where / structured_meta.HEADER)
t = time.time()
module = cpp_extension.load(
    name=name,
    sources=[str(s) for s in native._SOURCES],
    extra_cflags=native._FLAGS + ["-include", "ATen/cuda/CUDAContext.h"],
    # (the CUDA libraries' headers that ATen's CUDA headers include, cuSPARSE's and cuBLAS's,
    # come with torch's pip packages where the toolkit lacks them)
    extra_include_paths=[str(where)] + sorted(str(p) for p in Path(torch.__file__).parent.parent.glob("nvidia/*/include")),
    with_cuda=True,
)
print(f"cuda_build: built {name} with the CUDA toolkit in {time.time() - t:.0f} s", flush=True)
print("cuda_build: loaded", module.__file__)
EOF
# the captured step on this torch, against eager, with the runtime's own module (built as
# native.py builds it; a process of its own: the two modules register the same pybind11 types)
"$PY" - <<'EOF'
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from executor import native

assert native.wait() is not None, "the runtime's native module did not build"


def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)


x, y = torch.randn(32, 64), torch.randn(32, 1)
(me, oe), (mc, oc) = make(), make()
tape = coexec.GradientTape()
for i in range(8):
    le = F.mse_loss(me(x), y)
    le.backward()
    oe.step()
    oe.zero_grad()
    with tape:
        lc = F.mse_loss(mc(x), y)
        lc.backward()
        oc.step()
        oc.zero_grad()
    assert torch.equal(le, lc), (i, le.item(), lc.item())
same = all(torch.equal(a, b) for a, b in zip(me.state_dict().values(), mc.state_dict().values()))
assert same, "parameters differ from eager's"
print(f"cuda_build: 8 captured steps bit-equal to eager (losses and parameters), backend {tape.stats.last_phase}, "
      f"native ops in the last step {tape.stats.native_ops}")
EOF
echo "cuda_build: $(( $(date +%s) - t0 )) s"
