"""Which placeholders of a step died: the session frees their values (coexec/skeleton.py).

A value may be freed when its placeholder's C++ tensor is gone, not its Python object (see
``Session``), so each placeholder is held by a weak reference to its C++ tensor and the session
asks every few ops which died. :func:`tracker` gives the native module's ``Tracker``, which
scans in C++, and this module's :class:`PyTracker`, the same in Python, where the module is not
built.
"""

from __future__ import annotations

import torch

from executor import native


class PyTracker:
    """Tensors by slot, each with the value it holds; which died since the last sweep."""

    def __init__(self) -> None:
        self._refs: list = []
        self._vids: list[int] = []
        self._live: list[int] = []  # slots whose tensors were alive at the last sweep

    def add(self, t: torch.Tensor, vid: int) -> int:
        """Track ``t`` as holding value ``vid``; its slot."""
        self._refs.append(torch._C._WeakTensorRef(t))
        self._vids.append(vid)
        self._live.append(len(self._refs) - 1)
        return len(self._refs) - 1

    def retarget(self, slot: int, vid: int) -> None:
        """The tensor in ``slot`` holds value ``vid`` now."""
        self._vids[slot] = vid

    def expired(self, slot: int) -> bool:
        return self._refs[slot].expired()

    def sweep(self, aliased: bool) -> list[int]:
        """The values of the tensors gone since the last sweep, each once; with ``aliased``,
        not those a tensor still alive holds too."""
        refs, vids = self._refs, self._vids
        gone = [s for s in self._live if refs[s].expired()]
        if not gone:
            return []
        gone_set = set(gone)
        self._live = [s for s in self._live if s not in gone_set]
        dead = {vids[s] for s in gone}
        if aliased:
            dead -= {vids[s] for s in self._live}
        return sorted(dead)


def tracker() -> PyTracker:
    """A tracker for one step: the native one where the native module is built."""
    built = native.ready()
    return built.Tracker() if built is not None else PyTracker()
