"""Tracebacks that point at the user's line that issued a failing op.

The executor runs an op some time after the skeleton issued it, so when it fails Python is
elsewhere. We rebuild the issuing stack from the op's recorded location and make it the
traceback, as real frames (``executor.tracebacks``), so the innermost frame is the line that
issued the op and ``traceback`` prints its source.
"""

from __future__ import annotations

from typing import Any

from executor.tracebacks import traceback_through
from tracegraph.location import BWD, CODES


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
    """``exc`` with the issuing stack of ``loc`` as its traceback (innermost last): raised, its
    traceback goes on from the raising frame to those."""
    frames = issuing_frames(loc) if loc is not None else []
    if frames:
        exc.__traceback__ = traceback_through(frames)
    return exc
