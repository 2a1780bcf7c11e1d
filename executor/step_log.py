"""A traced step's log: what the native capture saw each op of a step do
(``Capture.trace_next``, ``native/capture_trace.h``), the boundary between the capture and the
TraceGraph (``tracegraph/from_capture.py`` makes it a ``tracegraph.Trace``). Plain data."""

from __future__ import annotations

from types import CodeType
from typing import Any, NamedTuple

import torch

Frames = tuple[tuple[CodeType, int], ...]  # (code, byte offset), innermost first, to the step's ``with`` frame


class CapturedTensor(NamedTuple):
    """A tensor as an op met it: its number in the step names its value (a placeholder's
    copies, autograd's saved one among them, are one tensor)."""

    id: int
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None  # None: not strided
    dtype: torch.dtype
    requires_grad: bool
    leaf: bool
    bits: int  # a lazy conjugate (1) or negation (2)
    storage: int  # what it shares memory with (equal for a real tensor and its in-place result)


class CapturedArg(NamedTuple):
    """An op's argument in schema order: ``kind`` "t" a tensor (``value``: its number, -1 for
    None), "l" a list of them (a tuple of numbers), "v" anything else (``value`` itself)."""

    kind: str
    value: Any


class CapturedOp(NamedTuple):
    name: str  # ``aten::mm.default``
    frames: Frames
    args: tuple[CapturedArg, ...]
    inputs: tuple[CapturedTensor, ...]  # its defined tensor arguments, flattened, before it ran
    outputs: tuple[CapturedTensor, ...]  # the tensors it returned, flattened, after
    out_struct: tuple[int, ...]  # per return: 1 a tensor, 0 an undefined one, -n a list of n, 2 a number
    python_result: bool  # it returned a number or a bool (read from tensor data)
    grad_mode: bool
    in_try: bool  # called inside a try that may catch its error (it ran at once)
    seq: int  # autograd's next sequence number as it came (nodes made before it are its)
    node: int  # in a backward: the sequence number of the node the engine ran it for (-1: none)
    leaf: int  # in a backward, for an AccumulateGrad: its variable's number (-1: none)


class CapturedFetch(NamedTuple):
    """Python read a tensor's data (``numpy``, ``tolist``, printing...)."""

    after: int  # ops logged before it
    id: int
    kind: str
    frames: Frames


class CapturedStep(NamedTuple):
    ops: tuple[CapturedOp, ...]
    fetches: tuple[CapturedFetch, ...]
    cut: str  # why its log stops before its end ("": it does not)


def step_of(raw: tuple) -> CapturedStep:
    """From the capture's tuples (``TraceLog::to_python``)."""
    ops, fetches, cut = raw
    return CapturedStep(
        tuple(
            CapturedOp(
                name, tuple(frames), tuple(CapturedArg(k, v) for k, v in args),
                tuple(CapturedTensor(*t) for t in inputs), tuple(CapturedTensor(*t) for t in outputs),
                tuple(out_struct), python_result, grad_mode, in_try, seq, node, leaf,
            )
            for name, frames, args, inputs, outputs, out_struct, python_result, grad_mode, in_try, seq, node, leaf
            in ops
        ),
        tuple(CapturedFetch(after, vid, kind, tuple(frames)) for after, vid, kind, frames in fetches),
        cut,
    )
