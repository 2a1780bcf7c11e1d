"""The guard: a cap on the Python executor's live bytes, kept where no plan does (a step larger
than the one planned, from its first op that makes more than planned; a step without a plan),
after DTR (Kirisame et al. 2021), as the native capture's guard does (``native/capture_worker.h``).

While a cap is set, every forward op that makes new tensors from its arguments (and, for a
random op, the generator's state it ran with) is kept as a recipe in the worker's
:class:`~executor.remat.Recipes`, which pins its inputs; a value written in place is made again
by the write's functional variant (``div_`` -> ``div``, ``bernoulli_.float`` -> ``bernoulli.p``:
a dropout mask) from the value before the write. Backward ops keep none (as the native guard: a
gradient's recipe would pin the gradients and forward values it read past where eager frees
them). Pins here are weak, so that a recipe keeps nothing alive eager would free: when the
program lets go of a value only recipes read, it is dropped at once if the guard can make it
again (made again, as a link of a chain, only for a reader, and dropped again once that reader
ran), and otherwise the guard's recipes reading it are retired (their outputs can no longer be
made again) unless one of them already dropped an output (then the value is held, as a planned
recipe holds its inputs). Before an op runs, if the storages it makes and the dropped arguments
it needs made again would take the live bytes past the cap, storages are dropped, each with
every value on it (a view frees nothing alone): least work to make again (bytes read and
written, with the dropped values that takes: an estimate, so the same program drops the same
values every run) per byte and per op since made first, none the op reads, none that would make
a chain of dropped values longer than :data:`CHAIN`. A write in place to what a recipe read or
made retires it, after making what it dropped if anything may still read that. A dropped value
is made again exactly as a planned drop's is, so the guard decides only when memory is held,
never a value.

Never dropped: what no recipe makes (data-dependent results, writes to state, ops whose
arguments are gone without a recipe), arena storages (the arena counts whole).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

CHAIN = 8  # the longest chain of dropped values one remake may have to run
_SLACK = 32  # an eviction frees 1/_SLACK of the cap beyond what the op needs: fewer rounds
# a value on a smaller storage is not worth a recipe (the native guard's kGuardMinBytes): an
# episode of small ops kept as recipes made REINFORCE's budgeted steps a quarter slower
MIN_BYTES = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class Cap:
    """Instruction: hold the live bytes within ``nbytes`` from the next op on (None: no cap).
    A step under a budget sends its budget less the state it found (parameters, optimizer
    state, inputs), again when it meets more state than it counted."""

    nbytes: int | None


class Guard:
    """The cap, and which recipes are the guard's, of one worker."""

    def __init__(self, values: dict, recipes: Any, memory: Any) -> None:
        self.values = values
        self.recipes = recipes
        self.memory = memory  # the worker's LiveBytes
        self.cap: int | None = None
        self.mine: dict[int, Any] = {}  # id() -> the recipes the guard keeps (not the plan's)
        self.made: dict[int, tuple[float, int]] = {}  # value id -> (its op's work, tick made)
        # value id -> the address of its storage when dropped, and the bytes that storage held
        self.dropped_bytes: dict[int, tuple[int, int]] = {}
        self.by_storage: dict[int, list] = {}  # storage address -> the guard's recipes on it
        self.tick = 0
        recipes.lasting = self._is_mine
        recipes.again = self._again
        recipes.ran_again = self._ran_again
        self.reading: set[int] = set()  # the values the op being run, and its remakes, read
        self.outer: list[set[int]] = []  # ``reading`` of the op or remake a remake runs for
        self.evicted = 0  # values the guard dropped
        self.overruns = 0  # ops before which it found too little to drop

    def set_cap(self, cap: int | None) -> None:
        self.cap = cap

    @staticmethod
    def eligible(ins: Any) -> bool:
        """Can ``ins`` be run again to make its outputs, from its arguments alone (and, for a
        random op, the generator's state it ran with, which the executor keeps)? Not a
        backward op (as the native guard): a gradient's recipe would pin what it read (the
        forward's values, the gradients flowing back) past where eager frees them."""
        return bool(ins.outs) and not (ins.moves or ins.writes or ins.recipe or ins.keep_result or ins.backward)

    def before(self, ins: Any) -> None:
        """``ins`` is about to run: make room for what it makes and the dropped arguments it
        needs made again."""
        self.tick += 1
        cap = self.cap
        if cap is None:
            return
        self.reading = {vid for _a, _i, vid in ins.refs}
        need = ins.new_bytes
        if self.recipes.dropped:
            storages: dict[int, int] = {}
            for _a, _i, vid in ins.refs:
                self._remade_storages(vid, storages)
            need += sum(storages.values())
        if self.memory.live + need > cap:
            self._evict(self.memory.live + need - cap + cap // _SLACK, {vid for _a, _i, vid in ins.refs})

    def ran(self, ins: Any, args: list, kwargs: dict) -> None:
        """``ins`` ran (its outputs are in the table): keep it as a recipe, found again by the
        storages it read and made (a write to one of them retires it: :meth:`before_write`)."""
        if self.cap is None or not self.eligible(ins):
            return
        values = self.values
        if not any(_storage_bytes(values.get(vid)) >= MIN_BYTES for vid in ins.outs):
            return
        if ins.random and id(ins) not in self.recipes.rng_states:
            return  # (its generator's state was not kept: too small to be worth it)
        self.recipes.keep(ins)
        self.mine[id(ins)] = ins
        made = (_work(ins, args, kwargs), self.tick)
        index = self.by_storage
        for vid in ins.outs:
            self.made[vid] = made
            _index(values.get(vid), ins, index)
        for _a, _i, vid in ins.refs:
            _index(values.get(vid), ins, index)
        for x in _tensors(args, kwargs):
            _index(x, ins, index)

    def before_write(self, written: list, moved: frozenset = frozenset(), values_written: bool = False) -> None:
        """These tensors are about to be written in place: the guard's recipes that read or
        made their storages would make other values than the first time. Those that dropped
        an output something may still read (the program, or a dropped value that may be made
        again for it) make it now; all are retired. Except those that meet the storage only
        as ``moved`` values (the written argument, whose value id ends with the write: a recipe
        that made or read it still makes or reads the value before the write)."""
        recipes = self.recipes
        for t in written:
            key = _ptr(t)
            kept = []
            found = self.by_storage.pop(key, [])
            # (a value made again is on another storage than the one its readers were found
            # by: where the op writes the table's values, those on this storage are found by
            # their value ids; state, which is never made again, stays where it was)
            for vid, x in self.values.items() if values_written else ():
                if _ptr(x) == key:
                    found.extend(recipes.readers.get(vid, ()))
                    if vid in recipes.by_out:
                        found.append(recipes.by_out[vid])
            for ins in {id(ins): ins for ins in found}.values():
                if not self._is_mine(ins) or not any(recipes.by_out.get(v) is ins for v in ins.outs):
                    continue
                if moved and self._meets_only(ins, key, moved):
                    kept.append(ins)
                    continue
                seen: set[int] = set()
                dropped = [v for v in ins.outs if v in recipes.dropped]
                if any(self._needed(v, seen) for v in dropped):
                    recipes.recompute(ins)
                else:
                    for v in dropped:
                        self._abandon(v)
                self.retire(ins)
            if kept:
                self.by_storage[key] = kept

    def _meets_only(self, ins: Any, key: int, moved: frozenset) -> bool:
        """Does ``ins`` make or read the storage at ``key`` only as values in ``moved``?"""
        values = self.values
        for vid in (*ins.outs, *(v for _a, _i, v in ins.refs)):
            t = values.get(vid)
            if t is not None and vid not in moved and _ptr(t) == key:
                return False
        return not any(_ptr(x) == key for x in _tensors(ins.args, ins.kwargs))

    def links(self, ins: Any) -> frozenset:
        """The value ``ins`` writes in place that stays, dropped, as a link of a chain (for
        :meth:`ran_in_place`): its first argument, if the op has a functional variant (it
        only computes a value: not ``set_``, ``resize_``) and the guard can make that value
        again; else none."""
        if len(ins.moves) != 1 or ins.writes != (0,) or _functional(ins.func) is None:
            return frozenset()
        ((old, new),) = ins.moves
        if not any(a == 0 and i < 0 and v == old for a, i, v in ins.refs):
            return frozenset()
        values = self.values  # (asked before the write, and after it: ran_in_place)
        if _storage_bytes(values[old] if old in values else values.get(new)) < MIN_BYTES:
            return frozenset()
        return frozenset((old,)) if self._droppable(self.recipes.by_out.get(old)) else frozenset()

    def ran_in_place(self, ins: Any) -> None:
        """``ins`` wrote its first argument in place, a value the guard can make again
        (:meth:`links`): the written value is made again by the same op on a copy of the
        value before the write (:class:`OnACopy`), which stays, dropped, as a link of its
        chain."""
        recipes = self.recipes
        if not self.links(ins):
            return
        ((old, new),) = ins.moves
        again = dataclasses.replace(ins, func=OnACopy(ins.func), moves=(), writes=(), outs=(new,), arena_out=None)
        if ins.random:
            recipes.rng_states[id(again)] = recipes.rng_states.pop(id(ins))
        t = self.values[new]
        key = _ptr(t)
        recipes.dropped.add(old)  # (no longer in the table: the write took its storage)
        recipes.waiting.add(old)  # (nothing but recipes reads it now; freed with the last)
        self.dropped_bytes[old] = (-old, self.memory.holders(key)[1])
        self.ran(again, list(ins.args), dict(ins.kwargs))

    def _needed(self, vid: int, seen: set[int]) -> bool:
        """May dropped value ``vid`` still be read: the program holds it, a plan's recipe that
        reads it may yet be run, or a recipe of the guard's that reads it dropped an output
        that may still be read?"""
        recipes = self.recipes
        if vid not in recipes.waiting:
            return True
        for ins in recipes.readers.get(vid, ()):
            if not self._is_mine(ins):
                if any(recipes.by_out.get(v) is ins for v in ins.outs):
                    return True
                continue
            for out in ins.outs:
                if out in recipes.dropped and out not in seen:
                    seen.add(out)
                    if self._needed(out, seen):
                        return True
        return False

    def _abandon(self, vid: int) -> None:
        """Dropped value ``vid`` will not be made again: the guard's recipes reading it are
        retired (with what they dropped, which nothing reads either)."""
        recipes = self.recipes
        for ins in list(recipes.readers.get(vid, ())):
            if self._is_mine(ins):
                self.retire(ins)
                for v in ins.outs:
                    if v in recipes.dropped:
                        self._abandon(v)

    def _again(self, ins: Any) -> None:
        """A remake is about to run (for an op, or for another remake): what it reads joins
        what is being read. (It makes no room of its own: dropping there, in a chain, made
        steps larger, not smaller, where no plan met the budget.)"""
        self.outer.append(self.reading)
        self.reading = self.reading | {vid for _a, _i, vid in ins.refs}

    def _ran_again(self, ins: Any) -> None:
        """A remake ran: the links of its chain it read, made again for it, which the program
        had let go of, are dropped again at once (a chain holds one link at a time), except
        what the op being run reads (it holds them: dropped, they would be counted out)."""
        self.reading = self.outer.pop() if self.outer else set()
        recipes, values, reading = self.recipes, self.values, self.reading
        for _a, _i, vid in ins.refs:
            if vid in values and vid in recipes.waiting and vid not in reading and self._droppable(recipes.by_out.get(vid)):
                self._drop(vid)

    def settle(self) -> None:
        """An op ran: what its remakes made again that the program had let go of is dropped
        again (a remade link of a chain is held only while the op needs it)."""
        recipes = self.recipes
        remade, recipes.remade = recipes.remade, []
        for vid in remade:
            own = recipes.by_out.get(vid)
            if vid in self.values and vid in recipes.waiting and self._droppable(own):
                self._drop(vid)

    def released(self, vid: int) -> None:
        """The program let go of ``vid`` while recipes still read it (``Recipes.holds``)."""
        recipes = self.recipes
        own = recipes.by_out.get(vid)
        if self._droppable(own):
            self._drop(vid)  # freed as eager frees it; made again only for a reader
            return
        for ins in list(recipes.readers.get(vid, ())):
            if self._is_mine(ins) and not any(v in recipes.dropped for v in ins.outs):
                self.retire(ins)
        # (unpinned: Recipes frees it, since holds() put it among the waiting)

    def _is_mine(self, ins: Any) -> bool:
        return self.mine.get(id(ins)) is ins

    def _droppable(self, ins: Any) -> bool:
        """Is ``ins`` the guard's, reading only values in the table or with a recipe (the
        guard's or the plan's)? One it reads that no recipe makes is held while an output is
        dropped (:meth:`released`), as the native guard arms its weak inputs (asking
        for inputs the guard could make again leaves nothing to drop downstream of a value no
        recipe makes: docs/coexec.md, *Sizes that vary*)."""
        if ins is None or not self._is_mine(ins):
            return False
        by_out, values = self.recipes.by_out, self.values
        return all(v in by_out or v in values for _a, _i, v in ins.refs)

    def retire(self, ins: Any) -> None:
        self.mine.pop(id(ins), None)
        for vid in ins.outs:
            self.made.pop(vid, None)
        self.recipes.retire(ins)

    def forget(self, vid: int) -> None:
        self.made.pop(vid, None)
        self.dropped_bytes.pop(vid, None)

    def clear_range(self, lo: int, hi: int) -> None:
        for d in (self.made, self.dropped_bytes):
            for vid in [v for v in d if lo <= v < hi]:
                del d[vid]
        live = {id(ins) for ins in self.recipes.by_out.values()}
        self.mine = {k: ins for k, ins in self.mine.items() if k in live}
        if not self.mine:
            self.by_storage.clear()

    # -- dropping -------------------------------------------------------------------------
    def _drop(self, vid: int) -> None:
        t = self.values.get(vid)
        if t is not None:
            key = _ptr(t)
            self.dropped_bytes[vid] = (key, self.memory.holders(key)[1])
        self.recipes.drop((vid,))

    def _evict(self, amount: int, keep: set[int]) -> None:
        """Drop storages, each with every value on it (a view frees nothing alone), until
        ``amount`` bytes are free."""
        recipes, values, memory = self.recipes, self.values, self.memory
        on: dict[int, list[int]] = {}  # storage address -> the droppable values on it
        for vid, ins in recipes.by_out.items():
            if vid in values and self._droppable(ins):
                on.setdefault(_ptr(values[vid]), []).append(vid)
        for vid in keep:
            if vid in values:
                on.pop(_ptr(values[vid]), None)
        now = self.tick
        scored = []
        for key, vids in on.items():
            n, nbytes = memory.holders(key)
            if n != len(vids) or nbytes <= 0:
                continue
            cost: dict[int, float] = {}
            work = 1.0 + sum(self._cost(v, cost) for v in vids)
            first = min(self.made.get(v, (0.0, now))[1] for v in vids)
            scored.append((work / (nbytes * (now - first + 1)), key, nbytes))
        scored.sort()
        depth: dict[int, int] = {}
        for _score, key, nbytes in scored:
            if amount <= 0:
                break
            vids = on[key]
            if any(v not in values for v in vids):
                continue
            if max(self._up(v, depth) + self._down(v) - 1 for v in vids) > CHAIN:
                continue
            for v in vids:
                self._drop(v)
            amount -= nbytes
            depth.clear()
            self.evicted += len(vids)
        if amount > 0:
            self.overruns += 1

    def _remade_storages(self, vid: int, found: dict[int, int]) -> None:
        """The storages making dropped value ``vid`` again allocates (with the dropped values
        it reads; a view's base with it), by address when dropped: their bytes."""
        recipes = self.recipes
        if vid not in recipes.dropped:
            return
        ins = recipes.by_out.get(vid)
        # (a plan's drop: what its recipe makes, known without looking when it was dropped)
        key, nbytes = self.dropped_bytes.get(vid) or (-vid, ins.new_bytes if ins is not None else 0)
        if key in found:
            return
        found[key] = nbytes
        if ins is not None:
            for _a, _i, v in ins.refs:
                self._remade_storages(v, found)

    def _cost(self, vid: int, cost: dict[int, float]) -> float:
        """Work making ``vid`` again would take (:func:`_work`): its op's, and that of the
        dropped values it reads, made first (DTR's evicted neighbourhood, upwards)."""
        found = cost.get(vid)
        if found is None:
            cost[vid] = 0.0  # (a cycle through views counts once)
            recipes = self.recipes
            found = self.made.get(vid, (0.0, 0))[0]
            ins = recipes.by_out.get(vid)
            if ins is not None:
                found += sum(self._cost(v, cost) for _a, _i, v in ins.refs if v in recipes.dropped)
            cost[vid] = found
        return found

    def _up(self, vid: int, depth: dict[int, int]) -> int:
        """Dropped values a remake of ``vid`` would run, itself included."""
        found = depth.get(vid)
        if found is None:
            ins = self.recipes.by_out[vid]
            dropped = self.recipes.dropped
            found = 1 + max(
                (self._up(v, depth) for _a, _i, v in ins.refs if v in dropped and v in self.recipes.by_out),
                default=0,
            )
            depth[vid] = found
        return found

    def _down(self, vid: int, seen: int = 0) -> int:
        """The longest run of dropped values that read ``vid``, one after another, plus one."""
        if seen > CHAIN:
            return seen
        recipes = self.recipes
        best = 0
        for ins in recipes.readers.get(vid, ()):
            for out in ins.outs:
                if out in recipes.dropped:
                    best = max(best, self._down(out, seen + 1))
        return best + 1


def _work(ins: Any, args: list, kwargs: dict) -> float:
    """What running ``ins`` again costs, for the eviction order: the bytes it reads and writes
    (nothing for a view). An estimate, not its measured time, so that one program drops the
    same values every run."""
    if ins.new_bytes <= 0:
        return 0.0
    return float(ins.new_bytes + sum(t.untyped_storage().nbytes() for t in _tensors(args, kwargs)))


def _storage_bytes(t: Any) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (AttributeError, RuntimeError, NotImplementedError):
        return 0


def _ptr(t: Any) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError, NotImplementedError):
        return 0


def _tensors(args: Any, kwargs: dict) -> list:
    found = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found.extend(y for y in x if isinstance(y, torch.Tensor))
    return found


_FUNCTIONAL: dict = {}


@dataclasses.dataclass(frozen=True, slots=True)
class OnACopy:
    """In-place ``op`` made again out of place: on a copy of its first argument with the same
    strides. Not through its functional variant, which may lay its result out otherwise and
    so put the same numbers elsewhere: ``bernoulli.p`` draws into a contiguous tensor, where
    dropout's ``bernoulli_`` drew into its argument's strides."""

    op: Any

    def __call__(self, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copy = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype, device=target.device)
        return self.op(copy.copy_(target), *args, **kwargs)

    def __str__(self) -> str:
        return f"{self.op} on a copy"


def _functional(func: Any) -> Any:
    """The out-of-place overload of an in-place op (``aten.div_.Tensor`` -> ``aten.div.Tensor``)
    with the same arguments, or None."""
    found = _FUNCTIONAL.get(func, False)
    if found is False:
        found = None
        name = func._schema.name.split("::")[-1]
        packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") and not name.endswith("__") else None
        if packet is not None:
            # (the overload of the same name, else one of the same arguments: bernoulli_.float
            # -> bernoulli.p)
            names = [func._overloadname, *(o for o in packet.overloads() if o != func._overloadname)]
            a = func._schema.arguments
            for overload in names:
                candidate = getattr(packet, overload, None)
                if candidate is None:
                    continue
                b = candidate._schema.arguments
                same = len(a) == len(b) and all(
                    x.name == y.name and x.kwarg_only == y.kwarg_only and str(x.type) == str(y.type)
                    for x, y in zip(a, b)
                )
                returns = candidate._schema.returns
                if same and len(returns) == 1 and returns[0].alias_info is None:
                    found = candidate
                    break
        _FUNCTIONAL[func] = found
    return found


def _index(t: Any, ins: Any, index: dict) -> None:
    if isinstance(t, torch.Tensor):
        p = _ptr(t)
        if p:
            index.setdefault(p, []).append(ins)
