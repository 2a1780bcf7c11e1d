"""What the executor holds: live bytes of the distinct storages in its value table, and which
bytes of the arena are in use.

On a CPU there is no allocator to ask, and on CUDA the caching allocator's figures include
memory it keeps for reuse; the plan's unit is the storage, so the executor counts storages:
each distinct storage once, from the first value on it to the last one it forgets. ``peak`` is
the largest total seen since :meth:`reset_peak`.

With an arena attached, the arena counts whole (it is device memory the step holds from the
start), and a storage over arena bytes is not counted again: it only marks its bytes in use.
Arena storages are made by :meth:`region`, one per planned output, so a storage's address and
size are exactly the region it occupies, and a region is in use as long as any value on its
storage is: the same count that decides when an allocation is freed.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch


class ResetPeak:
    """Instruction: a step begins: start counting the peak from what is live now, with the
    step's ``arena`` attached (None: the step has none, and an earlier one no longer counts)."""

    __slots__ = ("arena",)

    def __init__(self, arena: torch.Tensor | None = None) -> None:
        self.arena = arena


_ALLOCATED = -1
_OLD_ARENA = -2


class LiveBytes:
    """The count in Python, the Python executor's (``executor/native/live_bytes.h`` has the same
    class in C++, the native engine's)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget everything: nothing live, no arena."""
        self.live = 0
        self.peak = 0
        # storage address -> [values on it, bytes, offset in the arena, or _ALLOCATED, or
        # _OLD_ARENA: in an arena no longer attached]
        self._storages: dict[int, list[int]] = {}
        self.arena: torch.Tensor | None = None
        self._base = 0
        self._size = 0
        self._buffer: memoryview | None = None
        self._starts: list[int] = []  # sorted arena offsets of live arena storages
        self._ends: dict[int, int] = {}  # offset -> end

    def attach(self, arena: torch.Tensor | None) -> None:
        """Use ``arena`` (a flat uint8 CPU tensor; None: none) from now on; it counts as live
        whole. Values still in an earlier arena stay uncounted and no longer mark regions."""
        if arena is self.arena:
            return
        for entry in self._storages.values():
            if entry[2] >= 0:
                entry[2] = _OLD_ARENA
        self.live -= self._size
        self.arena = arena
        self._starts, self._ends = [], {}
        if arena is None:
            self._base, self._size, self._buffer = 0, 0, None
            return
        self._base = arena.data_ptr()
        self._size = arena.numel()
        self._buffer = memoryview(arena.numpy())
        self.live += self._size
        self.peak = max(self.peak, self.live)

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor with a storage of its own over ``[offset, offset + nbytes)`` of the
        arena (fixed size: a kernel that wants to resize it fails instead of writing past it)."""
        return torch.frombuffer(self._buffer, dtype=torch.uint8, count=max(nbytes, 1), offset=offset)

    def free(self, offset: int, nbytes: int) -> bool:
        """Is no live storage over any of the arena's bytes ``[offset, offset + nbytes)``?"""
        if offset < 0 or offset + nbytes > self._size:
            return False
        i = bisect.bisect_left(self._starts, offset + nbytes)
        return i == 0 or self._ends[self._starts[i - 1]] <= offset

    def all_free(self, outs: tuple) -> bool:
        """Are the regions of an op's planned outputs (``Run.arena_out``'s last item:
        ``(offset, shape, stride, dtype, bytes spanned)`` each) all free?"""
        return all(self.free(out[0], out[4]) for out in outs)

    def in_arena(self, t: Any) -> bool:
        """Does ``t``'s memory lie in the attached arena?"""
        if self.arena is None or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return False
        p = _ptr(t)
        return self._base <= p < self._base + self._size

    def offset_of(self, t: torch.Tensor) -> int:
        """Where ``t``'s storage starts in the arena (``in_arena(t)`` must hold)."""
        return t.untyped_storage().data_ptr() - self._base

    def add(self, t: Any, inputs: Any = ()) -> None:
        """``t`` is now in the value table. A storage not yet counted that one of ``inputs``
        (the op's arguments) lies on is not the step's: an alias of a parameter, an input."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        s = t.untyped_storage()
        key = s.data_ptr()
        if not key:
            return
        entry = self._storages.get(key)
        if entry is not None:
            entry[0] += 1
            return
        for x in inputs:
            if isinstance(x, (list, tuple)):
                if any(isinstance(y, torch.Tensor) and _ptr(y) == key for y in x):
                    return
            elif isinstance(x, torch.Tensor) and _ptr(x) == key:
                return
        n = s.nbytes()
        offset = key - self._base
        if self.arena is not None and 0 <= offset < self._size:
            self._storages[key] = [1, n, offset]
            bisect.insort(self._starts, offset)
            self._ends[offset] = offset + max(n, 1)
            return
        self._storages[key] = [1, n, _ALLOCATED]
        self.live += n
        if self.live > self.peak:
            self.peak = self.live

    def remove(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        key = t.untyped_storage().data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[key]
            offset = entry[2]
            if offset == _ALLOCATED:
                self.live -= entry[1]
            elif offset >= 0:
                del self._ends[offset]
                self._starts.remove(offset)

    def holders(self, key: int) -> tuple[int, int]:
        """Of the storage at address ``key``: the values on it, and the bytes taking them all
        out of the table would free (0 for arena memory, or a storage not counted)."""
        entry = self._storages.get(key)
        if entry is None:
            return 0, 0
        return entry[0], entry[1] if entry[2] == _ALLOCATED else 0

    def reset_peak(self) -> None:
        self.peak = self.live


def span_bytes(shape: tuple, stride: tuple, dtype: torch.dtype) -> int:
    """Bytes from a tensor's first element to its last, as laid out by ``stride``."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * dtype.itemsize


def laid_out(raw: torch.Tensor, shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``raw`` (a flat uint8 tensor, such as a :meth:`LiveBytes.region`) as a
    ``dtype`` tensor of ``shape`` and ``stride``, on the same storage."""
    return raw.view(dtype)[: raw.numel() // dtype.itemsize].as_strided(shape, stride)


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1
