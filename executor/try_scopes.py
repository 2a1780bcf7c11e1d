"""Where a code object's ``try`` would catch an op's error: the spans of instructions whose
exception reaches an ``except`` clause that may match it (``native/capture.cpp`` runs an op
called there at once, so that its error is raised at its line, into the user's handler, as in
eager; elsewhere ops run on the worker and a failure is raised where the step next waits).

Read from the code's exception table (CPython 3.11+): an instruction's handler is its innermost
one; a handler that does not catch (a ``with`` statement's exit, a ``finally``, the cleanup
after an ``except`` body) hands the exception on from its own instructions, so the chain is
followed to the first handler that may catch. A handler may catch unless every class it tests
is one no op raises (``except KeyboardInterrupt:`` around a training loop keeps its steps on
the worker, and so does a class of the program's own, ``except LossSpike:`` or
``except coexec.BudgetTooSmall:``, resolved in the code's globals: an op's error is one of
Python's or torch's exception classes, and ``except`` matches by the class's real bases). A
clause *swallows* where its body can end without raising (it reaches POP_EXCEPT): the program
goes on after the error, so the Python after a failing op must not have run; a clause that
logs and re-raises does not. A ``with`` counts as a clause that catches and swallows where its
manager may swallow: ``contextlib.suppress``, a class whose ``__exit__`` may return True, a
``@contextmanager`` generator that catches around its ``yield`` (the manager read from the
code: the call that made it, looked up in the globals); ``with cm:`` over a variable does not.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import inspect
import sys
from collections.abc import Callable, Mapping
from types import CodeType, ModuleType
from typing import Any, NamedTuple

# Python's exception classes (by builtin name; looked up where the code's globals are known)
# that no ATen op raises: handlers that test only these cannot catch an op's error. Neither can a class defined outside Python and torch (below,
# _cannot_be_an_op_error). Anything else (Exception, RuntimeError, IndexError,
# torch.OutOfMemoryError, a name not bound yet, a local variable) may.
_NOT_OP_ERRORS = frozenset({
    "KeyboardInterrupt", "SystemExit", "GeneratorExit", "StopIteration", "StopAsyncIteration",
    "KeyError", "AttributeError", "ImportError", "ModuleNotFoundError", "NameError",
    "UnboundLocalError", "OSError", "IOError", "EnvironmentError", "FileNotFoundError",
    "FileExistsError", "PermissionError", "IsADirectoryError", "NotADirectoryError", "EOFError",
    "ConnectionError", "BrokenPipeError", "TimeoutError", "InterruptedError", "ZeroDivisionError",
    "AssertionError", "UnicodeError", "UnicodeDecodeError", "UnicodeEncodeError",
    "RecursionError",
})  # fmt: skip

Spans = list[tuple[int, int]]  # [start, end) byte offsets, merged and ascending


class TryScopes(NamedTuple):
    """A code object's spans where an ``except`` of it may catch an op's error, and those of them
    where the clause may also swallow it (go on without raising)."""

    catching: Spans
    swallowing: Spans


class _Handler(NamedTuple):
    catches: bool
    swallows: bool


_NONE = _Handler(False, False)


def try_scopes(code: CodeType, namespace: Mapping[str, Any] | None = None) -> TryScopes:
    """``code``'s :class:`TryScopes` (empty before Python 3.11: no exception table). With
    ``namespace`` (the globals the code runs in), a clause's class named by a global (or a
    module's attribute, ``coexec.BudgetTooSmall``) is looked up there."""
    if sys.version_info < (3, 11):
        return TryScopes([], [])
    bytecode = dis.Bytecode(code)
    entries = bytecode.exception_entries
    if not entries:
        return TryScopes([], [])
    instructions = list(bytecode)
    at = {ins.offset: i for i, ins in enumerate(instructions)}
    known: dict[int, _Handler] = {}

    def entry_at(offset: int):
        for e in entries:  # (the table is short; the innermost entry is the only one that covers it)
            if e.start <= offset < e.end:
                return e
        return None

    def cleanup_of(offset: int) -> int | None:
        """Where the handler of the instruction at ``offset`` (a clause body's) begins."""
        e = entry_at(offset)
        return None if e is None else e.target

    def reached(target: int, seen: frozenset[int] = frozenset()) -> _Handler:
        """What the first handler that may catch, on the chain from ``target``, does."""
        if target in known:
            return known[target]
        found = _handler(instructions, at, cleanup_of, at.get(target), namespace)
        if not found.catches and target not in seen:
            outer = entry_at(target)
            found = _NONE if outer is None else reached(outer.target, seen | {target})
        known[target] = found
        return found

    catching: Spans = []
    swallowing: Spans = []
    for e in entries:
        h = reached(e.target)
        if h.catches:
            catching.append((e.start, e.end))
        if h.swallows:
            swallowing.append((e.start, e.end))
    return TryScopes(_merged(catching), _merged(swallowing))


def _merged(spans: Spans) -> Spans:
    out: Spans = []
    for s, t in sorted(spans):
        if out and out[-1][1] >= s:
            out[-1] = (out[-1][0], max(out[-1][1], t))
        else:
            out.append((s, t))
    return out


def _handler(
    instructions: list[dis.Instruction],
    at: dict[int, int],
    cleanup_of: Callable[[int], int | None],
    i: int | None,
    namespace: Mapping[str, Any] | None = None,
) -> _Handler:
    """What the handler starting at instruction ``i`` does with an op's error. An ``except``
    handler starts with PUSH_EXC_INFO, then pops the exception (a bare ``except:``) or tests it
    (CHECK_EXC_MATCH; CHECK_EG_MATCH for ``except*``), the test's jump leading to the next
    clause's test or to the RERAISE of an exception no clause matched; a ``with``'s handler calls
    its exit (WITH_EXCEPT_START); a ``finally`` runs its body and re-raises. Where the code does
    not look like any of these, it may catch and swallow."""
    n = len(instructions)
    if i is None or instructions[i].opname != "PUSH_EXC_INFO" or i + 1 >= n:
        return _NONE
    k = i + 1
    if instructions[k].opname == "WITH_EXCEPT_START":
        return _Handler(True, True) if _with_may_swallow(instructions, i, namespace) else _NONE
    clauses = 0
    catches = swallows = False
    for _ in range(256):  # (clauses of one try)
        if k >= n:
            return _Handler(True, True)
        if instructions[k].opname == "POP_TOP":  # (a bare except: its body)
            return _Handler(True, swallows or _ends_normally(instructions, cleanup_of, k + 1, None))
        if instructions[k].opname == "RERAISE":  # (no clause matched, or a finally with no body)
            return _Handler(catches, swallows)
        # the classes the clause tests, as dotted paths from a global (None: not known so)
        paths: list[list[str] | None] = []
        while k < n and instructions[k].opname not in ("CHECK_EXC_MATCH", "CHECK_EG_MATCH"):
            ins = instructions[k]
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                paths.append([ins.argval])
            elif ins.opname == "LOAD_ATTR" and paths and paths[-1] is not None:
                paths[-1].append(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_FAST", "LOAD_DEREF", "CALL"):
                paths.append(None)  # (a class not known by its builtin name)
            elif ins.opname in ("RERAISE", "POP_EXCEPT", "RETURN_VALUE", "JUMP_FORWARD", "JUMP_BACKWARD"):
                # (before any test: a finally's body, which re-raises)
                return _Handler(catches, swallows) if clauses else _NONE
            k += 1
        if k + 1 >= n:
            return _Handler(True, True)
        clauses += 1
        jump = instructions[k + 1]
        if "IF_FALSE" not in jump.opname or jump.argval not in at:
            return _Handler(True, True)
        if not paths or not all(_cannot_catch(p, namespace) for p in paths):
            catches = True
            swallows = swallows or _ends_normally(instructions, cleanup_of, k + 2, jump.argval)
        k = at[jump.argval]
    return _Handler(True, True)


def _with_may_swallow(instructions: list[dis.Instruction], i: int, namespace: Mapping[str, Any] | None) -> bool:
    """May the ``with`` whose exit handler starts at instruction ``i`` swallow an op's error? Its
    manager is read from the code: the ``with`` is found by the source span its BEFORE_WITH and
    its handler share, the manager's callee is the call before BEFORE_WITH (its first load and
    the attributes read off it), looked up in the code's globals (:func:`_may_swallow`). A
    callee that is not looked up (a local variable, no globals) counts only if its name ends in
    ``suppress``; a manager not made by a call of a name (``with cm:``) does not count."""
    span = instructions[i].positions
    for j, ins in enumerate(instructions):
        if ins.opname != "BEFORE_WITH" or ins.positions != span or j == 0 or instructions[j - 1].opname != "CALL":
            continue
        call = instructions[j - 1].positions
        start = j - 1
        while start > 0 and _within(instructions[start - 1].positions, call):
            start -= 1
        path: list[str] = []
        local = False  # (the callee a local variable's: not looked up in the globals)
        for load in instructions[start : j - 1]:
            same_start = load.positions.lineno == call.lineno and load.positions.col_offset == call.col_offset
            if not path and same_start and load.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_FAST"):
                path.append(load.argval)
                local = load.opname in ("LOAD_DEREF", "LOAD_FAST")
            elif path and same_start and load.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                path.append(load.argval)
            elif path or load.opname != "PUSH_NULL":
                break
        if not path:
            continue
        found = _looked_up(path, namespace) if namespace is not None and not local else None
        if found is None:
            if path[-1] == "suppress":  # (not known here: may be contextlib's)
                return True
            continue
        if _may_swallow(found):
            return True
    return False


def _may_swallow(manager: object) -> bool:
    """May a ``with`` over what ``manager`` makes when called swallow an error? A class: it is
    ``contextlib.suppress`` or a subclass, or its ``__exit__`` is Python code that may return
    something other than None or False (``ExitStack``'s may). A ``@contextlib.contextmanager``
    function: its generator may catch and swallow around a ``yield`` (``try: yield / except
    RuntimeError: log(...)``). torch's managers and those written in C (files, locks) do not
    swallow; anything else called (a function that returns a manager) is not seen."""
    if isinstance(manager, type):
        if issubclass(manager, contextlib.suppress):
            return True
        module = getattr(manager, "__module__", None) or ""
        if module == "torch" or module.startswith("torch."):
            return False  # (torch's managers hand errors on; some return their base's __exit__)
        exit_ = inspect.getattr_static(manager, "__exit__", None)
        code = getattr(exit_, "__code__", None)
        return code is not None and _may_return_true(code)
    wrapped = getattr(manager, "__wrapped__", None)
    helper = getattr(manager, "__code__", None)
    if wrapped is None or helper is None or helper.co_filename != contextlib.__file__:
        return False
    gen = getattr(wrapped, "__code__", None)
    if gen is None or not gen.co_flags & inspect.CO_GENERATOR:
        return False
    # (without its globals: its except classes by builtin name, its own withs over suppress by
    # name, so no manager it uses is looked into in turn)
    scopes = try_scopes(gen)
    yields = [ins.offset for ins in dis.get_instructions(gen) if ins.opname == "YIELD_VALUE"]
    return any(s <= y < t for y in yields for s, t in scopes.swallowing)


def _may_return_true(code: CodeType) -> bool:
    """May the function of ``code`` return anything but the constants None or False?"""
    instructions = list(dis.get_instructions(code))
    for k, ins in enumerate(instructions):
        if ins.opname == "RETURN_CONST" and ins.argval not in (None, False):
            return True
        if ins.opname == "RETURN_VALUE":
            before = instructions[k - 1] if k else None
            if before is None or before.opname != "LOAD_CONST" or before.argval not in (None, False):
                return True
    return False


def _within(inner: dis.Positions, outer: dis.Positions) -> bool:
    """Does source span ``inner`` lie inside ``outer`` (both known)?"""
    if None in (*inner, *outer):
        return False
    return (inner.lineno, inner.col_offset) >= (outer.lineno, outer.col_offset) and (
        inner.end_lineno,
        inner.end_col_offset,
    ) <= (outer.end_lineno, outer.end_col_offset)


def _cannot_catch(path: list[str] | None, namespace: Mapping[str, Any] | None) -> bool:
    """Is the class at ``path`` (``["KeyError"]``, ``["coexec", "BudgetTooSmall"]``) one that no
    op's error is an instance of?"""
    if path is None:
        return False
    if namespace is None:  # (by builtin name only)
        return len(path) == 1 and path[0] in _NOT_OP_ERRORS
    found = _looked_up(path, namespace)
    return found is not None and _cannot_be_an_op_error(found)


def _looked_up(path: list[str], namespace: Mapping[str, Any]) -> object | None:
    """What ``path`` names in ``namespace`` (then the builtins), through module attributes only,
    read from the modules' dicts (no code runs); None where it is not bound (yet)."""
    head, *rest = path
    if head in namespace:
        found = namespace[head]
    else:
        found = vars(builtins).get(head)
    for name in rest:
        if not isinstance(found, ModuleType):
            return None
        found = vars(found).get(name)
    return found


def _cannot_be_an_op_error(cls: object) -> bool:
    """An op's error is an instance of one of Python's exception classes or of a subclass torch
    defines, so ``except cls`` catches one only if ``cls`` is among their bases: Python's or
    torch's own (``except`` matches by the real bases, never ``__subclasscheck__``), and of
    Python's, those in ``_NOT_OP_ERRORS`` no op raises. A class defined anywhere else cannot be."""
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        return False
    if vars(builtins).get(cls.__name__) is cls:  # (Python's own)
        return cls.__name__ in _NOT_OP_ERRORS
    module = getattr(cls, "__module__", None) or ""
    return module != "torch" and not module.startswith("torch.")


def _ends_normally(
    instructions: list[dis.Instruction], cleanup_of: Callable[[int], int | None], i: int, end: int | None
) -> bool:
    """Can the clause body from instruction ``i`` (to offset ``end``, the next clause's test, or
    to the body's own cleanup handler) finish without raising? It then pops the exception state
    (a nested try's handler inside the body is looked through: its POP_EXCEPT counts, which may
    say a clause swallows where it does not, never the other way)."""
    if i >= len(instructions):
        return True
    stop = cleanup_of(instructions[i].offset)
    for ins in instructions[i:]:
        if ins.offset in (end, stop):
            return False
        if ins.opname == "POP_EXCEPT":
            return True
    return False
