"""Tracebacks that point at the user's line that issued a failing op.

The executor runs an op some time after the skeleton issued it, so when it fails Python is
elsewhere. We rebuild the issuing stack from the op's recorded location and append it to the
traceback as real frames (each made by compiling a ``raise`` at the right file and line, the
technique Jinja2 uses for template tracebacks), so the innermost frame is the line that issued
the op and ``traceback`` prints its source.
"""

from __future__ import annotations

import types
from typing import Any

from tracegraph.location import BWD, CODES


def _frame_tb(filename: str, lineno: int, name: str) -> types.TracebackType:
    code = compile("\n" * (lineno - 1) + "raise __exc__", filename, "exec")
    code = code.replace(co_name=name)
    try:  # a fresh exception each time: re-raising one object would chain its tracebacks
        exec(code, {"__exc__": RuntimeError(), "__name__": "__coexec_issue__"})
    except RuntimeError as e:
        tb = e.__traceback__
    assert tb is not None and tb.tb_next is not None
    return tb.tb_next  # the frame of the compiled code, not this function's


def issuing_frames(loc: Any) -> list[tuple[str, int, str]]:
    """``(filename, line, function)`` of the Python frames that issued the op at ``loc``.

    For a gradient op that is the ``backward()`` call site: the frames before the backward
    marker."""
    out = []
    for cid, off in loc:
        if cid == BWD:
            break
        code = CODES.code(cid) if cid > 0 else None
        if code is not None:
            out.append((code.co_filename, CODES.line(cid, off) or code.co_firstlineno, code.co_name))
    return out


def attach_issue_traceback(exc: BaseException, loc: Any) -> BaseException:
    """Append the issuing stack of ``loc`` to ``exc``'s traceback (innermost last)."""
    frames = issuing_frames(loc) if loc is not None else []
    if not frames:
        return exc
    head = tail = None
    for filename, line, name in frames:
        tb = _frame_tb(filename, line, name)
        if head is None:
            head = tail = tb
        else:
            tail.tb_next = tb
            tail = tb
    exc.__traceback__ = head
    return exc
