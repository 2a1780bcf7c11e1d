"""Which program a step belongs to: one ``with`` line, many models.

A *program* (TraceGraph, phase, statistics, plans, arena) is what coexec learns about one
training step. A ``with`` statement can run several: a hyperparameter sweep through one
``train()`` helper, or a script training one model and then another. They are told apart by
their **parameters** (``nn.Parameter`` tensors the step reads from outside): the parameters a
step reads first belong to one program, and a step reading parameters no program of its
``with`` has seen is a new program, not a new trace of the current one.

Programs hold their parameters by weak reference: a program whose parameters all died (the
model of a finished run) is dropped. At most :data:`MAX_PROGRAMS` programs live at once, over
all ``with`` statements; the least recently used is dropped first, with its plans and arena.
A ``GradientTape(key=...)`` names its program explicitly: that key is one program, whatever
its steps read.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

MAX_PROGRAMS = 16  # live programs over all ``with`` statements (see set_max_programs)
CONTEXT = 6  # latest programs a guess of the next one looks at


class Family:
    """The programs of one ``with`` statement (or one ``key=``), most recently used last.
    A program here is a ``coexec.tape.Program``: this module uses its ``family_key``,
    ``index`` (its number here), ``params`` (id -> weak reference of the parameters it
    claimed) and ``release()``."""

    def __init__(self, key: Any, named: bool, code: Any, where: str) -> None:
        self.key = key
        self.named = named  # a ``key=``: one program, never split
        self.code = code  # the ``with`` statement's code object (kept alive: it is in the key)
        self.where = where  # the ``with`` statement, as users read it
        self.made = 0  # programs made here so far (numbers them)
        self.programs: list[Any] = []
        self.owner: dict[int, tuple[weakref.ref, Any]] = {}  # id(parameter) -> (ref, program)
        # the order programs ran in, to guess the next one: the indices of the latest
        # CONTEXT programs, and per context (a suffix of them) the index that ran next
        self.recent: tuple[int, ...] = ()
        self.next_after: dict[tuple[int, ...], int] = {}

    def choose(self) -> Any | None:
        """The program a new step most likely belongs to, before it reads anything: the one
        that came next the last time the latest programs ran in this order (models alternating
        in a pattern of up to CONTEXT steps), else the most recently used program that is
        still alive. Drops the dead ones it meets. None: none is alive."""
        if self.named:
            return self.programs[-1] if self.programs else None
        with _lock:
            by_index = {p.index: p for p in self.programs}
            for k in range(len(self.recent), 0, -1):
                p = by_index.get(self.next_after.get(self.recent[-k:], 0))
                if p is not None and self.alive(p):
                    return p
            for p in reversed(list(self.programs)):
                if self.alive(p):
                    return p
                drop(p)
            return None

    def alive(self, program: Any) -> bool:
        """False once every parameter the program claimed has died (its model is gone)."""
        refs = program.params
        return not refs or any(r() is not None for r in refs.values())

    def owner_of(self, t: torch.Tensor) -> Any | None:
        e = self.owner.get(id(t))
        return e[1] if e is not None and e[0]() is t else None

    def claim(self, t: torch.Tensor, program: Any) -> None:
        """``t`` belongs to ``program`` (unless another program of this ``with`` has it)."""
        if self.owner_of(t) is None:
            ref = weakref.ref(t)
            self.owner[id(t)] = (ref, program)
            program.params[id(t)] = ref

    def ran(self, program: Any) -> None:
        """A step of ``program`` ended here: remember the order programs run in."""
        if len(self.next_after) > 4096:  # bounded: patterns seen long ago are relearnt
            self.next_after.clear()
        for k in range(1, len(self.recent) + 1):
            self.next_after[self.recent[-k:]] = program.index
        self.recent = (*self.recent, program.index)[-CONTEXT:]
        touch(program)


# ``with`` location or ("key", key) -> its programs (a family outlives its programs: small)
_families: dict[Any, Family] = {}
_lru: "OrderedDict[Any, None]" = OrderedDict()  # every live program, least recently used first
_lock = threading.RLock()  # tapes of several threads share the registry


def family(key: Any, named: bool, code: Any, where: Any) -> Family:
    """The programs of ``key``; ``where()`` describes the ``with`` line (called once)."""
    with _lock:
        fam = _families.get(key)
        if fam is None:
            fam = _families[key] = Family(key, named, code, where())
        return fam


def add(fam: Family, program: Any) -> Any:
    """Register a new program of ``fam`` (dropping the least recently used beyond the bound)."""
    with _lock:
        program.family_key = fam.key
        fam.programs.append(program)
        touch(program)
        return program


def touch(program: Any) -> None:
    """``program`` is in use: the most recently used; drop the oldest beyond the bound."""
    with _lock:
        fam = _families.get(program.family_key)
        if fam is None or program not in fam.programs:
            return  # dropped meanwhile (a tape keeps its last program for its stats)
        fam.programs.remove(program)
        fam.programs.append(program)
        _lru[program] = None
        _lru.move_to_end(program)
        while len(_lru) > max(MAX_PROGRAMS, 1):
            oldest = next(iter(_lru))
            if oldest is program:
                break
            drop(oldest)


def drop(program: Any) -> None:
    """Forget ``program``: its graph, plans and arena go; a tape that ran it keeps its stats."""
    with _lock:
        _lru.pop(program, None)
        fam = _families.get(program.family_key)
        if fam is not None:
            if program in fam.programs:
                fam.programs.remove(program)
            fam.owner = {k: e for k, e in fam.owner.items() if e[1] is not program}
        program.release()


def live_programs() -> int:
    """How many programs are alive now, over all ``with`` statements."""
    return len(_lru)


def set_max_programs(n: int) -> int:
    """Keep at most ``n`` programs alive (least recently used dropped first, with their plans
    and arena); returns the previous bound. The default is 16."""
    global MAX_PROGRAMS
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"set_max_programs: n must be a positive int, got {n!r}")
    with _lock:
        old, MAX_PROGRAMS = MAX_PROGRAMS, n
        while len(_lru) > n:
            drop(next(iter(_lru)))
        return old
