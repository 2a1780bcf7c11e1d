"""A trace: the ATen ops one training step executed, with their value flow.

A :class:`Trace` holds metadata only, never tensors, so keeping traces costs no device memory.
Every tensor the step touched is a :class:`Value`; values not produced by a recorded op are
external inputs (feed points). Where Python read tensor data is a :class:`Fetch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import torch

from .location import CODES, Location
from .schema import TensorMeta, schema_of

if TYPE_CHECKING:
    from .structure import Loop


class OpKey:
    """What makes two ops the same op (DESIGN.md §3): overload, non-tensor arguments, tensor
    metadata and executed location. The hash is computed once."""

    __slots__ = ("func", "attrs", "metas", "loc", "_hash")

    def __init__(
        self, func: torch._ops.OpOverload, attrs: tuple, metas: tuple[TensorMeta, ...], loc: Location
    ) -> None:
        self.func = func
        self.attrs = attrs
        self.metas = metas
        self.loc = loc
        self._hash = hash((func, attrs, metas, loc))

    @staticmethod
    def of(func: torch._ops.OpOverload, attrs: tuple, metas: tuple[TensorMeta, ...], loc: Location) -> "OpKey":
        """The key, one object per distinct key (see :data:`_KEYS`): an op in a loop makes an
        equal key every iteration, and a trace of many thousand keys, each with its tuples,
        made full garbage collections and pickling for the planning process slow."""
        key = OpKey(func, attrs, metas, loc)
        found = _KEYS.get(key)
        if found is None:
            if len(_KEYS) >= _KEYS_MAX:  # locations or values that vary without end: start again
                _KEYS.clear()
            found = _KEYS[key] = key
        return found

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # the hash is made again where the key is loaded (an op's hash is its address there)
        return OpKey, (self.func, self.attrs, self.metas, self.loc)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, OpKey) or self._hash != other._hash:
            return False
        return (
            self.func == other.func
            and self.attrs == other.attrs
            and self.metas == other.metas
            and self.loc == other.loc
        )

    def with_attrs(self, attrs: tuple) -> "OpKey":
        return OpKey(self.func, attrs, self.metas, self.loc)

    def __repr__(self) -> str:
        return f"OpKey({self.func}, at {CODES.describe(self.loc)})"


# every distinct OpKey made by OpKey.of. Equal keys are one op to the TraceGraph already
# (DESIGN.md §3), so sharing one object changes nothing a step runs: the executor takes
# arguments from the step, never from a key.
_KEYS: dict[OpKey, OpKey] = {}
_KEYS_MAX = 1 << 16


@dataclass(eq=False, slots=True)
class Value:
    """A tensor value: an op output (``producer`` is the op index) or an external input."""

    vid: int
    producer: int | None
    out_index: int
    meta: TensorMeta
    storage: int  # trace-local storage id: views and in-place results share their base's id

    @property
    def external(self) -> bool:
        return self.producer is None


@dataclass(eq=False, slots=True)
class OpRecord:
    index: int
    key: OpKey
    inputs: tuple[int, ...]  # value ids of the flattened tensor arguments
    outputs: tuple[int, ...]  # value ids of results, then of written arguments not returned
    writes: tuple[int, ...]  # positions in ``inputs`` the op mutates
    python_result: bool  # returns a Python value read from tensor data: a fetch
    backward_of: int | None  # for a gradient op: the forward op it differentiates
    out_alias: tuple[int | None, ...] = ()  # per output: position in ``inputs`` it shares storage with
    n_returned: int = 0  # outputs the op returned (the rest are written arguments)
    out_struct: tuple = ()  # per schema return: 1 a tensor, None an undefined one, n a list
    seconds: float = 0.0  # how long the op took when it ran eagerly (0 if it did not)

    @property
    def func(self) -> torch._ops.OpOverload:
        return self.key.func

    @property
    def name(self) -> str:
        return schema_of(self.key.func).name

    @property
    def is_backward(self) -> bool:
        from .location import BWD

        return any(c == BWD for c, _ in self.key.loc)

    @property
    def random(self) -> bool:
        return schema_of(self.key.func).random

    def __repr__(self) -> str:
        return f"#{self.index} {self.name} at {CODES.describe(self.key.loc)}"


@dataclass(eq=False, slots=True)
class Fetch:
    """Python read a tensor's data: ``kind`` is the API used (``item``, ``bool``, ``numpy``...)."""

    kind: str
    vid: int | None
    after: int  # number of ops recorded before the fetch
    loc: Location


Item = Union[int, Fetch, "Loop"]


@dataclass(eq=False)
class Trace:
    """The record of one step. Filled by :func:`tracegraph.record`."""

    ops: list[OpRecord] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    fetches: list[Fetch] = field(default_factory=list)
    externals: list[int] = field(default_factory=list)  # value ids, in order of first use
    storage_bytes: dict[int, int] = field(default_factory=dict)  # storage id -> its size
    alive_at_end: frozenset = frozenset()  # value ids whose tensors outlive the step
    # value id -> ops recorded when its tensor died (it was held through that op's position);
    # for each tensor, only its latest value (an in-place op moves a tensor to a new value)
    released: dict[int, int] = field(default_factory=dict)
    # ops issued inside a user's ``try`` whose ``except`` could catch their error: the
    # co-execution skeleton runs them synchronously (a sync point, like a fetch)
    in_try: set[int] = field(default_factory=set)
    # the ops ran on real tensors while recording (False for a co-execution skeleton's trace:
    # its op times are 0 and its storage sizes are layout spans, not allocations)
    computed: bool = True
    outside_loops: frozenset = frozenset()  # loops around the recording (see structure.py)
    status: str = "recording"  # recording | complete | failed
    error: BaseException | None = None
    _items: list[Item] | None = None

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def items(self) -> list[Item]:
        """The ops and fetches as a tree: loops grouped into :class:`~tracegraph.structure.Loop`."""
        if self._items is None:
            from .structure import build_items

            self._items = build_items(self)
        return self._items

    def __len__(self) -> int:
        return len(self.ops)

    def __reduce__(self) -> tuple:
        # as columns of ints with each distinct op key and metadata once (tracegraph/wire.py)
        from .wire import from_columns, to_columns

        return from_columns, (to_columns(self),)

    def __repr__(self) -> str:
        return (
            f"<Trace {self.status}: {len(self.ops)} ops, {len(self.externals)} external inputs, "
            f"{len(self.fetches) + sum(op.python_result for op in self.ops)} fetches>"
        )
