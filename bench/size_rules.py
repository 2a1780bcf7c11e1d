"""Could the native backend's cache answer a new size without running the op? (issue 17)

    python bench/size_rules.py [--programs transformer_random_length,reinforce] [--steps 60] [--fuzz 60]

The capture's cache (``executor/native/capture_cache.h``) answers an op at a Python line from an
earlier call with the same input metadata and arguments; a size it has not met among the last 16
there runs at once, as eager (a transformer whose length is drawn per step ran 45% of its ops at
once over 60 steps). Issue 17 asks that sizes be symbols bound per step, decided from the first
two distinct sizes. This measures, before building it, how far the simplest such rule reaches:
each int of an op's output metadata (every size, stride and the offset) is, in every call seen
so far at that op and line, either

* a constant, or
* one int of the inputs' metadata (a size, stride or offset of a tensor argument) or a product
  a view makes of them (a tensor's number of elements, a size times its stride, a run of
  sizes), or
* one int among the non-tensor arguments (a view's shape, a slice's end), or
* for a stride: the contiguous stride of the output's sizes, or the stride of a dense tensor of
  those sizes laid out in the order of one input's strides.

A rule keeps every hypothesis consistent with all calls seen; it answers a new call only where
every input int that differs from the calls seen has changed among them before (an int never
seen to change has an unknown effect: ``view(-1)``'s output size, the product of its input's,
stayed 48 while only the input's offset changed) and the hypotheses left agree on every int
(so it never guesses between two). Per program, after ``--warm-up``
steps: the ops a cache of every variant ever seen would answer ("cached"), those a rule answers
("by rule") and how often its answer was the op's real metadata ("right", "wrong"), and those
neither answers ("left"). The ops are recorded eagerly under a ``TorchDispatchMode``, at the
ATen level the capture sees, keyed by op, the first frame outside torch, and the op's count at
that key in the step. ``--fuzz N`` adds the fuzzer's first N programs (8 steps each, rules shared
across them as the process's one capture shares its cache: the interpreter's lines are the
same), a harsher test: there the rule answered wrong 43 times in 51,486 (2026-11-27), at a
broadcasting ``mul`` (``[3, 16] * [3, 1]``: the output's size followed the second input in every
call seen, which is not a rule) and at ``slice``. A wrong answer is a shape Python has already
seen, so rules are not in the capture yet: issue 17's note says what they need.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, prepare  # noqa: E402
from examples.dynamic_programs import DYNAMIC_BY_NAME  # noqa: E402

_TORCH = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class Call:
    """One op call: its input ints by name, its arguments' key without sizes, its output ints."""

    ins: dict  # ("in", k, field, d) or ("arg", i, j) -> int
    shape_key: tuple  # dtypes, ranks, non-int arguments: what a rule may not vary over
    exact_key: tuple  # everything (a cache's key)
    outs: tuple  # per output tensor: (sizes, strides, offset)


def _metas(args) -> list[torch.Tensor]:
    return [x for x in tree_leaves(list(args)) if isinstance(x, torch.Tensor)]


def call_of(args, result) -> Call:
    ins, shape, exact = {}, [], []
    for k, t in enumerate(_metas(args)):
        for d, v in enumerate(t.shape):
            ins[("in", k, "size", d)] = v
        for d, v in enumerate(t.stride()):
            ins[("in", k, "stride", d)] = v
        ins[("in", k, "offset", 0)] = t.storage_offset()
        shape.append(("t", t.dtype, t.dim()))
        exact.append(("t", t.dtype, tuple(t.shape), t.stride(), t.storage_offset()))
    for k, t in enumerate(_metas(args)):  # (products a view makes: numel, size*stride, runs of sizes)
        sizes, strides = tuple(t.shape), t.stride()
        for d in range(len(sizes)):
            ins[("size*stride", k, d)] = sizes[d] * strides[d]
        ins[("numel", k)] = t.numel()
        for a in range(len(sizes)):
            for b in range(a + 2, len(sizes) + 1):
                if (a, b) != (0, len(sizes)):
                    ins[("run", k, a, b)] = int(torch.tensor(sizes[a:b]).prod())
    for i, a in enumerate(args):
        if isinstance(a, bool) or not isinstance(a, (int, list, tuple)):
            if not isinstance(a, torch.Tensor):
                shape.append(("c", repr(a) if not isinstance(a, float) else "float"))
                exact.append(("c", repr(a)))
            continue
        items = [a] if isinstance(a, int) else list(a)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            for j, x in enumerate(items):
                ins[("arg", i, j)] = x
            shape.append(("ints", len(items)))
            exact.append(("ints", tuple(items)))
    results = result if isinstance(result, (tuple, list)) else (result,)
    outs = tuple(
        (tuple(r.shape), r.stride(), r.storage_offset()) for r in results if isinstance(r, torch.Tensor)
    )
    shape.append(("outs", tuple((r.dtype, r.dim()) for r in results if isinstance(r, torch.Tensor))))
    return Call(ins, tuple(shape), tuple(exact), outs)


def contiguous(sizes) -> tuple:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def dense_like(sizes, strides_of_input) -> tuple | None:
    """Strides of a dense tensor of ``sizes`` laid out in the order of ``strides_of_input``."""
    if len(sizes) != len(strides_of_input):
        return None
    order = sorted(range(len(sizes)), key=lambda d: (strides_of_input[d], -d))
    out, acc = [0] * len(sizes), 1
    for d in order:
        out[d] = acc
        acc *= max(sizes[d], 1)
    return tuple(out)


@dataclass
class Rule:
    """Per output int, the hypotheses still consistent with every call seen at one key."""

    calls: list = field(default_factory=list)

    def hypotheses(self, call: Call, o: int, part: str, d: int) -> set:
        """What ``call``'s output ``o`` ``part`` ``d`` equals, among the hypotheses."""
        sizes, strides, offset = call.outs[o]
        value = {"size": sizes, "stride": strides, "offset": (offset,)}[part][d]
        hs = {("const", value)} | {src for src, v in call.ins.items() if v == value}
        if part == "stride":
            if contiguous(sizes)[d] == value:
                hs.add(("contiguous",))
            for k in {src[1] for src in call.ins if src[0] == "in"}:
                ins = [call.ins[("in", k, "stride", i)] for i in range(len(sizes)) if ("in", k, "stride", i) in call.ins]
                like = dense_like(sizes, ins)
                if like is not None and like[d] == value:
                    hs.add(("dense_like", k))
        return hs

    def predict(self, call: Call) -> tuple | None:
        """The outputs' ints as the rule says for ``call``, or None where it cannot say."""
        if len({c.ins.keys().__len__() for c in self.calls}) != 1 or len(self.calls) < 2:
            return None
        first = self.calls[0]
        varied = {src for src, v in first.ins.items() if any(c.ins[src] != v for c in self.calls[1:])}
        if any(v != first.ins[src] and src not in varied for src, v in call.ins.items()):
            return None  # (an int that never changed here changes now: its effect is unknown)
        outs = []
        for o, (sizes, strides, _) in enumerate(first.outs):
            got = {"size": [], "stride": [], "offset": []}
            for part, n in (("size", len(sizes)), ("offset", 1), ("stride", len(strides))):
                for d in range(n):
                    keep = set.intersection(*(self.hypotheses(c, o, part, d) for c in self.calls))
                    answers = set()
                    for h in keep:
                        if h[0] == "const":
                            answers.add(h[1])
                        elif h[0] == "contiguous":
                            answers.add(contiguous(got["size"])[d])
                        elif h[0] == "dense_like":
                            ins = [call.ins.get(("in", h[1], "stride", i)) for i in range(len(sizes))]
                            like = None if None in ins else dense_like(got["size"], ins)
                            if like is None:
                                return None
                            answers.add(like[d])
                        else:  # (one of the call's ints)
                            if h not in call.ins:
                                return None
                            answers.add(call.ins[h])
                    if len(answers) != 1:
                        return None
                    got[part].append(answers.pop())
            outs.append((tuple(got["size"]), tuple(got["stride"]), got["offset"][0]))
        return tuple(outs)


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.count: dict = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        f = sys._getframe(1)
        while f is not None and (f.f_code.co_filename.startswith(_TORCH) or f.f_code.co_filename == __file__):
            f = f.f_back
        where = (f.f_code.co_filename, f.f_lineno) if f is not None else None
        n = self.count[(func, where)]
        self.count[(func, where)] += 1
        flat = list(args) + list((kwargs or {}).values())
        self.calls.append(((func, where, n), call_of(flat, result)))
        return result


class Tally:
    """Rules learned over a run of steps (kept across programs where they share lines, as the
    process's one capture keeps its cache), and what they answered."""

    def __init__(self, label: str) -> None:
        self.rules: dict = defaultdict(Rule)
        self.seen: set = set()
        self.row = {"program": label, "ops": 0, "cached": 0, "by rule": 0, "right": 0, "wrong": 0, "left": 0}
        self.wrong: dict = defaultdict(int)  # op -> wrong answers

    def step(self, run, counted: bool) -> None:
        rec = Recorder()
        with rec:
            run()
        row = self.row
        for key, call in rec.calls:
            rule = self.rules[(key, call.shape_key)]
            if counted:
                row["ops"] += 1
                if (key, call.exact_key) in self.seen:
                    row["cached"] += 1
                else:
                    guess = rule.predict(call)
                    if guess is None:
                        row["left"] += 1
                    else:
                        row["by rule"] += 1
                        row["right" if guess == call.outs else "wrong"] += 1
                        if guess != call.outs:
                            self.wrong[str(key[0])] += 1
            self.seen.add((key, call.exact_key))
            rule.calls.append(call)
            del rule.calls[:-8]  # (the latest calls: enough to keep hypotheses honest)

    def result(self) -> dict:
        row, n = self.row, self.row["ops"]
        for k in ("cached", "by rule", "left"):
            row[f"{k} %"] = 100 * row[k] / n if n else 0.0
        row["wrong answers"] = ", ".join(f"{op} {n}" for op, n in sorted(self.wrong.items(), key=lambda x: -x[1])[:4])
        return row


def measure(name: str, steps: int, warm_up: int) -> dict:
    program = DYNAMIC_BY_NAME[name](0)
    tally = Tally(name)
    for i in range(steps):
        tally.step(lambda: program.step(i), i >= warm_up)
    return tally.result()


def measure_fuzz(programs: int, steps: int) -> dict:
    """The fuzzer's programs, eagerly (``coexec/fuzz``): many ops at the interpreter's few lines,
    at sizes drawn per program (a stricter test of a rule than a model's steps)."""
    from coexec.fuzz import generate
    from coexec.fuzz.runner import run_once

    tally = Tally(f"fuzz seeds 0-{programs - 1}")
    for seed in range(programs):
        spec = generate(seed, None)

        def run() -> None:
            try:
                run_once(spec, steps, False)
            except Exception:  # noqa: BLE001 - a program that fails eagerly too (the fuzzer's own)
                pass

        tally.step(run, True)
    return tally.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default=",".join(DYNAMIC_BY_NAME))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warm-up", type=int, default=3)
    ap.add_argument("--fuzz", type=int, default=0, help="also the fuzzer's first N programs, 8 steps each")
    args = ap.parse_args()
    prepare(1)
    rows = [measure(name, args.steps, args.warm_up) for name in args.programs.split(",")]
    if args.fuzz:
        rows.append(measure_fuzz(args.fuzz, 8))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
