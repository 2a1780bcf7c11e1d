"""Gradient blocks: ``loss.backward()`` on a covered path without the autograd engine.

While a step co-executes, autograd runs on placeholders: the engine walks its graph and every
gradient op comes back through the dispatch mode to be matched and issued one at a time
(DESIGN.md §4), costing as much Python per op as the forward, for ops the TraceGraph knows.
So the first covered step at a ``backward()`` call runs the engine as before and keeps what it
issued as a :class:`GradientBlock`, keyed by the exact ops the step ran before the call. A
later step that ran the same ops issues the block directly: no engine, no placeholders for
intermediate gradients, ``.grad`` bound to placeholders of the final ones.

What autograd does besides issuing ops is done here too, or the block is not used:

* saved tensors are held through saved-tensor hooks (:class:`SavedTensors`), so the ones the
  engine lets go of as it runs the backward are let go of at the same points, with autograd's
  in-place modification check;
* a block is made only where no Python ran inside the backward (tensor or module hooks, custom
  ``autograd.Function`` s, checkpointing: watched while the engine runs), and used only while
  the graph has no Python nodes, the parameters it reaches have no hooks, their ``.grad`` is
  empty or not as when the block was made, and the step registered no hooks and no
  ``retain_grad``.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch._library
import torch.utils._python_dispatch

import tracegraph
from executor import Free
from executor.engine_watch import WATCHES_ALL_THREADS, PythonWatch
from tracegraph.schema import TensorMeta, schema_of
from tracegraph.trace import OpKey, OpRecord

from .arguments import put, strip, tensor_slots
from .placeholder import Placeholder

if TYPE_CHECKING:
    from .skeleton import Session, Skeleton

# Devices whose backwards may run as blocks: CUDA only where the watch sees its engine thread.
# bench/cuda_gradient_blocks.py checks them bit-equal to eager on a GPU (docs/coexec.md).
BLOCK_DEVICES = frozenset({"cpu", "cuda"} if WATCHES_ALL_THREADS else {"cpu"})

# Where a gradient op's input comes from, in the step that issues the block.
SEG = 0  # a value the block made: ``a`` counts from the block's first value
OUT = 1  # output ``b`` of op ``a`` of the step
IN = 2  # input ``b`` of op ``a`` of the step (an external tensor)
GRAD = 3  # the ``.grad`` leaf ``a`` had before the backward


class Ref(NamedTuple):
    kind: int
    a: int
    b: int = 0


@dataclass(frozen=True, slots=True)
class GradientOp:
    """One op of a block, with its arguments less the tensors (``slots`` says where each
    input goes: argument position or name, and index in a tensor list or -1)."""

    key: OpKey
    node_id: int
    args: tuple
    kwargs: tuple  # (name, value) pairs
    slots: tuple
    inputs: tuple[Ref, ...]
    writes: tuple[int, ...]
    backward_of: int | None
    out_alias: tuple
    n_returned: int
    out_struct: tuple
    out_metas: tuple[TensorMeta, ...]
    out_bytes: tuple  # per output: its new storage's bytes (None: it shares an input's)
    moves: tuple[tuple[int, int], ...]  # (input position, output) written in place
    grad_mode: bool
    frees: tuple[int, ...]  # block values (SEG numbering) let go of after this op
    by_ref: tuple[bool, ...]  # per slot: the executor's value (else the tensor itself)


@dataclass(frozen=True, slots=True)
class LeafGrad:
    """A leaf the backward reaches: where the step first used it, what ``.grad`` it had,
    and the block value its ``.grad`` holds after."""

    first_use: tuple[int, int]
    grad_meta: TensorMeta | None  # of the ``.grad`` it had before (None: it had none)
    final: int


@dataclass(frozen=True, slots=True)
class GradientBlock:
    ops: tuple[GradientOp, ...]
    leaves: tuple[LeafGrad, ...]
    n_holders: int  # saved tensors held when the backward started
    # the ones of them the engine let go of after ``j`` of the block's ops, for each ``j``
    # from 0 to len(ops) (after the node that read each), for a replay to do the same
    release_after: tuple[tuple[int, ...], ...]

    @property
    def released(self) -> tuple[int, ...]:
        """The saved tensors the engine let go of."""
        return tuple(i for group in self.release_after for i in group)


_FREED = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time or if you need to access saved tensors after "
    "calling backward."
)


class _Saved:
    """A saved tensor as the graph holds it: the tensor (None once let go of), the tensor
    whose version counter autograd checks, and the version it had."""

    __slots__ = ("__weakref__", "src", "t", "version")

    def __init__(self, t: torch.Tensor | None, src: Any, version: int) -> None:
        self.t = t
        self.src = src
        self.version = version

    def modified(self) -> str | None:
        src = self.src() if isinstance(self.src, weakref.ref) else self.src
        if src is None or src._version == self.version:
            return None
        return (
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{TensorMeta.of(src).short()}] is at version {src._version}; "
            f"expected version {self.version} instead."
        )


def _unpack(h: _Saved) -> torch.Tensor:
    if h.t is None:
        raise RuntimeError(_FREED)
    why = h.modified()
    if why is not None:
        raise RuntimeError(why)
    return h.t


class SavedTensors:
    """Saved-tensor hooks for one recorded step (traced or co-executed: both record the same
    ops, and none of the ``detach`` autograd would issue for a saved output).

    A placeholder is saved as a new placeholder of the same value without its autograd
    history (the original saved as an output would hold its own node: a cycle that only
    backward breaks), so the executor keeps the value while the graph holds it; any other
    tensor as autograd keeps it. ``holders`` lists them in the order they were saved, which
    is the same in steps that ran the same ops.
    """

    def __init__(self, session: Session | None, suppress: Any, same_value: Any) -> None:
        self.session = session
        self.suppress = suppress  # runs a call unrecorded
        self.same_value = same_value  # records that a tensor is another's value
        self.holders: list[weakref.ref] = []
        self.installed = False

    def install(self) -> None:
        if torch._C._autograd._saved_tensors_hooks_is_enabled():
            # (the graph keeps the hooks of every tensor it saved: they must not keep the step)
            me = weakref.ref(self)
            torch._C._autograd._push_saved_tensors_default_hooks(lambda t: me().pack(t), _unpack)
            self.installed = True

    def remove(self) -> None:
        if self.installed:
            self.installed = False
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def pack(self, t: torch.Tensor) -> _Saved:
        if isinstance(t, Placeholder):
            session = self.session
            if t._session is session and t._real is None and session is not None:
                alias = session.alias(t)
            else:
                alias = Placeholder(TensorMeta.of(t), None, t._vid)
                alias._real = t.real_tensor()
            h = _Saved(alias, weakref.ref(t), t._version)
        elif t.grad_fn is not None:  # (not the tensor itself: a saved output would hold its node)
            d = self.suppress(t.detach)
            h = _Saved(d, d, t._version)
        else:
            h = _Saved(t, t, t._version)
        self.holders.append(weakref.ref(h))
        if h.t is not t:
            self.same_value(h.t, t)
        return h

    def alive(self) -> list[int]:
        return [i for i, ref in enumerate(self.holders) if ref() is not None]

    def releasable(self, which: tuple[int, ...]) -> bool:
        """Can the saved tensors ``which`` be let go of as the engine would after a
        backward? Not if one is gone, or was modified in place since it was saved (the
        engine raises then)."""
        holders = self.holders
        for i in which:
            h = holders[i]()
            if h is None or h.t is None or h.modified():
                return False
        return True

    def release(self, which: tuple[int, ...]) -> None:
        holders = self.holders
        for i in which:
            h = holders[i]()
            if h is not None:
                h.t = None


# -- what a backward reaches ----------------------------------------------------------------
def reached_leaves(root: Any) -> list[torch.Tensor] | None:
    """The leaves the graph from ``root`` accumulates into, in a fixed order; None if a node
    runs Python (a custom Function, a module's backward hook) or a leaf has hooks."""
    leaves: list[torch.Tensor] = []
    # (holds the nodes seen: a C++ node's Python wrapper lives only while referenced, and a
    # new one may take a freed one's address, and so its id)
    seen: dict[int, Any] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return None
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            if leaf._backward_hooks or getattr(leaf, "_post_accumulate_grad_hooks", None):
                return None
            leaves.append(leaf)
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return leaves


# Python the engine may run for coexec itself while it runs the backward over placeholders.
# Matched as path prefixes: a user's file in a folder that happens to be named coexec is theirs.
_OWN_FILES = tuple(
    os.path.join(os.path.dirname(m.__file__), "") if m.__file__.endswith("__init__.py") else m.__file__
    for m in (sys.modules[__package__], tracegraph, torch._compile, torch._library, torch.utils._python_dispatch, weakref)
)


# torch-level calls after which a step's backward runs Python the graph does not show
HOOK_CALLS = frozenset({
    torch.Tensor.register_hook, torch._C.TensorBase.retain_grad,
    torch.Tensor.register_post_accumulate_grad_hook,
})  # fmt: skip


MAX_BLOCKS_PER_CALL = 8  # blocks made at one backward() call (each capture watches the engine)
_UNSEEN = object()


class GradientBlocks:
    """A program's blocks by key (None where none can be made), and how many were made per
    ``backward()`` call site: where keys never repeat, capturing stops. Kept across steps,
    emptied when the program's graph changes (blocks name its nodes)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple, GradientBlock | None] = {}
        self.made: Counter = Counter()
        self.why_not: dict[Any, str] = {}  # per call site: why the latest call ran the engine
        self.refused: dict[tuple, str] = {}  # per key with no block: why none could be made

    def clear(self) -> None:
        self.by_key.clear()
        self.made.clear()
        self.why_not.clear()
        self.refused.clear()


class _Issued(NamedTuple):
    """An op as the skeleton issued it while a block was captured."""

    func: Any
    slots: tuple | None  # tensor_slots
    args: tuple  # without the tensors (arguments.strip)
    kwargs: tuple  # (name, value) pairs, without the tensors
    moves: tuple  # (old, new) trace value ids of the placeholders it wrote
    grad_mode: bool
    by_ref: tuple | None  # per slot: filled with the executor's value


class Backwards:
    """A skeleton step's ``backward()`` calls: each issues a known block, or runs the engine
    (and, the first time at a key, keeps what it issued as a block).

    ``blocks``: the program's (None for a step that uses none).
    """

    def __init__(self, skeleton: Skeleton, blocks: GradientBlocks | None) -> None:
        self.sk = skeleton
        self.blocks = blocks
        self.grad_modes: list[bool] = []  # per op issued: grad mode (Skeleton._issue)
        self.saved = SavedTensors(skeleton.session, skeleton.unrecorded, skeleton.same_value)
        self.hooked = False  # the step registered a hook or retain_grad
        self.capturing = False
        self._log: dict[int, _Issued] = {}
        self.replayed = 0

    def log(
        self, rec: OpRecord, func: Any, args: tuple, kwargs: dict, moves: list, refs: tuple,
        base: int, grad_mode: bool,
    ) -> None:
        """While capturing: op ``rec`` as ``Skeleton.execute`` issued it (``moves``: the
        placeholders it wrote, with their new executor value ids; ``refs``: the argument slots
        the executor filled with its own values)."""
        slots = tensor_slots(func, args, kwargs)
        filled = {(a, i) for a, i, _v in refs}
        self._log[rec.index] = _Issued(
            func, slots, tuple(strip(a) for a in args), tuple((k, strip(v)) for k, v in kwargs.items()),
            tuple((x._vid, new - base) for x, new in moves), grad_mode,
            tuple(s in filled for s in slots) if slots is not None else None,
        )  # fmt: skip

    def close(self) -> None:
        """The step ended: let go of it (the hooks and the skeleton refer to each other)."""
        self.sk = None
        self.saved.suppress = self.saved.same_value = None

    def backward(self, func: Any, args: tuple, kwargs: dict, loc: Any) -> Any:
        sk = self.sk
        why = self._engine_needed(args, kwargs)
        if why is not None:
            return self._on_engine(loc, why, func, args, kwargs)
        loss = args[0]
        ops, modes = sk.trace.ops, self.grad_modes
        if len(modes) != len(ops):
            return self._on_engine(loc, "ops issued outside the skeleton's count", func, args, kwargs)
        # the ops before, exactly where they may have built autograd nodes (a Python scalar
        # one saved is in its key); elsewhere without their scalars (an optimizer's step
        # size, say, changes every step and cannot change the backward)
        key = (
            loc, torch.is_grad_enabled(),
            tuple(op.key if g else (op.key.func, op.key.metas, op.key.loc) for op, g in zip(ops, modes)),
        )  # fmt: skip
        blocks = self.blocks
        block = blocks.by_key.get(key, _UNSEEN)
        if block is _UNSEEN and blocks.made[loc] < MAX_BLOCKS_PER_CALL:
            blocks.made[loc] += 1
            return self._capture(key, loss, func, args, kwargs, loc)
        if block is _UNSEEN:
            why = f"no block for the ops before it, after {MAX_BLOCKS_PER_CALL} blocks made here"
        elif block is None:
            why = blocks.refused.get(key, "no block could be made for the ops before it")
        elif self._replay(block, loss):
            self.replayed += 1
            return None
        else:
            why = "the gradients or saved tensors are not as when its block was made"
        return self._on_engine(loc, why, func, args, kwargs)

    def _engine_needed(self, args: tuple, kwargs: dict) -> str | None:
        """Why this ``backward()`` must run the engine whatever the ops before it (None: a
        block may do)."""
        sk = self.sk
        loss = args[0] if args else None
        if sk.eager:
            return "the step runs eagerly"
        if len(args) != 1 or any(v is not None and v is not False for v in kwargs.values()):
            return "backward() has arguments"
        if not isinstance(loss, Placeholder) or loss.grad_fn is None:
            return "the loss is not a tensor of this step with a gradient function"
        if loss.device.type not in BLOCK_DEVICES:
            why = "" if WATCHES_ALL_THREADS else " before Python 3.12 (Python in its engine thread is not seen)"
            return f"gradient blocks do not run on {loss.device.type}{why}"
        if self.hooked:
            return "the step called register_hook or retain_grad"
        if not self.saved.installed or sk.session.remat is not None:
            return "saved tensors are autograd's own (a memory budget)"
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return "torch.distributed is initialised"
        return None

    def _on_engine(self, loc: Any, why: str, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the autograd engine over the placeholders; ``why`` is kept for the program."""
        if self.blocks is not None:
            self.blocks.why_not[loc] = why
        return self.sk.call(func, args, kwargs, loc)

    # -- making a block -------------------------------------------------------------------
    def _capture(self, key: tuple, loss: Placeholder, func: Any, args: tuple, kwargs: dict, loc: Any) -> Any:
        sk = self.sk
        trace = sk.trace
        leaves = reached_leaves(loss.grad_fn)
        before = [leaf.grad for leaf in leaves] if leaves is not None else []
        b0, v0 = len(trace.ops), len(trace.values)
        held = self.saved.alive()
        n_holders = len(self.saved.holders)
        let_go: dict[int, int] = {}  # saved tensor -> ops of the backward issued when it went

        def watch_holder(i: int, h: _Saved | None) -> weakref.ref | None:
            return None if h is None else weakref.ref(h, lambda _r: let_go.setdefault(i, len(trace.ops) - b0))

        watchers = [watch_holder(i, self.saved.holders[i]()) for i in held]
        self.capturing, self._log = True, {}
        try:
            with PythonWatch(_OWN_FILES) as watch:
                out = sk.call(func, args, kwargs, loc)
        finally:
            self.capturing = False
        del watchers
        if leaves is None:
            made: GradientBlock | str = "the graph has a Python node (a custom Function) or a leaf with hooks"
        elif watch.seen is not None:
            made = f"Python ran in the backward: {watch.seen}"
        elif sk.eager:
            made = "the step fell back to eager in the backward"
        else:
            made = self._make(b0, v0, leaves, before, held, n_holders, let_go)
        self._log = {}
        if watch.blind:  # (a profiler ran: nothing was watched; the next step here tries again)
            self.blocks.made[loc] -= 1
            self.blocks.why_not[loc] = made
        elif isinstance(made, str):
            self.blocks.by_key[key] = None
            self.blocks.refused[key] = self.blocks.why_not[loc] = made
        else:
            self.blocks.by_key[key] = made
            self.blocks.why_not.pop(loc, None)
        return out

    def _make(
        self, b0: int, v0: int, leaves: list, before: list, held: list, n_holders: int, let_go: dict[int, int]
    ) -> GradientBlock | str:
        """The block of the ops the backward just issued, or why there is none."""
        sk = self.sk
        trace = sk.trace
        ops, values = trace.ops, trace.values
        first_use: dict[int, tuple[int, int]] = {}
        for op in ops[:b0]:
            for pos, v in enumerate(op.inputs):
                if values[v].producer is None:
                    first_use.setdefault(v, (op.index, pos))
        grad_of = {id(g): i for i, g in enumerate(before) if g is not None}

        def ref(v: int) -> Ref | None:
            value = values[v]
            if v >= v0:
                if value.producer is not None:
                    return Ref(SEG, v - v0)
                i = grad_of.get(id(sk.externals.get(v)))
                return Ref(GRAD, i) if i is not None else None
            if value.producer is not None:
                return Ref(OUT, value.producer, value.out_index)
            where = first_use.get(v)
            return Ref(IN, *where) if where is not None else None

        # the values Python holds after: the leaves' gradients, nothing else of the block
        alive = {vid - v0 for _t, vid in sk.vmap.items() if vid >= v0}
        finals = []
        for leaf in leaves:
            vid = sk.vmap.get(leaf.grad) if leaf.grad is not None else None
            use = sk.first_use.get(leaf)
            if vid is None or vid < v0 or use is None:
                return f"a leaf of shape {list(leaf.shape)} got no new gradient of this backward"
            finals.append(vid - v0)
        stray = sorted(alive - set(finals))
        if stray:
            made = ", ".join(sorted({ops[values[v0 + s].producer].name for s in stray if values[v0 + s].producer is not None}))
            return f"Python holds values of the backward other than the leaves' gradients (made by {made or 'nothing'})"
        moved: set[int] = set()
        last_use: dict[int, int] = {}
        block_ops = []
        for j, op in enumerate(ops[b0:]):
            issued = self._log.get(op.index)
            if issued is None or op.python_result:
                return f"{op.name} of the backward was not issued as an op of the skeleton"
            sch = schema_of(issued.func)
            inputs = tuple(ref(v) for v in op.inputs)
            if (
                sch.data_dependent or sch.dynamic_shape or issued.slots is None or None in inputs
                or len(issued.slots) != len(inputs)
            ):  # fmt: skip
                return f"{op.name} of the backward reads data, makes data-dependent shapes or reads a value from nowhere"
            for r in inputs:
                if r.kind == SEG:
                    last_use[r.a] = j
            for v in op.outputs:
                last_use.setdefault(v - v0, j)
            mv = []
            for old, new in issued.moves:
                mv.append((op.inputs.index(old), op.outputs.index(new)))
                if old >= v0:
                    moved.add(old - v0)
            out_bytes = tuple(
                trace.storage_bytes.get(values[v].storage) if a is None else None
                for v, a in zip(op.outputs, op.out_alias)
            )
            block_ops.append(GradientOp(
                op.key, sk.cursor.placed[op.index][0].id, issued.args, issued.kwargs, issued.slots,
                inputs, op.writes, op.backward_of, op.out_alias, op.n_returned, op.out_struct,
                tuple(values[v].meta for v in op.outputs), out_bytes, tuple(mv), issued.grad_mode,
                (), issued.by_ref,
            ))  # fmt: skip
        keep = set(finals) | moved
        frees: dict[int, list[int]] = {}
        for s, j in last_use.items():
            if s not in keep and values[v0 + s].producer is not None:
                frees.setdefault(j, []).append(s)
        for j, free in frees.items():
            block_ops[j] = replace(block_ops[j], frees=tuple(free))
        leaf_grads = tuple(
            LeafGrad(sk.first_use.get(leaf), TensorMeta.of(g) if g is not None else None, f)
            for leaf, g, f in zip(leaves, before, finals)
        )
        release_after: list[list[int]] = [[] for _ in range(len(block_ops) + 1)]
        for i in held:
            if self.saved.holders[i]() is None:  # the engine let go of it
                release_after[let_go.get(i, len(block_ops))].append(i)
        return GradientBlock(tuple(block_ops), leaf_grads, n_holders, tuple(map(tuple, release_after)))

    # -- issuing a block ------------------------------------------------------------------
    def _replay(self, block: GradientBlock, loss: Placeholder) -> bool:
        sk = self.sk
        session = sk.session
        leaves = reached_leaves(loss.grad_fn)
        if leaves is None or len(leaves) != len(block.leaves) or len(self.saved.holders) != block.n_holders:
            return False
        first_use = sk.first_use
        for leaf, lg in zip(leaves, block.leaves):
            g = leaf.grad
            if first_use.get(leaf) != lg.first_use:
                return False
            if (g is None) != (lg.grad_meta is None) or (g is not None and TensorMeta.of(g) != lg.grad_meta):
                return False
        if not self.saved.releasable(block.released):
            return False
        trace = sk.trace
        ops, values = trace.ops, trace.values
        base = session.base
        v0 = len(values)
        grads = [leaf.grad for leaf in leaves]
        made: dict[int, int] = {}  # block value -> position of the op that made it
        python: dict[int, torch.Tensor] = {}  # value -> the Python tensor holding it (.grad)
        release_after = block.release_after
        self.saved.release(release_after[0])
        for j, gop in enumerate(block.ops):
            index = len(ops)
            inputs = []
            for r in gop.inputs:
                if r.kind == SEG:
                    inputs.append(v0 + r.a)
                elif r.kind == OUT:
                    inputs.append(ops[r.a].outputs[r.b])
                elif r.kind == IN:
                    inputs.append(ops[r.a].inputs[r.b])
                else:
                    vid = sk.value_of(grads[r.a])
                    python[vid] = grads[r.a]
                    inputs.append(vid)
            inputs = tuple(inputs)
            rec = OpRecord(
                index, gop.key, inputs, (), gop.writes, False, gop.backward_of, gop.out_alias,
                gop.n_returned, gop.out_struct,
            )  # fmt: skip
            node = sk.cursor.op(rec, lambda: gop.out_metas)
            if node.id != gop.node_id:  # the graph matched as when the block was made
                raise AssertionError("coexec: a gradient block went off its graph")
            args, kwargs = list(gop.args), dict(gop.kwargs)
            copied: set = set()
            refs = []
            for (arg, item), vid, by_ref in zip(gop.slots, inputs, gop.by_ref):
                if by_ref:
                    refs.append((arg, item, base + vid))
                    continue
                t = python.get(vid)
                if t is None:
                    ext = _external(ops, values, vid)
                    if ext is None:  # a value Python read before (bound): the executor has it
                        refs.append((arg, item, base + vid))
                        continue
                    t = sk.externals[ext]
                put(args, kwargs, copied, arg, item, t.real_tensor() if isinstance(t, Placeholder) else t)
            first = len(values)
            moves = tuple((base + inputs[p], base + first + k) for p, k in gop.moves if gop.by_ref[p])
            clean = not gop.moves and gop.n_returned > 0
            position = sk._issue(rec, node, gop.key.func, args, kwargs, tuple(refs), moves, False, clean, gop.grad_mode)
            sk.append_op(rec, gop.out_metas, gop.out_bytes)
            outputs = rec.outputs
            for k in range(len(outputs)):
                made[first - v0 + k] = position
            for p, k in gop.moves:
                old = inputs[p]
                t = python.pop(old, None)
                # a value of the step before the block (a ``.grad`` an earlier backward of
                # the step made, written by this one): whichever tensors hold it now
                held = [t] if t is not None else [] if gop.inputs[p].kind == SEG else _holders(sk.vmap, old)
                for t in held:
                    python[outputs[k]] = t
                    sk.vmap[t] = outputs[k]
                    if isinstance(t, Placeholder) and t._session is session and t._real is None:
                        session.retarget(t, outputs[k], position)
            if gop.frees:
                for s in gop.frees:
                    trace.released[v0 + s] = index + 1
                session.submit(Free(tuple(base + v0 + s for s in gop.frees)))
            if release_after[j + 1]:
                self.saved.release(release_after[j + 1])
        for leaf, lg, g in zip(leaves, block.leaves, grads):
            if g is None:
                vid = v0 + lg.final
                ph = session.new_placeholder(values[vid].meta, vid, made[lg.final])
                sk.vmap[ph] = vid
                leaf.grad = ph
        dead = session.sweep()
        if dead:
            session.submit(Free(dead))
        return True


def _holders(vmap: Any, vid: int) -> list[torch.Tensor]:
    """The live tensors whose value is ``vid``."""
    return [t for t, v in vmap.items() if v == vid]


def _external(ops: list, values: list, vid: int) -> int | None:
    """The external value an in-place chain of ``vid`` started from (None: it started from
    an op's new tensor)."""
    while values[vid].producer is not None:
        op = ops[values[vid].producer]
        alias = op.out_alias[values[vid].out_index]
        if alias is None:
            return None
        vid = op.inputs[alias]
    return vid
