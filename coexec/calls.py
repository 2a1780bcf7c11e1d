"""Call templates: a torch-level call on a covered path issued without dispatching it.

While a step co-executes, each torch-level call goes down through PyTorch's dispatcher and comes
back to the skeleton as ATen ops (DESIGN.md §4), which are normalised, matched and issued one
at a time: for ``p.add_(g, alpha=-lr)`` in an optimizer, most of the Python the skeleton runs
is finding out again which ATen op the call makes. So the first time a call of a given kind
goes that way, the skeleton keeps what came out as a :class:`CallTemplate`; later calls of the
same kind are issued from it at the torch level: the op's arguments filled in from the call's,
matched against the TraceGraph, sent to the executor, with a placeholder only for what the call
returns. A call's kind (:class:`Signature`) is the torch function, the metadata of its tensors,
its other arguments, grad mode and the modes active; numbers that vary between calls (an
optimizer's step size) are taken from the call where the op took them unchanged, as learnt from
two calls that differed only there.

A template is used only where nothing but the op happens: one ATen op with no autograd (grad
mode off, or no tensor argument requires grad), no autocast, no inference mode, outside any
``try`` (whose ops run at once) and outside a backward; the result is new tensors the op made
or the call's own tensors (an in-place method returns ``self``), never a view (autograd makes
a view share its base's version counter, even under ``no_grad``). An in-place call moves the
version counter of the tensor it writes, as autograd would. A call the graph does not cover
falls back exactly: the op was not issued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tracegraph import NotCovered
from tracegraph.location import SUB
from tracegraph.schema import schema_of
from tracegraph.trace import OpKey, OpRecord

from .arguments import put, strip, tensor_slots
from .placeholder import Placeholder

if TYPE_CHECKING:
    from .skeleton import Skeleton

_FIRST_OP = ((SUB, 0),)
MISS = object()  # a call the templates do not issue: it goes through the dispatcher
MAX_TEMPLATES = 1 << 12  # distinct call kinds kept (sizes that vary without end: start again)
MAX_CAPTURES = 4  # calls of one kind looked at before giving up on a template for it

_PLAIN = frozenset({type(None), bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format})
_NUMBER = (int, float)


class Signature(NamedTuple):
    """What decides the ATen op a call makes: ``struct`` (hashable: the function's arguments
    with each tensor as its metadata and each number as its type), and the call's tensors
    and numbers in the order they appear."""

    struct: tuple
    tensors: list
    numbers: list


def signature(func: Any, args: tuple, kwargs: dict) -> Signature | None:
    """The call's signature, or None if an argument is not a tensor, a plain value or a
    list of those (an object whose effect on the call cannot be compared)."""
    struct: list = [func, torch.is_grad_enabled()]
    tensors: list = []
    numbers: list = []
    if not _walk(args, struct, tensors, numbers):
        return None
    for name, v in kwargs.items():
        struct.append(name)
        if not _walk_one(v, struct, tensors, numbers):
            return None
    return Signature(tuple(struct), tensors, numbers)


def needs_grad(args: tuple, kwargs: dict) -> bool:
    """Does a tensor among the call's arguments (not inside lists) require grad? Then, in
    grad mode, autograd acts on the call: no template (a quick test before the signature)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    for a in kwargs.values():
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return False


def _walk(items: Any, struct: list, tensors: list, numbers: list) -> bool:
    for v in items:
        if not _walk_one(v, struct, tensors, numbers):
            return False
    return True


def _walk_one(v: Any, struct: list, tensors: list, numbers: list) -> bool:
    t = type(v)
    if t is int or t is float:
        struct.append(t)
        numbers.append(v)
    elif isinstance(v, torch.Tensor):
        struct.append(_meta(v))
        tensors.append(v)
    elif t in _PLAIN:
        struct.append(v)
    elif t is tuple or t is list or t is torch.Size:
        struct.append((t, len(v)))
        return _walk(v, struct, tensors, numbers)
    else:
        return False
    return True


def _meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride() if t.layout == torch.strided else None, t.dtype, t.device, t.layout, t.requires_grad)


class _Result(NamedTuple):
    """Where an item of the call's result comes from: ``kind`` ``"out"`` (the op's output
    ``index``), ``"in"`` (the call's tensor ``index``) or ``"none"``."""

    kind: str
    index: int = 0


@dataclass(frozen=True, slots=True)
class CallTemplate:
    """The ATen op a kind of call makes, with what the recorder and executor need of it."""

    func: Any
    metas: tuple  # the op's tensor inputs' metadata (the signature fixes them)
    args: tuple  # the op's arguments as captured (tensors in place; overwritten per call)
    kwargs: tuple  # (name, value) pairs
    slots: tuple  # per op tensor input: (argument position or name, index in a list or -1)
    sources: tuple[int, ...]  # per op tensor input: which tensor of the call it is
    numbers: tuple  # the call's numbers as captured
    fed: tuple[tuple[int, Any, int], ...]  # (call number, op argument, index in a list or -1)
    fixed: tuple[int, ...]  # the call numbers that must be as captured
    writes: tuple[int, ...]
    out_alias: tuple
    n_returned: int
    out_struct: tuple
    out_metas: tuple
    out_bytes: tuple  # per output: its new storage's bytes (None: it shares an input's)
    written: tuple[tuple[int, int], ...]  # (output, op input) the op wrote in place
    unheld: tuple[int, ...]  # returned outputs no tensor of the call's result holds
    result: tuple[_Result, ...]
    result_type: Any  # None: a single item; tuple or list
    clean: bool  # every output is a new tensor
    keys: dict = field(default_factory=dict, compare=False)  # location -> OpKey (numbers as captured)


class _Entry:
    __slots__ = ("captures", "last", "template")

    def __init__(self) -> None:
        self.template: CallTemplate | None = None
        self.captures = 0
        self.last: CallTemplate | None = None  # the latest capture (fed numbers are learnt from two)


class CallTemplates:
    """Templates by call signature, process-wide: a call's ATen op depends on its arguments
    and torch's modes, not on the program or the step."""

    def __init__(self) -> None:
        self.by_struct: dict[tuple, _Entry] = {}
        self.plain: set = set()  # functions that answered with a Python value and no op

    def clear(self) -> None:
        self.by_struct.clear()
        self.plain.clear()

    def find(self, sig: Signature) -> tuple[CallTemplate | None, bool]:
        """The template for ``sig`` if its numbers fit it, and whether to capture this call."""
        entry = self.by_struct.get(sig.struct)
        if entry is None:
            return None, True
        t = entry.template
        if t is not None:
            numbers, captured = sig.numbers, t.numbers
            for i in t.fixed:
                if numbers[i] != captured[i]:
                    return None, entry.captures < MAX_CAPTURES
            return t, False
        return None, entry.captures < MAX_CAPTURES

    def learn(self, sig: Signature, made: CallTemplate | None) -> None:
        """A call with signature ``sig`` went through the dispatcher and made ``made`` (None:
        nothing a template can issue)."""
        by_struct = self.by_struct
        entry = by_struct.get(sig.struct)
        if entry is None:
            if len(by_struct) >= MAX_TEMPLATES:
                by_struct.clear()
            entry = by_struct[sig.struct] = _Entry()
        entry.captures += 1
        if made is None:
            entry.template = None
            return
        old = entry.template or entry.last
        entry.last = made
        entry.template = made if old is None else _merge(old, made)


def _merge(old: CallTemplate, new: CallTemplate) -> CallTemplate | None:
    """One template for two calls of one signature whose numbers differ, if the op took each
    differing number unchanged from one place in the call (an optimizer's step size), and the
    op is otherwise the same; else None."""
    if (old.func, old.slots, old.sources, old.writes, old.out_alias, old.result, old.out_metas) != (
        new.func, new.slots, new.sources, new.writes, new.out_alias, new.result, new.out_metas,
    ):  # fmt: skip
        return None  # (a number that sizes the output, say, is not fed: it makes another op)
    old_places, new_places = _number_places(old), _number_places(new)
    if set(old_places) != set(new_places):
        return None
    fed = {(f[1], f[2]): f[0] for f in old.fed}
    for i, (a, b) in enumerate(zip(old.numbers, new.numbers)):
        if a == b and type(a) is type(b):
            continue
        where = [p for p, v in old_places.items() if v == a and type(v) is type(a) and new_places[p] == b and type(new_places[p]) is type(b)]
        if len(where) != 1 or where[0] in fed:
            return None
        fed[where[0]] = i
    for p, v in old_places.items():
        if p not in fed and (new_places[p] != v or type(new_places[p]) is not type(v)):
            return None  # the op changed in a way no call number explains
    fed_numbers = set(fed.values())
    return CallTemplate(
        new.func, new.metas, new.args, new.kwargs, new.slots, new.sources, tuple(new.numbers),
        tuple((i, a, item) for (a, item), i in fed.items()),
        tuple(i for i in range(len(new.numbers)) if i not in fed_numbers),
        new.writes, new.out_alias, new.n_returned, new.out_struct, new.out_metas, new.out_bytes,
        new.written, new.unheld, new.result, new.result_type, new.clean,
    )  # fmt: skip


def _number_places(t: CallTemplate) -> dict:
    """The op's numbers by place: (argument position or name, index in a list or -1)."""
    places = {}
    for where, v in list(enumerate(t.args)) + list(t.kwargs):
        if type(v) in _NUMBER:
            places[(where, -1)] = v
        elif type(v) in (list, tuple):
            for j, x in enumerate(v):
                if type(x) in _NUMBER:
                    places[(where, j)] = x
    return places


TEMPLATES = CallTemplates()


# -- making a template ----------------------------------------------------------------------
def make_template(sk: Skeleton, sig: Signature, rec: OpRecord, issued: tuple, out: Any) -> CallTemplate | None:
    """The template of a call that went through the dispatcher and issued one op, ``rec``
    (``issued``: the op's function, arguments and node as the skeleton issued it), and
    returned ``out``; None if a template could not issue it as it ran."""
    func, args, kwargs, node = issued
    sch = schema_of(func)
    if rec.python_result or sch.data_dependent or sch.dynamic_shape or sch.inplace_view:
        return None
    if "py" in node.out_struct or torch._C._current_autograd_node() is not None:
        return None
    slots = tensor_slots(func, args, kwargs)
    if slots is None:
        return None
    by_id = {id(t): j for j, t in enumerate(sig.tensors)}
    sources = []
    for arg, item in slots:
        t = args[arg] if isinstance(arg, int) else kwargs[arg]
        if item >= 0:
            t = t[item]
        j = by_id.get(id(t))
        if j is None:
            return None  # a tensor the call made itself
        sources.append(j)
    if len(sources) != len(rec.inputs):
        return None
    vmap = sk.vmap
    outputs = rec.outputs
    result_type = None
    items = (out,)
    if type(out) in (tuple, list):
        result_type, items = type(out), out
    result = []
    for x in items:
        if x is None:
            result.append(_Result("none"))
        elif not isinstance(x, torch.Tensor):
            return None
        elif id(x) in by_id and vmap.get(x) in outputs:
            result.append(_Result("in", by_id[id(x)]))
        else:
            vid = vmap.get(x)
            if vid is None or vid not in outputs[: rec.n_returned]:
                return None
            if rec.out_alias[outputs.index(vid)] is not None:
                return None  # a view: autograd makes it one (its base, a shared version counter)
            result.append(_Result("out", outputs.index(vid)))
    trace = sk.trace
    values = trace.values
    out_bytes = tuple(
        trace.storage_bytes.get(values[v].storage) if a is None else None
        for v, a in zip(rec.outputs, rec.out_alias)
    )
    written = tuple(
        (k, a) for k, a in enumerate(rec.out_alias)
        if a is not None and (k >= rec.n_returned or a in rec.writes)
    )  # fmt: skip
    held = {k for k, _a in written} | {r.index for r in result if r.kind == "out"}
    return CallTemplate(
        func, rec.key.metas, tuple(strip(a) for a in args), tuple((k, strip(v)) for k, v in kwargs.items()),
        slots, tuple(sources), tuple(sig.numbers), (), tuple(range(len(sig.numbers))), rec.writes,
        rec.out_alias, rec.n_returned, rec.out_struct, tuple(values[v].meta for v in rec.outputs),
        out_bytes, written, tuple(k for k in range(rec.n_returned) if k not in held), tuple(result),
        result_type, all(a is None for a in rec.out_alias),
    )  # fmt: skip


# -- issuing a call from its template -------------------------------------------------------
def issue(sk: Skeleton, t: CallTemplate, sig: Signature, loc: Any) -> Any:
    """Issue the call ``sig`` made at ``loc`` from its template; its result, or :data:`MISS`
    if it must go through the dispatcher after all (the skeleton fell back to eager: the
    graph does not cover it, nothing was issued)."""
    tensors = sig.tensors
    trace = sk.trace
    index = len(trace.ops)
    loc = loc + _FIRST_OP  # as the recorder places the call's first (here: only) op
    value_of = sk.value_of
    inputs = tuple(value_of(tensors[j]) for j in t.sources)
    if sk.eager:  # meeting a parameter moved the step to another program, eagerly
        return MISS
    sk.note_first_use(index, [tensors[j] for j in t.sources])
    args, kwargs = list(t.args), dict(t.kwargs)
    copied: set = set()  # list arguments copied from the template before being filled in
    numbers = sig.numbers
    for i, arg, item in t.fed:
        put(args, kwargs, copied, arg, item, numbers[i])
    for (arg, item), j in zip(t.slots, t.sources):
        put(args, kwargs, copied, arg, item, tensors[j])
    captured = t.numbers
    fed_same = all(numbers[i] == captured[i] and type(numbers[i]) is type(captured[i]) for i, _a, _j in t.fed)
    key = t.keys.get(loc) if fed_same else None
    if key is None:
        attrs, _ts, _owner = schema_of(t.func).normalize(args, kwargs)
        key = OpKey.of(t.func, attrs, t.metas, loc)
        if fed_same:
            if len(t.keys) > 64:
                t.keys.clear()
            t.keys[loc] = key
    rec = OpRecord(index, key, inputs, (), t.writes, False, None, t.out_alias, t.n_returned, t.out_struct)
    try:
        node = sk.cursor.op(rec, lambda: sk.output_metas(t.func, args, kwargs))
    except NotCovered as e:
        sk.fall_back(e.reason)
        return MISS
    session = sk.session
    base, first = session.base, len(trace.values)
    moves = []
    for k, p in t.written:
        x = tensors[t.sources[p]]
        if isinstance(x, Placeholder) and x._session is session and x._real is None:
            moves.append((x, base + first + k))
    ins_args, ins_kwargs, refs = session.encode(args, kwargs)
    grad_mode = torch.is_grad_enabled()
    position = sk._issue(
        rec, node, t.func, ins_args, ins_kwargs, refs,
        tuple((base + x._vid, new) for x, new in moves), False, t.clean, grad_mode,
    )  # fmt: skip
    for x, new in moves:
        session.retarget(x, new - base, position)
    # as for any op the skeleton issues: the graph's, or a sized node's at this call's sizes:
    # the template's where its numbers are (the signature holds the tensors' sizes)
    out_metas = node.out_metas
    if node.sized:
        out_metas = t.out_metas if fed_same else sk.cursor.metas
    out_bytes = t.out_bytes if out_metas == t.out_metas else tuple(m.span_bytes for m in out_metas)
    sk.append_op(rec, out_metas, out_bytes)
    if sk.mirrors is not None and sk.mirrors.ready is rec:
        sk.mirrors.mirror(rec, t.func, args, kwargs, [tensors[j] for j in t.sources], first)
    vmap = sk.vmap
    written = []
    for k, p in t.written:
        x = tensors[t.sources[p]]
        vmap[x] = first + k
        written.append(x)
    if written:
        torch._C._increment_version(written)
    made: dict[int, Any] = {}
    items = []
    for r in t.result:
        if r.kind == "in":
            items.append(tensors[r.index])
        elif r.kind == "none":
            items.append(None)
        else:
            ph = made.get(r.index)
            if ph is None:
                vid = first + r.index
                ph = made[r.index] = session.new_placeholder(out_metas[r.index], vid, position)
                vmap[ph] = vid
            items.append(ph)
    for k in t.unheld:
        trace.released[first + k] = index + 1  # made and let go of by the call
        session.dropped.append(first + k)
    return items[0] if t.result_type is None else t.result_type(items)
