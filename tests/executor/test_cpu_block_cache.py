"""The capture worker's cache of large CPU blocks (``native/cpu_block_cache.h``): a repeated
step's values reuse the blocks of the step before (no page faults), the cache never holds more
than the worker's blocks ever held at once, budgets count tensors' bytes and not the cache's,
and values stay bit-equal to eager."""

from __future__ import annotations

import pytest
import torch

from executor import native
from executor.capture import Capture

pytestmark = pytest.mark.skipif(not native.enabled(), reason="the cache is in the native module")


def chain(x: torch.Tensor, w: torch.Tensor, depth: int = 4) -> torch.Tensor:
    """``depth`` layers of ``tanh(h @ w)``: each value a block of ``x``'s bytes."""
    h = x
    for _ in range(depth):
        h = torch.tanh(h @ w)
    return h.sum()


def within_its_peak(stats: dict) -> bool:
    return stats["in_use"] + stats["cached"] <= stats["peak_in_use"]


def test_a_repeated_steps_values_come_from_the_cache_bit_equal() -> None:
    cpu = native.wait()
    capture = Capture()
    w, x = torch.randn(256, 256) / 16, torch.randn(512, 256)  # (values of 512 KiB)
    sums = []
    for _ in range(3):
        with capture.step():
            s = chain(x, w)
        sums.append(s.item())
    before = cpu.cpu_block_cache()
    for _ in range(3):
        with capture.step():
            s = chain(x, w)
        sums.append(s.item())
    after = cpu.cpu_block_cache()
    assert after["misses"] == before["misses"], (before, after)
    assert after["hits"] - before["hits"] >= 3 * 4 * 2  # (per step: each layer's mm and tanh)
    assert after["cached"] > 0 and within_its_peak(after), after
    assert sums == [chain(x, w).item()] * 6


def test_the_cache_frees_blocks_to_stay_within_the_peak_in_use() -> None:
    """Steps whose values change size miss, and each miss frees kept blocks first, so what the
    cache keeps never exceeds the most that was in use at once; emptied, it keeps nothing."""
    cpu = native.wait()
    capture = Capture()
    w = torch.randn(256, 256) / 16
    for rows in (256, 384, 512, 640, 768, 256):
        x = torch.randn(rows, 256)
        with capture.step():
            s = chain(x, w)
        assert s.item() == chain(x, w).item()
        stats = cpu.cpu_block_cache()
        assert stats["cached"] > 0 and within_its_peak(stats), (rows, stats)
    cpu.empty_cpu_block_cache()
    assert cpu.cpu_block_cache()["cached"] == 0


def test_the_counted_bytes_leave_out_what_the_cache_keeps() -> None:
    """A step's counted bytes (budgets, ``tape.stats.peak_bytes``) go back to where they were
    when its values are freed, though the cache keeps their blocks."""
    cpu = native.wait()
    capture = Capture()
    w, x = torch.randn(256, 256) / 16, torch.randn(512, 256)
    with capture.step():
        chain(x, w).item()
    live = cpu.cpu_bytes()[0]
    cpu.reset_cpu_peak()
    with capture.step():
        chain(x, w).item()
    live_after, peak = cpu.cpu_bytes()
    assert live_after == live
    assert peak - live >= 2 * 512 * 256 * 4  # (a layer's input and its output at once)
    assert cpu.cpu_block_cache()["cached"] >= 2 * 512 * 256 * 4


def test_a_forked_child_frees_the_workers_blocks() -> None:
    """A DataLoader worker forked from a training process may free tensors the capture worker
    allocated: the cache's lock is taken around ``fork()`` (``pthread_atfork``), so the child
    never inherits it held."""
    import os
    import time

    capture = Capture()
    w, x = torch.randn(256, 256) / 16, torch.randn(512, 256)
    for _ in range(2):
        with capture.step():
            h = torch.tanh(x @ w)
        h.sum().item()
    pid = os.fork()
    if pid == 0:  # (the child: free the worker's block, then exit at once)
        del h
        os._exit(0)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
