"""What the executor holds: live bytes of the distinct storages in its value table.

On a CPU there is no allocator to ask, and on CUDA the caching allocator's figures include
memory it keeps for reuse; the plan's unit is the storage, so the executor counts storages:
each distinct storage once, from the first value on it to the last one it forgets. ``peak`` is
the largest total seen since :meth:`reset_peak`.
"""

from __future__ import annotations

from typing import Any

import torch


class ResetPeak:
    """Instruction: start counting the peak from what is live now (a step begins)."""

    __slots__ = ()


class LiveBytes:
    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # storage address -> [values on it, bytes]

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
        self._storages[key] = [1, n]
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
            self.live -= entry[1]
            del self._storages[key]

    def reset_peak(self) -> None:
        self.peak = self.live


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1
