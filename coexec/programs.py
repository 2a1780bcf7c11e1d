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

import weakref
from collections import OrderedDict
from typing import Any, Protocol

import torch

MAX_PROGRAMS = 16  # live programs over all ``with`` statements (see set_max_programs)


class ProgramLike(Protocol):
    family_key: Any
    params: dict[int, weakref.ref]  # id(parameter) -> weak reference, the parameters it claimed
    successor: "ProgramLike | None"  # the program that ran after it last time, at its ``with``

    def release(self) -> None: ...


class Family:
    """The programs of one ``with`` statement (or one ``key=``), most recently used last."""

    def __init__(self, key: Any, named: bool, code: Any, where: str) -> None:
        self.key = key
        self.named = named  # a ``key=``: one program, never split
        self.code = code  # the ``with`` statement's code object (kept alive: it is in the key)
        self.where = where  # the ``with`` statement, as users read it
        self.made = 0  # programs made here so far (numbers them)
        self.programs: list[Any] = []
        self.owner: dict[int, tuple[weakref.ref, Any]] = {}  # id(parameter) -> (ref, program)
        self.last: Any = None  # the program of the latest step here

    def choose(self) -> Any | None:
        """The program a new step most likely belongs to, before it reads anything: the one
        that followed the latest program last time (two models alternating), else the most
        recently used program that is still alive. Drops the dead ones it meets. None: none
        is alive."""
        if self.named:
            return self.programs[-1] if self.programs else None
        last = self.last
        nxt = last.successor if last is not None else None
        if nxt is not None and nxt in self.programs and self.alive(nxt):
            return nxt
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
        if self.last is not None:
            self.last.successor = program
        self.last = program
        touch(program)


# ``with`` location or ("key", key) -> its programs (a family outlives its programs: small)
_families: dict[Any, Family] = {}
_lru: "OrderedDict[Any, None]" = OrderedDict()  # every live program, least recently used first


def family(key: Any, named: bool, code: Any, where: Any) -> Family:
    """The programs of ``key``; ``where()`` describes the ``with`` line (called once)."""
    fam = _families.get(key)
    if fam is None:
        fam = _families[key] = Family(key, named, code, where())
    return fam


def add(fam: Family, program: Any) -> Any:
    """Register a new program of ``fam`` (dropping the least recently used beyond the bound)."""
    program.family_key = fam.key
    fam.programs.append(program)
    touch(program)
    return program


def touch(program: Any) -> None:
    """``program`` is in use: the most recently used; drop the oldest beyond the bound."""
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
    _lru.pop(program, None)
    fam = _families.get(program.family_key)
    if fam is not None:
        if program in fam.programs:
            fam.programs.remove(program)
        fam.owner = {k: e for k, e in fam.owner.items() if e[1] is not program}
        for p in fam.programs:
            if p.successor is program:
                p.successor = None
        if fam.last is program:
            fam.last = None
    program.successor = None
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
    old, MAX_PROGRAMS = MAX_PROGRAMS, n
    while len(_lru) > n:
        drop(next(iter(_lru)))
    return old


def is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter)
