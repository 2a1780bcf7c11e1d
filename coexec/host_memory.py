"""The host allocator's policy for training loops: freed memory stays with the process.

glibc's ``malloc`` (which serves every CPU tensor's storage) returns freed memory to the OS by
its own dynamic rules: a block above the mmap threshold is unmapped when freed, and the top of
the main heap is trimmed once more than the trim threshold lies free there; both thresholds
move with the sizes freed so far. A training step frees and reallocates the same sizes every
step, so memory handed back at the end of one step is faulted in again, page by page, during
the next: thousands of minor page faults per step whose number depends on how the heap happens
to be laid out. Captured steps change that layout (the skeleton's small allocations, the
worker's own arena), and eager steps after them faulted twice as many pages as before (issue
52). Like PyTorch's CUDA caching allocator on a GPU, coexec keeps freed host memory for the
next step: fixed thresholds, blocks up to 32 MiB (glibc's largest mmap threshold) from the
heap, the heap's top trimmed only past 2 GiB. ``malloc_trim(0)`` from libc gives it back.

A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # (glibc's <malloc.h>)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # (glibc's DEFAULT_MMAP_THRESHOLD_MAX on a 64-bit machine: its largest)
TRIM_THRESHOLD = 2**31 - 1  # (mallopt takes an int)
# the same thresholds as glibc reads them from the environment at a process's start (bench/: an
# eager process given a tape's policy without importing coexec)
ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}

_kept: bool | None = None  # (None: not tried yet; then whether glibc took both settings)


def keep_freed_host_memory() -> bool:
    """Set glibc's thresholds once per process (idempotent); whether they are set."""
    global _kept
    if _kept is None:
        _kept = _set_thresholds()
    return _kept


def _set_thresholds() -> bool:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # (None, or ValueError, off glibc)
            return False
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (ValueError, OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
