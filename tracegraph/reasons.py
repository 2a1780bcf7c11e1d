"""Why a step is not a path of the graph, in the user's terms (issue 14).

A non-mutating :class:`~tracegraph.graph.Cursor` raises :class:`NotCovered` where a step leaves
the graph. Its :class:`FallbackReason` says what differs from what the graph has at that point,
with the user's source line: a Python scalar or a size that varies, a new branch or loop, a step
that ends early. The message is built only on failure, so matching costs nothing more.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .location import BWD, CODES, Location
from .schema import DEFAULT, FED, TENSOR_ARG, is_gathered, is_number_like

if TYPE_CHECKING:
    from .graph import Cursor, Node, Region
    from .trace import OpRecord, Trace

# categories, with what each says about the step
SCALAR = "scalar"  # a Python number argument differs (a learning rate changed)
SHAPE = "shape"  # a size differs: a tensor's shape, or a size argument
TENSOR = "tensor"  # another dtype, device, layout or requires_grad
ARGUMENT = "argument"  # a non-numeric argument differs (a reduction mode)
DATAFLOW = "dataflow"  # the op reads another value than the graph's op there
CONTROL_FLOW = "control flow"  # another branch, or the step ends elsewhere
NEW_OP = "new op"  # code the graph has never run
LOOP = "loop"  # a new loop, or an iteration that ends elsewhere
FIRST = "first"  # the first trace of a program: nothing to compare with
OTHER = "other"  # reasons given by the runtime (an in-place view op, a caught error, ...)
UNTRACED = "untraced"  # a native step not traced took a path no traced step took


class FallbackReason(NamedTuple):
    """Why a step left the graph: a short ``category`` (see the constants above), the
    ``message`` a user reads, and the user's source line it happened at (``file.py:40``, or
    ``""`` when there is none)."""

    category: str
    message: str
    location: str


class NotCovered(Exception):
    """The op (or loop, or end of step) is not in the graph where the walk is. ``str(e)`` is
    the message; ``e.reason`` the :class:`FallbackReason`."""

    def __init__(self, reason: FallbackReason | str | None = None) -> None:
        if not isinstance(reason, FallbackReason):
            reason = FallbackReason(OTHER, reason or "the step left the graph", "")
        super().__init__(reason.message)
        self.reason = reason


def why_new(graph: Any, trace: "Trace") -> FallbackReason | None:
    """Why ``trace`` is not a path of ``graph`` (the first place it leaves it), or None when
    the graph covers it. Walks a non-mutating cursor: the graph is not changed."""
    from .graph import Cursor, _check_trace

    _check_trace(trace, "check")
    if not graph.root.nodes:
        return FallbackReason(FIRST, "the first trace: the graph was empty", "")
    try:
        Cursor(graph, trace, mutate=False).run()
    except NotCovered as e:
        return e.reason
    return None


# -- describing places ---------------------------------------------------------------------
def line_of(loc: Location) -> str:
    """``file.py:40``: the innermost frame of the user's code in a location."""
    real = [f for f in loc if f[0] > 0]
    user = [f for f in real if CODES.is_user_code(f[0])] or real
    if not user:
        return "<no python frame>"
    cid, off = user[-1]
    code = CODES.code(cid)
    if code is None:
        return "<?>"
    return f"{os.path.basename(code.co_filename)}:{CODES.line(cid, off)}"


def op_name(func: Any) -> str:
    """``aten::add_``: the operator without its overload name."""
    return func._schema.name


def op_at(func: Any, loc: Location) -> str:
    """``aten::mul at model.py:40``, or ``aten::mm in the backward of model.py:40``."""
    if any(c == BWD for c, _ in loc):
        return f"{op_name(func)} in the backward of {line_of(loc)}"
    return f"{op_name(func)} at {line_of(loc)}"


def _loop_line(key: tuple) -> str:
    prefix, cid, header = key
    return line_of(prefix + ((cid, header),))


def node_at(node: "Node") -> str:
    """A node as a user reads it: its op and line, a loop's line, or where a region starts."""
    if node.kind == "op":
        return op_at(node.key.func, node.key.loc)
    if node.kind == "loop":
        return f"the loop at {_loop_line(node.key)}"
    owner = node.region.owner
    if node.kind == "start":
        return "the start of the step" if owner is None else (
            f"the start of an iteration of the loop at {_loop_line(owner.key)}"
        )
    if node.kind == "end":
        return "the end of the step" if owner is None else "the end of the iteration"
    return str(node.label)


def _onward(region: "Region", cur: "Node") -> str:
    """Where the graph goes after ``cur``: up to three successors."""
    nxt = region.succ[cur]
    if not nxt:
        return "the graph has nothing after it"
    names = [node_at(n) for n in nxt[:3]] + (["..."] if len(nxt) > 3 else [])
    return "the graph goes on to " + " or ".join(names)


def _show(v: Any) -> str:
    """A non-tensor argument as its Python value (see ``schema.hashable``)."""
    if type(v) is tuple and len(v) == 2 and v[0] in (int, float, bool):
        return repr(v[1])
    if v is TENSOR_ARG:
        return "a tensor"
    if v is DEFAULT:
        return "its default"
    if v is FED:
        return "a fed value"
    if is_gathered(v):
        return f"{v[1]} from a loop"
    if type(v) is tuple:
        if len(v) > 2 and all(x is TENSOR_ARG for x in v):
            return f"a list of {len(v)} tensors"
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return repr(v)


def _tensor_list(v: Any) -> bool:
    return type(v) is tuple and bool(v) and all(x is TENSOR_ARG or is_gathered(x) for x in v)


def _show_meta(field: str, v: Any) -> str:
    if field in ("shape", "stride"):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v).replace("torch.", "")


def _and(items: list[str], most: int = 3) -> str:
    """``a, b and c``; past ``most`` items, the latest ones and how many more."""
    seen = list(dict.fromkeys(items))
    if len(seen) > most:
        return ", ".join(seen[-most:]) + f" and {len(seen) - most} more"
    return seen[0] if len(seen) == 1 else ", ".join(seen[:-1]) + " and " + seen[-1]


# -- the reasons ---------------------------------------------------------------------------
def _never_fails(fn: Callable[..., FallbackReason]) -> Callable[..., FallbackReason]:
    """A reason is built inside the step it explains (a co-executed op that left the graph):
    a bug here must not become the user's error."""

    @functools.wraps(fn)
    def wrapper(*args: Any) -> FallbackReason:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            return FallbackReason(OTHER, f"the step left the graph ({fn.__name__}: {e!r})", "")

    return wrapper


class _Diff(NamedTuple):
    kind: str  # "attr" | "meta" | "source"
    pos: int
    field: str  # meta field name ("" otherwise)
    mine: Any
    theirs: Any


_META_FIELDS = ("shape", "dtype", "device", "layout", "stride", "requires_grad")


def _first_diff(
    cursor: "Cursor", node: "Node", rec: "OpRecord", srcs: tuple, ctx: tuple
) -> _Diff | None:
    for p, (a, b) in enumerate(zip(node.key.attrs, rec.key.attrs)):
        if p not in node.promoted and a != b:
            return _Diff("attr", p, "", b, a)
    for i, (m, n) in enumerate(zip(node.key.metas, rec.key.metas)):
        if m != n:
            for field in _META_FIELDS:
                if getattr(m, field) != getattr(n, field):
                    return _Diff("meta", i, field, getattr(n, field), getattr(m, field))
    for i, (alts, s) in enumerate(zip(node.sources, srcs)):
        if not cursor.resolves(alts, s, ctx):
            return _Diff("source", i, "", s, alts)
    return None


@_never_fails
def op_reason(
    cursor: "Cursor", region: "Region", cur: "Node", rec: "OpRecord", srcs: tuple, ctx: tuple
) -> FallbackReason:
    """Why ``rec`` matches no successor of ``cur``: what differs from the graph's op at the
    same line, or the branch it takes."""
    func, loc = rec.key.func, rec.key.loc
    where = line_of(loc)
    here = [
        c for c in region.succ[cur] if c.kind == "op" and c.key.func == func and c.key.loc == loc
    ]
    diffs = [(c, _first_diff(cursor, c, rec, srcs, ctx)) for c in here]
    diffs = [(c, d) for c, d in diffs if d is not None]
    if diffs:
        node, d = diffs[0]
        theirs = [x.theirs for _, x in diffs if x[:3] == d[:3]]
        return _phrase(cursor, rec, node, d, theirs, where)
    prev = node_at(cur)
    onward = _onward(region, cur)
    seen = any(n.kind == "op" and n.key.func == func and n.key.loc == loc for n in cursor.g.nodes())
    if seen:
        msg = f"a new branch at {where}: {op_name(func)} after {prev}; {onward} (control flow)"
        return FallbackReason(CONTROL_FLOW, msg, where)
    msg = f"a new op at {where}: {op_name(func)} after {prev}; {onward} (code not run before)"
    return FallbackReason(NEW_OP, msg, where)


def _what_varies(mine: tuple, theirs: list) -> str:
    """A shape (or a size argument, in its hashable form) the graph has at other sizes: "a
    size", or "a rank" where their lengths differ (sized nodes follow sizes, not ranks)."""
    return "a rank" if {len(t) for t in theirs} != {len(mine)} else "a size"


def _phrase(
    cursor: "Cursor", rec: "OpRecord", node: "Node", d: _Diff, theirs: list, where: str
) -> FallbackReason:
    func = rec.key.func
    op = op_at(func, rec.key.loc)
    if d.kind == "attr":
        arg = func._schema.arguments[d.pos]
        head = f"argument {d.pos} ({arg.name}) of {op} was {_show(d.mine)}, "
        tail = f"the graph has {_and([_show(t) for t in theirs])}"
        if is_number_like(d.mine) and is_number_like(d.theirs):
            if _is_size(cursor, rec, node, arg.name):
                return FallbackReason(SHAPE, head + tail + f" ({_what_varies(d.mine, theirs)} that varies)", where)
            return FallbackReason(SCALAR, head + tail + " (a Python scalar that varies)", where)
        if _tensor_list(d.mine) and all(_tensor_list(t) for t in theirs):
            # (torch.stack of a list whose length is an episode's: one graph does not follow it)
            return FallbackReason(SHAPE, head + tail + " (the length of a list of tensors that varies)", where)
        return FallbackReason(ARGUMENT, head + tail + " (an argument that varies)", where)
    if d.kind == "meta":
        value = cursor.t.values[rec.inputs[d.pos]]
        if value.producer is not None and value.producer < len(cursor.t.ops):
            made = cursor.t.ops[value.producer]
            what = f"tensor input {d.pos} of {op}, made by {op_at(made.key.func, made.key.loc)},"
        else:
            what = f"tensor input {d.pos} of {op}, a tensor from outside the step,"
        mine = _show_meta(d.field, d.mine)
        tail = f"the graph has {_and([_show_meta(d.field, t) for t in theirs])}"
        if d.field == "shape":
            msg = f"{what} has shape {mine}, {tail} ({_what_varies(d.mine, theirs)} that varies)"
            return FallbackReason(SHAPE, msg, where)
        return FallbackReason(
            TENSOR, f"{what} has {d.field} {mine}, {tail} (a tensor property that varies)", where
        )
    mine = _source_at(cursor, d.mine)
    alts = _and([_source_at(cursor, a) for alts in theirs for a in alts])
    msg = f"tensor input {d.pos} of {op} is {mine}, the graph has {alts} (another value flows in)"
    return FallbackReason(DATAFLOW, msg, where)


def _is_size(cursor: "Cursor", rec: "OpRecord", node: "Node", name: str) -> bool:
    """Does the differing argument ``name`` change sizes? When the op's outputs are known (a
    recorded trace): do their shapes differ from the node's. Else (an op not run yet): is it
    a size in the schema (``SymInt``, ``SymInt[]``), other than an ``index``."""
    if rec.outputs:
        shapes = tuple(cursor.t.values[v].meta.shape for v in rec.outputs)
        return shapes != tuple(m.shape for m in node.out_metas)
    found = re.search(rf"SymInt[^ ,]* {re.escape(name)}\b", str(rec.key.func._schema))
    return found is not None and name != "index"


def _source_at(cursor: "Cursor", src: tuple) -> str:
    kind = src[0]
    if kind == "ext":
        return "a tensor from outside the step"
    if kind == "enter":
        return "a value from an earlier iteration or from before the loop"
    nid = src[1] if kind == "node" else src[2]
    node = cursor.g._by_id.get(nid)
    desc = node_at(node) if node is not None else f"node {nid}"
    return f"the result of {desc}" + (" (inside a loop)" if kind == "loop" else "")


@_never_fails
def loop_reason(region: "Region", cur: "Node", key: tuple) -> FallbackReason:
    """Why a loop starting here is not in the graph: the graph has no loop there."""
    where = _loop_line(key)
    msg = f"a new loop at {where} after {node_at(cur)}; {_onward(region, cur)} (a loop)"
    return FallbackReason(LOOP, msg, where)


@_never_fails
def end_reason(region: "Region", cur: "Node") -> FallbackReason:
    """Why the step (or a loop's iteration) cannot end after ``cur``: the graph goes on."""
    where = line_of(cur.key.loc) if cur.kind == "op" else ""
    onward = _onward(region, cur)
    if region.owner is None:
        msg = f"the step ended after {node_at(cur)}; {onward} (control flow)"
        return FallbackReason(CONTROL_FLOW, msg, where)
    lp = _loop_line(region.owner.key)
    msg = f"an iteration of the loop at {lp} ended after {node_at(cur)}; {onward} (a loop)"
    return FallbackReason(LOOP, msg, where or lp)
