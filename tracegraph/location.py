"""Executed locations: where in the user's program an op ran.

Terra identifies an op by its call-id stack and loop-id stack. The Python analogue used here is
a *location*: the tuple of frames ``(code_id, offset)`` from the frame that opened the recording
down to the call that issued the op. Every iteration of a loop runs the same instructions, so
its iterations have equal locations; loops themselves are found statically in the bytecode
(:func:`loops_at`), and iteration boundaries from the order of offsets (see ``structure.py``).

Negative code ids are pseudo-frames the recorder appends: the index of an ATen op inside one
torch-level call, the start of the backward region, and so on.
"""

from __future__ import annotations

import dis
import os
import sys
import types
from bisect import bisect_right
from typing import Any

Frame = tuple[int, int]
Location = tuple[Frame, ...]

# Pseudo code ids (negative so they never collide with real code ids, which start at 1).
SUB = -1  # index of an ATen op within one torch-level call
BWD = -2  # the backward region starts; the forward location follows, with offsets negated
BSUB = -3  # index of an ATen op within one autograd node
ACC = -4  # gradient accumulation into a leaf tensor
UNKNOWN = -5  # an autograd node created outside the recording
# the gradient of a list taken from a loop's iterations (``torch.stack(log_probs)``): its ops,
# one run per element, are the iterations of this pseudo-loop (structure.py)
RUN = -6

PSEUDO_NAMES = {SUB: "op", BWD: "backward", BSUB: "grad-op", ACC: "accumulate", UNKNOWN: "?", RUN: "run"}

_SKIP = 0  # code id of frames that are plumbing (ours, torch's mode dispatch), left out

_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(_here)
_SKIP_PREFIXES = tuple(os.path.join(_root, pkg) + os.sep for pkg in ("tracegraph", "coexec", "executor"))
# the fuzzer's generated programs are user code, though they live in the coexec package
_USER_PREFIXES = (os.path.join(_root, "coexec", "fuzz") + os.sep,)


def _torch_plumbing_files() -> frozenset[str]:
    """torch's own mode-dispatch machinery: frames that say nothing about the user's program."""
    import torch

    base = os.path.dirname(os.path.abspath(torch.__file__))
    rel = (
        "overrides.py",
        "_ops.py",
        "_compile.py",
        os.path.join("utils", "_python_dispatch.py"),
        os.path.join("_dynamo", "eval_frame.py"),
    )
    return frozenset(os.path.join(base, r) for r in rel)


class CodeTable:
    """Process-wide registry of code objects seen in locations.

    Ids are small ints so locations hash fast; the table keeps each code object alive, so an id
    is never reused for another function within the process.
    """

    def __init__(self) -> None:
        self._by_addr: dict[int, int] = {}
        self._codes: list[types.CodeType | None] = [None]  # id 0 = skipped plumbing
        self._loops: dict[int, tuple[tuple[int, int], ...]] = {}
        self._loops_at: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
        self._lines: dict[int, tuple[list[int], list[int]]] = {}
        self._plumbing: frozenset[str] | None = None
        self._tries: dict[int, tuple[tuple[int, int], ...]] = {}
        self._catches: dict[tuple[Location, int], bool] = {}
        self._calls: dict[int, dict[int, int]] = {}  # code id -> PRECALL offset -> its CALL's

    def code_id(self, code: types.CodeType) -> int:
        cid = self._by_addr.get(id(code))
        if cid is None:
            cid = self._register(code)
        return cid

    def _register(self, code: types.CodeType) -> int:
        if self._plumbing is None:
            self._plumbing = _torch_plumbing_files()
        fname = os.path.abspath(code.co_filename)
        ours = fname.startswith(_SKIP_PREFIXES) and not fname.startswith(_USER_PREFIXES)
        if ours or fname in self._plumbing:
            cid = _SKIP
        else:
            cid = len(self._codes)
        self._codes.append(code)  # keep it alive so id(code) stays unique
        if cid != _SKIP:
            self._codes[cid] = code
            calls = _precalls(code)
            if calls:
                self._calls[cid] = calls
        self._by_addr[id(code)] = cid
        return cid

    def code(self, cid: int) -> types.CodeType | None:
        return self._codes[cid] if cid > 0 else None

    def capture(self, frame: types.FrameType | None, base: types.FrameType | None) -> Location:
        """The location of ``frame``: its stack up to and including ``base``, outermost first."""
        out: list[Frame] = []
        by_addr, calls = self._by_addr, self._calls
        f = frame
        while f is not None:
            code = f.f_code
            cid = by_addr.get(id(code))
            if cid is None:
                cid = self._register(code)
            if cid:
                off = f.f_lasti
                canon = calls.get(cid)
                if canon is not None:
                    off = canon.get(off, off)
                out.append((cid, off))
            if f is base:
                break
            f = f.f_back
        out.reverse()
        return tuple(out)

    def location_of(self, frames: Any) -> Location:
        """The location of a stack given as ``(code, offset)`` pairs, innermost first, ending
        at the recording's frame (a native step's log, ``from_capture.py``)."""
        out: list[Frame] = []
        calls = self._calls
        for code, off in reversed(frames):
            cid = self.code_id(code)
            if cid:
                canon = calls.get(cid)
                if canon is not None:
                    off = canon.get(off, off)
                out.append((cid, off))
        return tuple(out)

    # -- loops ----------------------------------------------------------------------------
    def loops(self, cid: int) -> tuple[tuple[int, int], ...]:
        """Static loops of a code object as ``(header, last)`` offset ranges.

        A loop is the target of a backward jump; its body spans the target up to the last jump
        back to it (``continue`` adds more jumps to the same header).
        """
        found = self._loops.get(cid)
        if found is None:
            ends: dict[int, int] = {}
            code = self.code(cid)
            if code is not None:
                jumps = set(dis.hasjrel) | set(dis.hasjabs)
                for ins in dis.get_instructions(code):
                    if ins.opcode in jumps and isinstance(ins.argval, int) and ins.argval <= ins.offset:
                        ends[ins.argval] = max(ends.get(ins.argval, -1), ins.offset)
            found = tuple(sorted(ends.items()))
            self._loops[cid] = found
        return found

    def loops_at(self, cid: int, offset: int) -> tuple[tuple[int, int], ...]:
        """Loops of code ``cid`` whose body contains ``offset``, outermost first."""
        key = (cid, offset)
        found = self._loops_at.get(key)
        if found is None:
            inside = [lp for lp in self.loops(cid) if lp[0] <= offset <= lp[1]]
            inside.sort(key=lambda lp: (lp[0], -lp[1]))
            found = tuple(inside)
            self._loops_at[key] = found
        return found

    # -- exception handlers -----------------------------------------------------------------
    def tries(self, cid: int) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` offset ranges of code ``cid`` guarded by an ``except`` clause
        (typed or bare): where an exception can be caught and the code go on. Not ``finally``
        (it re-raises) nor ``with`` (its handler calls ``__exit__``), nor torch's own code.
        Empty before Python 3.11 (no exception table to read)."""
        found = self._tries.get(cid)
        if found is None:
            code = self.code(cid)
            ok = code is not None and sys.version_info >= (3, 11) and self.is_user_code(cid)
            found = self._tries[cid] = _catching_ranges(code) if ok else ()
        return found

    def catches(self, loc: Location, base_offset: int) -> bool:
        """Is the op at ``loc`` inside a ``try`` whose ``except`` could catch its error, within
        the step? (A ``try`` in the step's own frame around the whole ``with``, at
        ``base_offset``, does not count: the error leaves the step either way.)"""
        key = (loc, base_offset)
        found = self._catches.get(key)
        if found is None:
            found = False
            for i, (cid, off) in enumerate(loc):
                if cid == BWD:
                    break  # the rest mirrors the forward op: not where the error is raised
                if cid > 0 and any(
                    s <= off < e and not (i == 0 and s <= base_offset < e) for s, e in self.tries(cid)
                ):
                    found = True
                    break
            self._catches[key] = found
        return found

    # -- display --------------------------------------------------------------------------
    def line(self, cid: int, offset: int) -> int | None:
        code = self.code(cid)
        if code is None:
            return None
        table = self._lines.get(cid)
        if table is None:
            starts, lines = [], []
            for start, _end, line in code.co_lines():
                starts.append(start)
                lines.append(line if line is not None else -1)
            table = self._lines[cid] = (starts, lines)
        i = bisect_right(table[0], abs(offset)) - 1
        if i < 0:
            return None
        line = table[1][i]
        return None if line < 0 else line

    def describe_frame(self, frame: Frame) -> str:
        cid, off = frame
        if cid < 0:
            return f"<{PSEUDO_NAMES.get(cid, cid)} {off}>"
        code = self.code(cid)
        if code is None:
            return "<?>"
        return f"{_short_path(code.co_filename)}:{self.line(cid, off)} ({code.co_name})"

    def is_user_code(self, cid: int) -> bool:
        """True for code outside the torch package (the frames a user recognises)."""
        code = self.code(cid)
        if code is None:
            return False
        return f"{os.sep}torch{os.sep}" not in code.co_filename

    def describe(self, loc: Location) -> str:
        """The innermost user frame of a location (or the innermost frame), as file:line."""
        real = [f for f in loc if f[0] > 0]
        user = [f for f in real if self.is_user_code(f[0])]
        pick = user[-1] if user else (real[-1] if real else None)
        desc = self.describe_frame(pick) if pick else "<no python frame>"
        if any(f[0] == BWD for f in loc):
            desc = "grad of " + desc
        return desc


def _precalls(code: types.CodeType) -> dict[int, int]:
    """Python 3.11 calls in two instructions, ``PRECALL`` then ``CALL``, and once the
    interpreter has specialised a call to a builtin type (``tuple(generator)``) the
    ``PRECALL`` makes the call itself: a frame called there stands at the ``PRECALL`` where
    before it stood at the ``CALL``, so the same line's location changed after a few steps (a
    new loop, a new trace). Each ``PRECALL``'s offset, mapped to its ``CALL``'s."""
    if sys.version_info[:2] != (3, 11):
        return {}
    out, pending = {}, None
    for ins in dis.get_instructions(code):
        if ins.opname == "PRECALL":
            pending = ins.offset
        elif ins.opname == "CALL" and pending is not None:
            out[pending] = ins.offset
            pending = None
    return out


def _catching_ranges(code: types.CodeType) -> tuple[tuple[int, int], ...]:
    """The exception-table ranges of ``code`` whose handler is an ``except`` clause: it starts
    with ``PUSH_EXC_INFO`` (cleanup handlers do not), is not a ``with`` (``WITH_EXCEPT_START``),
    and matches the exception or pops it (``POP_EXCEPT``) before any ``RERAISE`` (a
    ``finally`` re-raises)."""
    instrs = list(dis.get_instructions(code))
    at = {ins.offset: i for i, ins in enumerate(instrs)}
    out = []
    for entry in dis.Bytecode(code).exception_entries:
        i = at.get(entry.target)
        if i is None or instrs[i].opname != "PUSH_EXC_INFO":
            continue
        if i + 1 < len(instrs) and instrs[i + 1].opname == "WITH_EXCEPT_START":
            continue
        for ins in instrs[i + 1 :]:
            if ins.opname in ("CHECK_EXC_MATCH", "CHECK_EG_MATCH", "POP_EXCEPT"):
                out.append((entry.start, entry.end))
                break
            if ins.opname == "RERAISE":
                break
    return tuple(sorted(set(out)))


def _short_path(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 1 else path


CODES = CodeTable()
