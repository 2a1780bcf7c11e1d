"""Traceback entries at a given file and line: an op that failed after Python moved on (on the
executor, on the capture's worker) is reported with a traceback that goes on to the lines that
issued it, as if it had failed there (``coexec/tracebacks.py``, ``executor/capture.py``).

Each entry's frame is made by compiling a ``raise`` at that file and line and running it (the
technique Jinja2 uses for template tracebacks), so ``traceback`` prints the line's source. The
``raise`` is indented as the line is and spans its text, so Python underlines none of it."""

from __future__ import annotations

import linecache
from collections.abc import Iterable
from types import TracebackType


class _Marker(Exception):
    """Raised only to make a frame at a given place."""


def frame_at(file: str, line: int, name: str) -> TracebackType:
    """A traceback entry whose frame is at ``line`` of ``file``, in a function called ``name``."""
    text = linecache.getline(file, line)
    indent = len(text) - len(text.lstrip()) if line > 1 else 0
    error = "_" * max(1, len(text.strip()) - len("raise "))  # (the name the raise raises)
    source = f"{' ' * indent}raise {error}"
    lines = "\n" * (line - 1) + source if indent == 0 else "\n" * (line - 2) + "if 1:\n" + source
    code = compile(lines, file, "exec").replace(co_name=name)
    try:  # (a fresh exception each time: re-raising one object would chain its tracebacks)
        exec(code, {error: _Marker(), "__name__": "__coexec_issue__"})  # noqa: S102 (our own raise)
    except _Marker as marker:
        tb = marker.__traceback__
    assert tb is not None and tb.tb_next is not None
    return tb.tb_next  # (the compiled code's frame, not this function's)


def traceback_through(frames: Iterable[tuple[str, int, str]]) -> TracebackType | None:
    """Entries at ``frames`` (file, line, function; outermost first) chained into one traceback;
    None for no frames."""
    tb = None
    for file, line, name in reversed(list(frames)):
        at = frame_at(file, line, name)
        tb = TracebackType(tb, at.tb_frame, at.tb_lasti, at.tb_lineno)
    return tb
