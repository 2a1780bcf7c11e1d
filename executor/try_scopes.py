"""Where a code object's ``try`` would catch an op's error: the spans of instructions whose
exception reaches an ``except`` clause that may match it (``native/capture.cpp`` runs an op
called there at once, so that its error is raised at its line, into the user's handler, as in
eager; elsewhere ops run on the worker and a failure is raised where the step next waits).

Read from the code's exception table (CPython 3.11+): an instruction's handler is its innermost
one; a handler that does not catch (a ``with`` statement's exit, a ``finally``, the cleanup
after an ``except`` body) hands the exception on from its own instructions, so the chain is
followed to the first handler that may catch. A handler may catch unless every class it tests
is one no op raises (``except KeyboardInterrupt:`` around a training loop keeps its steps on
the worker). A ``with`` whose context manager suppresses errors (``contextlib.suppress``) is
not seen as catching: its ops run on the worker.
"""

from __future__ import annotations

import dis
import sys
from types import CodeType

# Exception classes (by builtin name) that no ATen op raises: handlers that test only these
# cannot catch an op's error. Anything else (Exception, RuntimeError, IndexError, an attribute
# such as torch.OutOfMemoryError, a name bound at run time) may.
_NOT_OP_ERRORS = frozenset({
    "KeyboardInterrupt", "SystemExit", "GeneratorExit", "StopIteration", "StopAsyncIteration",
    "KeyError", "AttributeError", "ImportError", "ModuleNotFoundError", "NameError",
    "UnboundLocalError", "OSError", "IOError", "EnvironmentError", "FileNotFoundError",
    "FileExistsError", "PermissionError", "IsADirectoryError", "NotADirectoryError", "EOFError",
    "ConnectionError", "BrokenPipeError", "TimeoutError", "InterruptedError", "ZeroDivisionError",
    "AssertionError", "UnicodeError", "UnicodeDecodeError", "UnicodeEncodeError",
    "RecursionError",
})  # fmt: skip
_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CONST")


def catching_spans(code: CodeType) -> list[tuple[int, int]]:
    """The [start, end) byte offsets of ``code``'s instructions whose error an ``except`` of
    ``code`` may catch, merged and ascending (empty before Python 3.11: no exception table)."""
    if sys.version_info < (3, 11):
        return []
    bytecode = dis.Bytecode(code)
    entries = bytecode.exception_entries
    if not entries:
        return []
    instructions = list(bytecode)
    at = {ins.offset: i for i, ins in enumerate(instructions)}
    catches: dict[int, bool] = {}

    def entry_at(offset: int):
        for e in entries:  # (the table is short; the innermost entry is the only one that covers it)
            if e.start <= offset < e.end:
                return e
        return None

    def reaches_catch(target: int, seen: frozenset[int] = frozenset()) -> bool:
        if target in catches:
            return catches[target]
        found = False
        if _may_catch(instructions, at.get(target)):
            found = True
        elif target not in seen:
            outer = entry_at(target)
            found = outer is not None and reaches_catch(outer.target, seen | {target})
        catches[target] = found
        return found

    spans: list[tuple[int, int]] = []
    for e in entries:
        if reaches_catch(e.target):
            if spans and spans[-1][1] >= e.start:
                spans[-1] = (spans[-1][0], max(spans[-1][1], e.end))
            else:
                spans.append((e.start, e.end))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for s, t in spans:
        if merged and merged[-1][1] >= s:
            merged[-1] = (merged[-1][0], max(merged[-1][1], t))
        else:
            merged.append((s, t))
    return merged


def _may_catch(instructions: list[dis.Instruction], i: int | None) -> bool:
    """Is the handler starting at instruction ``i`` an ``except`` that may catch an op's error?
    An ``except`` handler starts with PUSH_EXC_INFO, then pops the exception (a bare ``except:``)
    or tests it (CHECK_EXC_MATCH; CHECK_EG_MATCH for ``except*``), the test's jump leading to the
    next clause's test or to the RERAISE of an exception no clause matched; a ``with``'s handler
    calls its exit (WITH_EXCEPT_START); a ``finally`` runs its body and re-raises. Where the
    code does not look like any of these, it may catch."""
    if i is None or instructions[i].opname != "PUSH_EXC_INFO" or i + 1 >= len(instructions):
        return False
    at = {ins.offset: k for k, ins in enumerate(instructions)}
    k = i + 1
    if instructions[k].opname == "WITH_EXCEPT_START":
        return False
    clauses = 0
    for _ in range(256):  # (clauses of one try)
        if k >= len(instructions):
            return True
        if instructions[k].opname == "POP_TOP":  # (a bare except:)
            return True
        if instructions[k].opname == "RERAISE":  # (no clause matched, or a finally with no body)
            return False
        names: list[str | None] = []
        while k < len(instructions) and instructions[k].opname not in ("CHECK_EXC_MATCH", "CHECK_EG_MATCH"):
            ins = instructions[k]
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                names.append(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_FAST", "LOAD_DEREF", "CALL"):
                names.append(None)  # (a class not known by its builtin name)
            elif ins.opname in ("RERAISE", "POP_EXCEPT", "RETURN_VALUE", "JUMP_FORWARD", "JUMP_BACKWARD"):
                return clauses > 0  # (before any test: a finally's body, which re-raises)
            k += 1
        if k >= len(instructions):
            return True
        clauses += 1
        if not names or any(n not in _NOT_OP_ERRORS for n in names):
            return True
        jump = instructions[k + 1] if k + 1 < len(instructions) else None
        if jump is None or "IF_FALSE" not in jump.opname or jump.argval not in at:
            return True
        k = at[jump.argval]
    return True

