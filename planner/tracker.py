"""Eager PyTorch's resident memory for a step, measured on the same terms as a plan.

:class:`LiveStorageTracker` watches every ATen op (a ``TorchDispatchMode``) and keeps the set of
storages alive: a storage counts from the first time a tensor on it is seen (an op's output, or
an input that existed before: parameters, batches, optimizer state) until the last tensor on it
dies. Its ``peak`` is the largest sum of those storages' bytes, checked after every op: the
resident peak of eager execution, persistent state included (DESIGN.md §6).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tracegraph.recorder import storage_nbytes


class LiveStorageTracker(TorchDispatchMode):
    """``resident``: tensors alive before the step (parameters, optimizer state, the batch)
    that count from the start, even if the step first touches them at its end."""

    def __init__(self, resident: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak = 0
        self._storages: dict[int, list] = {}  # storage address -> [live tensor count, bytes]
        self._seen: dict[int, weakref.ref] = {}  # id(tensor) -> weak reference
        for t in resident:
            self._watch(t)
        self.peak = self.live_bytes

    def _watch(self, t: torch.Tensor) -> None:
        ref = self._seen.get(id(t))
        if ref is not None and ref() is t:
            return
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [0, storage_nbytes(t)]
            self.live_bytes += entry[1]
        entry[0] += 1
        tid = id(t)

        def died(_ref: Any, key: int = key, tid: int = tid) -> None:
            if self._seen.get(tid) is _ref:
                del self._seen[tid]
            e = self._storages.get(key)
            if e is not None:
                e[0] -= 1
                if e[0] == 0:
                    self.live_bytes -= e[1]
                    del self._storages[key]

        self._seen[tid] = weakref.ref(t, died)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                self._watch(x)
        out = func(*args, **kwargs)
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self._watch(x)
        self.peak = max(self.peak, self.live_bytes)
        return out


class _ExternalInputs(TorchDispatchMode):
    """Collects the tensors a step reads that it did not make."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, weakref.ref] = {}
        self.external: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                r = self.made.get(id(x))
                if r is None or r() is not x:
                    self.external.setdefault(id(x), x)
        out = func(*args, **kwargs)
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and id(x) not in self.external:
                self.made[id(x)] = weakref.ref(x)
        return out


def eager_peak(step: Any) -> int:
    """Resident peak of an eager run of ``step()``, in bytes, persistent state included.

    Runs the step twice: once to find the tensors it reads from outside (so they count from
    the start of the measured run), then measured."""
    with _ExternalInputs() as found:
        step()
    resident = list(found.external.values())
    del found
    with LiveStorageTracker(resident) as tracker:
        step()
    return tracker.peak
