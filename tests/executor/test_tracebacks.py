"""Traceback entries made at a file and line (executor/tracebacks.py): they name that place,
print its source, and underline none of it."""

from __future__ import annotations

import traceback

from executor.tracebacks import frame_at, traceback_through


def _place() -> int:
    if True:
        return 2 + 2  # THE LINE


def _line_of(marker: str) -> int:
    return next(i for i, t in enumerate(open(__file__), 1) if marker in t and "_line_of" not in t)


def test_an_entry_names_its_place_and_prints_its_source_bare() -> None:
    line = _line_of("# THE LINE")
    (entry,) = traceback.extract_tb(frame_at(__file__, line, "_place"))
    assert (entry.filename, entry.lineno, entry.name) == (__file__, line, "_place")
    assert entry.line == "return 2 + 2  # THE LINE"
    printed = "".join(traceback.format_tb(frame_at(__file__, line, "_place")))
    assert "^" not in printed and "~" not in printed


def test_entries_chain_outermost_first() -> None:
    frames = [
        (__file__, _line_of("def _place"), "module"),
        (__file__, _line_of("# THE LINE"), "_place"),
    ]
    got = [(e.filename, e.lineno, e.name) for e in traceback.extract_tb(traceback_through(frames))]
    assert got == frames
    assert traceback_through([]) is None
