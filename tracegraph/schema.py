"""What the recorder needs to know about an ATen overload, read once from its schema.

For each overload: which arguments are tensors, which are plain values, which values may be
promoted to fed inputs when they vary between steps (numbers, never dtypes or strings), which
tensor arguments it writes, and whether it is random, data-dependent or has a data-dependent
output shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

TENSOR = "T"  # Tensor
OPT_TENSOR = "OT"  # Tensor?
TENSOR_LIST = "TL"  # Tensor[] / Tensor?[]
VALUE = "V"  # anything else


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name
        _MARKERS[name] = self

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple:
        # the same object after a copy or a pickle (plans are made in another process)
        return _marker, (self.name,)


_MARKERS: dict[str, _Marker] = {}


def _marker(name: str) -> _Marker:
    return _MARKERS[name]


DEFAULT = _Marker("DEFAULT")  # argument left at its schema default
TENSOR_ARG = _Marker("TENSOR")  # a tensor argument; its metadata is kept apart
# in a TraceGraph node's key, ``(GATHERED, n)``: a run of ``n`` of a tensor list's elements made
# by one node of a loop, one per iteration (``torch.stack(log_probs)``); a sized node takes any n
GATHERED = _Marker("GATHERED")


def is_gathered(x: Any) -> bool:
    """Is ``x`` a ``(GATHERED, n)`` element of a node key's tensor list?"""
    return type(x) is tuple and len(x) == 2 and x[0] is GATHERED

FED = _Marker("FED")  # a value promoted to a fed input

# ops whose output shape depends on the values of a CPU tensor argument (a packed sequence's
# lengths or batch sizes) without the dynamic_output_shape tag: with other lengths the graph's
# shapes were taken for this step's (a GRU over a packed sequence sliced past the data's end)
_SHAPE_FROM_CPU_DATA = frozenset({"aten::_pack_padded_sequence", "aten::_pad_packed_sequence"})

# Ops that mutate an argument their schema does not mark as written: (positions, condition).
# native_batch_norm updates running_mean/running_var in place when training=True.
_UNDECLARED_WRITES: dict[str, tuple[int, ...]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}


class TensorMeta(NamedTuple):
    """The metadata of a tensor that is part of an op key (DESIGN.md §3)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    layout: torch.layout
    stride: tuple[int, ...] | None
    requires_grad: bool
    # a lazy conjugate (1) or negation (2) view: dispatch resolves it before most ops, so a
    # stand-in without the bit runs other ops than eager (``z * z.conj()`` gave z * z)
    bits: int = 0

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        """The tensor's metadata, one object per distinct value: traces keep one per value
        and per op input, and a million small objects made each full garbage collection take
        0.7 s (see :data:`_METAS`)."""
        layout = t.layout
        stride = t.stride() if layout is _STRIDED else None
        bits = t.is_conj() | (t.is_neg() << 1)
        return TensorMeta.interned(_tuple_new(TensorMeta, (t.shape, t.dtype, t.device, layout, stride, t.requires_grad, bits)))

    @staticmethod
    def interned(meta: "TensorMeta") -> "TensorMeta":
        """The one object equal to ``meta``."""
        found = _METAS.get(meta)
        if found is None:
            if len(_METAS) >= _METAS_MAX:  # sizes that vary without end: start again
                _METAS.clear()
            found = _METAS[meta] = meta
        return found

    @property
    def nbytes(self) -> int:
        """Bytes the tensor's elements span (not its storage)."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def span_bytes(self) -> int:
        """Bytes a new tensor of this metadata spans: its layout's extent (a placeholder has no
        storage to ask; as ``recorder.storage_nbytes`` counts one)."""
        if any(s == 0 for s in self.shape):
            return 0
        if self.stride is None:
            return self.nbytes
        return (1 + sum((s - 1) * abs(st) for s, st in zip(self.shape, self.stride))) * self.dtype.itemsize

    def short(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}[{','.join(map(str, self.shape))}]"


_STRIDED = torch.strided
# every distinct TensorMeta made by TensorMeta.of, so equal ones are one object (immutable:
# sharing is safe; each field compares exactly, unlike a float attribute where 0.0 == -0.0)
_METAS: dict[TensorMeta, TensorMeta] = {}
_METAS_MAX = 1 << 16
_tuple_new = tuple.__new__


def _is_numeric(ty: Any) -> bool:
    if isinstance(ty, (torch.IntType, torch.FloatType, torch.BoolType, torch.NumberType)):
        return True
    if isinstance(ty, torch.SymIntType):
        return True
    if isinstance(ty, (torch.ListType, torch.OptionalType)):
        return _is_numeric(ty.getElementType())
    return False


def _kind(ty: Any) -> str:
    if isinstance(ty, torch.TensorType):
        return TENSOR
    if isinstance(ty, torch.OptionalType) and isinstance(ty.getElementType(), torch.TensorType):
        return OPT_TENSOR
    if isinstance(ty, torch.ListType):
        el = ty.getElementType()
        if isinstance(el, torch.OptionalType):
            el = el.getElementType()
        if isinstance(el, torch.TensorType):
            return TENSOR_LIST
    return VALUE


@dataclass(frozen=True)
class OpSchema:
    """Per-overload facts, computed once (see :func:`schema_of`)."""

    name: str
    arg_names: tuple[str, ...]
    kinds: tuple[str, ...]
    promotable: tuple[int, ...]  # positions whose numeric value may become a feed (a Tensor
    # position counts: Python numbers arrive there as such, e.g. ``x * lr``)
    writes: tuple[int, ...]  # argument positions the op mutates
    random: bool
    data_dependent: bool  # the result is a Python value read from tensor data
    dynamic_shape: bool  # the output shape depends on tensor data
    inplace_view: bool  # changes its argument's metadata (sizes, strides) in place
    # per schema return: the argument whose alias set it shares (a view, a written argument
    # returned), or None
    return_alias: tuple[int | None, ...] = ()

    def normalize(self, args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor], list[int]]:
        """Arguments in schema order: ``(attrs, tensors, arg_index_of_each_tensor)``.

        ``attrs`` holds every non-tensor argument as a hashable value (tensors are replaced by
        a marker, tensor lists by ``(marker, length)``); the tensors come out flattened.
        """
        attrs: list[Any] = []
        tensors: list[torch.Tensor] = []
        owner: list[int] = []
        n_pos = len(args)
        for i, name in enumerate(self.arg_names):
            if i < n_pos:
                v = args[i]
            else:
                v = kwargs.get(name, DEFAULT) if kwargs else DEFAULT
            kind = self.kinds[i]
            if kind == VALUE or not isinstance(v, (torch.Tensor, list, tuple)):
                # a Python number may stand for a Tensor argument (``x * 0.5``)
                attrs.append(hashable(v))
            elif kind == TENSOR_LIST:
                shape = []
                for t in v:
                    if isinstance(t, torch.Tensor):
                        shape.append(TENSOR_ARG)
                        tensors.append(t)
                        owner.append(i)
                    else:
                        shape.append(hashable(t))
                attrs.append(tuple(shape))
            else:
                attrs.append(TENSOR_ARG)
                tensors.append(v)
                owner.append(i)
        return tuple(attrs), tensors, owner


def list_spans(func: torch._ops.OpOverload, attrs: tuple) -> list[tuple[int, int, int]]:
    """Where each tensor-list argument's tensors are among an op's flattened tensor inputs:
    ``(argument position, first input, end)`` (see :meth:`OpSchema.normalize`)."""
    kinds = schema_of(func).kinds
    spans, at = [], 0
    for p, a in enumerate(attrs):
        if a is TENSOR_ARG:
            at += 1
        elif p < len(kinds) and kinds[p] == TENSOR_LIST and type(a) is tuple:
            n = sum(1 for x in a if x is TENSOR_ARG)
            spans.append((p, at, at + n))
            at += n
    return spans


_SCHEMAS: dict[torch._ops.OpOverload, OpSchema] = {}


def schema_of(func: torch._ops.OpOverload) -> OpSchema:
    s = _SCHEMAS.get(func)
    if s is None:
        s = _SCHEMAS[func] = _build(func)
    return s


def _build(func: torch._ops.OpOverload) -> OpSchema:
    sch = func._schema
    names, kinds, promotable, writes = [], [], [], []
    for i, a in enumerate(sch.arguments):
        names.append(a.name)
        kinds.append(_kind(a.type))
        if (kinds[-1] == VALUE and _is_numeric(a.type)) or kinds[-1] in (TENSOR, OPT_TENSOR):
            promotable.append(i)
        if a.alias_info is not None and a.alias_info.is_write:
            writes.append(i)
    writes.extend(p for p in _UNDECLARED_WRITES.get(sch.name, ()) if p not in writes)
    tags = set(func.tags)
    return OpSchema(
        name=f"{sch.name}.{sch.overload_name}" if sch.overload_name else sch.name,
        arg_names=tuple(names),
        kinds=tuple(kinds),
        promotable=tuple(promotable),
        writes=tuple(sorted(writes)),
        random=torch.Tag.nondeterministic_seeded in tags,
        data_dependent=torch.Tag.data_dependent_output in tags,
        dynamic_shape=torch.Tag.dynamic_output_shape in tags or sch.name in _SHAPE_FROM_CPU_DATA,
        inplace_view=torch.Tag.inplace_view in tags,
        return_alias=tuple(_aliased_argument(sch, r) for r in sch.returns),
    )


def _aliased_argument(sch: Any, ret: Any) -> int | None:
    info = ret.alias_info
    if info is None:
        return None
    for i, a in enumerate(sch.arguments):
        if a.alias_info is not None and a.alias_info.before_set == info.before_set:
            return i
    return None


def hashable(v: Any) -> Any:
    """A hashable, type-exact stand-in for a non-tensor argument.

    Numbers keep their type (``1``, ``1.0`` and ``True`` are equal in Python but not to an op).
    """
    t = type(v)
    if t is int or t is float or t is bool:
        return (t, v)
    if v is None or t is str or v is DEFAULT:
        return v
    if t is list or t is tuple:
        return tuple(hashable(x) for x in v)
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return v
    if isinstance(v, torch.Generator):
        return ("generator", str(v.device))
    if isinstance(v, (torch.UntypedStorage, torch.TypedStorage)):
        # by size, as a tensor by its metadata: each call makes a new Python object for the
        # same storage, and one does not pickle back (the planning process failed on it)
        return ("storage", v.device, v.nbytes())
    if isinstance(v, torch.ScriptObject):
        # (a process group the native capture passes to a collective: TorchScript objects hash
        # but do not compare)
        return ("script object", v._type().qualified_name())
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return hashable(v.node.pytype(v))  # pragma: no cover - no symbolic values in eager
    try:
        hash(v)
        return v
    except TypeError:
        return (t.__name__, repr(v))


def is_number_like(v: Any) -> bool:
    """True for a hashable() number or a tuple of them: the values a feed may carry."""
    if type(v) is tuple and len(v) == 2 and v[0] in (int, float, bool):
        return True
    if type(v) is tuple:
        return all(is_number_like(x) for x in v)
    return False
