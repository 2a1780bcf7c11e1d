"""A tape keeps freed host memory for the next step: no page faults for memory a step reuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (twelve 8 MiB tensors written and freed, 12 times, the faults counted on the thread that writes
# them: glibc's default policy trims the heap's top at the last free, past its dynamic threshold,
# and faults those pages in again in the next round)
PROBE = """
import resource, sys, torch
if sys.argv[1] == "tape":
    import coexec
    coexec.GradientTape()
def rounds():
    xs = [torch.empty(2 << 20).fill_(1.0) for _ in range(12)]
    del xs
rounds(); rounds()
f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
for _ in range(10):
    rounds()
print((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0) // 10)
"""


def faults_per_round(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES"):
        env.pop(k, None)
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not (hasattr(os, "confstr") and os.confstr("CS_GNU_LIBC_VERSION")), reason="glibc's policy")
def test_a_tape_keeps_freed_host_memory_for_the_next_step():
    pages = (12 * (8 << 20)) // 4096
    # (the probe can fail: without a tape, glibc's default faults pages in every round)
    assert faults_per_round("eager") > pages // 20
    assert faults_per_round("tape") < pages // 200
