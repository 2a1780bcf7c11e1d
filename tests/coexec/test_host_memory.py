"""A tape keeps freed host memory for the next step: what a step frees is not handed back to the
OS, to be faulted in again page by page in the next (coexec/host_memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (twelve 8 MiB tensors written, then freed: how much of the process's resident memory goes back
# to the OS at the free. glibc's default unmaps blocks above its mmap threshold at once, and trims
# the heap's top past a threshold of at most 64 MiB; with a tape's thresholds the 96 MiB stay)
PROBE = """
import os, sys, torch
if sys.argv[1] == "tape":
    import coexec
    coexec.GradientTape()
def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
xs = [torch.empty(2 << 20).fill_(1.0) for _ in range(12)]
held = resident()
del xs
print(held - resident())
"""


def returned_at_free(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES"):
        env.pop(k, None)
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not (hasattr(os, "confstr") and os.confstr("CS_GNU_LIBC_VERSION")), reason="glibc's policy")
def test_a_tape_keeps_freed_host_memory_for_the_next_step():
    mib = 1 << 20
    # (the probe can fail: without a tape, glibc hands back at least 32 of the 96 MiB)
    assert returned_at_free("eager") > 24 * mib
    assert returned_at_free("tape") < 4 * mib
