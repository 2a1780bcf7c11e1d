"""Offloading on the executor: storages parked in a host pool and brought back before use.

:class:`Offload` starts copying one storage (every value on it) into its planned slice of the
host pool, on the copy channel: a CUDA stream beside the compute stream, or a copy thread on a
CPU. :class:`Wait` waits until that copy has landed and releases the device memory (so the
device bytes follow the plan exactly; a slow copy costs time, never memory). :class:`Prefetch`
allocates the device memory again and starts the copy back; the first instruction that reads a
value of the storage waits for it. A parked value read before any prefetch is copied back on
the spot (``fetched_late`` counts these), so a value is never lost, whatever the step does.

Values on one storage come back on one new storage, with their offsets, sizes and strides, so
views still alias each other. The host pool is one buffer (pinned on CUDA), sized by the plan
before the step and reused from step to step.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class Offload:
    """Start copying the storage of these values (all of them) to ``[offset, offset+nbytes)``
    of the host pool (a storage larger than its slice stays on the device)."""

    vids: tuple
    offset: int
    nbytes: int


@dataclass(slots=True)
class Wait:
    """Wait for the copies out of these values' storage and release its device memory."""

    vids: tuple


@dataclass(slots=True)
class Prefetch:
    """Allocate device memory for these parked values and start copying them back."""

    vids: tuple


@dataclass(slots=True)
class HostPool:
    """Instruction: the host pool holds ``nbytes`` (reallocated only when the size changes)."""

    nbytes: int


class _Parcel:
    """One storage in transit or parked: its values' layouts and where its bytes are."""

    __slots__ = ("layouts", "host", "where", "device", "back", "done", "nbytes", "home")

    def __init__(self, layouts: dict, host: torch.Tensor, where: torch.device, home: int = -1) -> None:
        self.layouts = layouts  # vid -> (dtype, storage_offset, size, stride)
        self.host = host
        self.where = where  # the device it came from
        self.device: torch.Tensor | None = None  # uint8 view of its device storage, once back
        self.back: dict[int, torch.Tensor] = {}  # vid -> its value on the device storage
        self.done: Any = None  # Future (CPU) or CUDA event of the copy in flight
        self.nbytes = host.numel()
        self.home = home  # its offset in the arena, if it came from there (-1: the allocator)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``t``'s whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _Channel:
    """The copy channel: a CUDA stream, or one copy thread on a CPU."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        if dst.is_cuda or src.is_cuda:
            device = dst.device if dst.is_cuda else src.device
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # src is written, dst is free
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            return event
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="coexec-copy")
        return self._pool.submit(_copy_below_autograd, dst, src)

    @staticmethod
    def wait(done: Any, block: bool) -> None:
        """Until the copy ``done`` has landed: the thread waits (``block``, or always on a
        CPU); else only the compute stream does, for a CUDA event."""
        if isinstance(done, Future):
            done.result()
        elif done is not None:
            done.synchronize() if block else torch.cuda.current_stream().wait_event(done)


def _copy_below_autograd(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        dst.copy_(src)


class Offloads:
    """The parked storages of one worker."""

    def __init__(self, values: dict, memory: Any) -> None:
        self.values = values
        self.memory = memory  # the worker's LiveBytes
        self.channel = _Channel()
        self.pool: torch.Tensor | None = None
        self.parcels: dict[int, _Parcel] = {}  # vid -> its storage's parcel, off the device
        self.out: dict[int, _Parcel] = {}  # vid -> its storage's parcel, copy out in flight
        self.offloaded = 0  # storages copied out
        self.fetched_late = 0  # parked storages read before a prefetch
        self.wait_seconds = 0.0  # time the executor waited for copies

    def clear(self) -> None:
        """Forget every parked storage (copies in flight land first); the host pool and the
        copy channel stay for the next step."""
        for parcel in {id(p): p for p in (*self.out.values(), *self.parcels.values())}.values():
            self._wait(parcel.done)
        self.parcels.clear()
        self.out.clear()
        self.offloaded, self.fetched_late, self.wait_seconds = 0, 0, 0.0

    def __bool__(self) -> bool:
        return bool(self.parcels or self.out)

    def size_pool(self, nbytes: int, pin: bool) -> None:
        if self.pool is None or self.pool.numel() != nbytes:
            self.pool = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def offload(self, ins: Offload) -> None:
        ts = [(v, self.values[v]) for v in ins.vids if v in self.values and v not in self.out]
        if not ts or self.pool is None:
            return
        src = _bytes_of(ts[0][1])
        n = src.numel()
        if n > ins.nbytes or ins.offset + n > self.pool.numel():
            return  # a storage larger than planned (another path): it stays on the device
        layouts = {v: (t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride())) for v, t in ts}
        memory = self.memory
        home = memory.offset_of(src) if memory.in_arena(src) else -1
        parcel = _Parcel(layouts, self.pool[ins.offset : ins.offset + n], src.device, home)
        parcel.done = self.channel.copy(parcel.host, src)
        for v, _t in ts:
            self.out[v] = parcel
        self.offloaded += 1

    def wait_out(self, ins: Wait) -> None:
        """The copy out has landed: release the device copies of the values still alive."""
        for v in ins.vids:
            parcel = self.out.pop(v, None)
            if parcel is None:
                continue
            self._wait(parcel.done)
            t = self.values.pop(v, None)
            if t is None:
                parcel.layouts.pop(v, None)
                continue
            self.memory.remove(t)
            self.parcels[v] = parcel

    def before_write(self, vids: list[int]) -> None:
        """Values about to be written in place: a copy out of them would be stale, so it is
        abandoned (they stay on the device)."""
        for v in vids:
            parcel = self.out.get(v)
            if parcel is not None:
                self._wait(parcel.done)
                for u in parcel.layouts:
                    if self.out.get(u) is parcel:
                        del self.out[u]

    def prefetch(self, ins: Prefetch) -> None:
        for v in ins.vids:
            parcel = self.parcels.get(v)
            if parcel is not None and parcel.device is None:
                self._bring_back(parcel)

    def _bring_back(self, parcel: _Parcel) -> None:
        """Allocate the device storage (it counts from now) and start the copy back: into the
        arena bytes it left, if they are free."""
        memory = self.memory
        if parcel.home >= 0 and memory.free(parcel.home, parcel.nbytes):
            parcel.device = memory.region(parcel.home, parcel.nbytes)
        else:
            parcel.device = torch.empty(parcel.nbytes, dtype=torch.uint8, device=parcel.where)
        parcel.done = self.channel.copy(parcel.device, parcel.host)
        storage = parcel.device.untyped_storage()
        for v, (dtype, offset, size, stride) in parcel.layouts.items():
            t = torch.empty(0, dtype=dtype, device=parcel.where).set_(storage, offset, size, stride)
            self.memory.add(t)
            parcel.back[v] = t

    def get(self, vid: int) -> Any:
        """The value of ``vid`` back on the device (copied back now if it was not prefetched);
        KeyError if it is not parked."""
        parcel = self.parcels[vid]
        if parcel.device is None:
            self.fetched_late += 1
            self._bring_back(parcel)
        self._wait(parcel.done, block=False)
        for v, t in parcel.back.items():
            self.values[v] = t
            self.parcels.pop(v, None)
        return self.values[vid]

    def _wait(self, done: Any, block: bool = True) -> None:
        t0 = time.perf_counter()
        self.channel.wait(done, block)
        self.wait_seconds += time.perf_counter() - t0

    def forget(self, vid: int) -> None:
        """``vid`` is gone for good: also from its parcel's layouts, so bringing the parcel
        back (for the values still alive) does not make it again, holding the storage."""
        out = self.out.pop(vid, None)
        parcel = self.parcels.pop(vid, None) or out
        if parcel is not None:
            parcel.layouts.pop(vid, None)
            t = parcel.back.pop(vid, None)
            if t is not None:
                self.memory.remove(t)

    def clear_range(self, lo: int, hi: int) -> None:
        """A finished step: forget its parked values."""
        for v in [v for v in self.parcels if lo <= v < hi]:
            self.forget(v)
        for v in [v for v in self.out if lo <= v < hi]:
            self._wait(self.out.pop(v).done)

    def restore(self, vids: Any) -> None:
        for v in list(vids):
            if v in self.parcels:
                self.get(v)


_LOCK = threading.Lock()
_MEASURED: dict[str, Any] = {}


def measure_bandwidth(device: torch.device | str, nbytes: int = 32 << 20):
    """The copy channel's bandwidth each way on this machine (``planner.offload.Bandwidth``),
    measured once per device and process: the median of a few copies of ``nbytes``."""
    from planner.schedule import Bandwidth

    device = torch.device(device)
    key = str(device)
    with _LOCK:
        if key in _MEASURED:
            return _MEASURED[key]
        cuda = device.type == "cuda"
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        channel = _Channel()

        def timed(dst, src) -> float:
            runs = []
            for _ in range(5):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                channel.wait(channel.copy(dst, src), block=True)
                runs.append(time.perf_counter() - t0)
            return sorted(runs)[len(runs) // 2]

        def small(dst, src) -> float:
            return timed(dst[:64], src[:64])

        latency = min(small(host, dev), small(dev, host))
        out = Bandwidth(nbytes / timed(host, dev), nbytes / timed(dev, host), latency)
        _MEASURED[key] = out
        return out
