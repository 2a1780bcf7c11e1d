#!/usr/bin/env bash
# The GPU measurement, in one call on a lent GPU machine (run from the repository root there):
#
#     bash bench/device_check.sh [BATCHES] [PAIRS]      (defaults: "16" and 10)
#
# It uses the machine's own torch (nothing can be fetched there; wheels in .whl/, such as
# OR-Tools for the planner, are installed to /tmp/site), builds the native engine, checks that a
# small co-executed CUDA step is bit-equal to eager, runs bench/cuda_gradient_blocks.py
# (gradient blocks replayed on CUDA against eager, also under CUDA_LAUNCH_BLOCKING=1 and on the
# Python executor), bench/sized_steps.py (sizes drawn per step; its budget run needs OR-Tools,
# protobuf and immutabledict in .whl/), then bench/zoo_steps.py on cuda for each batch size,
# with deterministic cuDNN/cuBLAS kernels (else eager itself is not bit-equal run to run). Logs
# and tables go to $OUT (or bench/out).
set -uo pipefail
BATCHES=${1:-16}
PAIRS=${2:-10}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/coexec_ext}
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi -L
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
t0=$(date +%s)
$PY -c "from executor import native; m = native.wait(900); print('native module:', m)" 2>&1 | tail -3
echo "native build: $(( $(date +%s) - t0 )) s"
$PY - <<'EOF' 2>&1 | tail -20
import torch, coexec
import torch.nn.functional as F
from torch import nn
torch.manual_seed(0)
dev = torch.device("cuda")
def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(dev)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)
x, y = torch.randn(32, 64, device=dev), torch.randn(32, 1, device=dev)
(me, oe), (mc, oc) = make(), make()
tape = coexec.GradientTape(backend="interpret")
for i in range(8):
    le = F.mse_loss(me(x), y); le.backward(); oe.step(); oe.zero_grad()
    with tape:
        lc = F.mse_loss(mc(x), y); lc.backward(); oc.step(); oc.zero_grad()
    print(i, tape.stats.last_phase, le.item(), lc.item(), torch.equal(le, lc))
same = all(torch.equal(a, b) for a, b in zip(me.state_dict().values(), mc.state_dict().values()))
print("smoke: bit-equal parameters", same, "coexec steps", tape.stats.coexec_steps, "native ops", tape.stats.native_ops)
EOF
for v in "" "CUDA_LAUNCH_BLOCKING=1" "COEXEC_NATIVE=0"; do
  echo "== gradient blocks on cuda, mlp ${v:-(as is)}"
  env $v $PY bench/cuda_gradient_blocks.py --device cuda --steps 6 2>&1 | tail -8
done
echo "== gradient blocks on cuda, mlp with a node hook (no block; the hook runs every step)"
$PY bench/cuda_gradient_blocks.py --device cuda --steps 6 --node-hook 2>&1 | tail -3
echo "== gradient blocks on cuda, gpt2-6l"
$PY bench/cuda_gradient_blocks.py --device cuda --steps 5 --model gpt2-6l 2>&1 | tail -7
echo "== sizes drawn per step on cuda (interpret backend: sized graph nodes, issue 17)"
$PY bench/sized_steps.py --device cuda --steps 40 2>&1 | grep -v "Warning\|^  " | tee "$OUT/sized_steps_cuda.log"
echo "probes done: $(( $(date +%s) - t0 )) s"
for b in $BATCHES; do
  $PY bench/zoo_steps.py --device cuda --batch "$b" --pairs "$PAIRS" --deterministic --out "$OUT" > "$OUT/zoo_cuda_b$b.log" 2>&1
  grep -v "^  \|^Traceback\|^\s*\^" "$OUT/zoo_cuda_b$b.log" | tail -25
done
