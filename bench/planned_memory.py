"""Is the planned memory what runs? The zoo co-executed in its planned order, against eager.

    python bench/planned_memory.py [--models resnet18,mlp] [--batches 1,32] [--pairs 7] [--out bench/out]

Per zoo model and batch size, copies of the model from the same seed train side by side in one
process, each drawing from its own random stream: one eagerly, one under
``coexec.GradientTape(backend="interpret")`` (no budget: the planned order and the arena), one
without a plan. After the coexec run's plan has arrived (``coexec.wait_for_plans``), they take
``--pairs`` steps in turn. Columns:

* ``eager MB``: eager PyTorch's resident peak of one step, persistent state included
  (``planner.tracker.eager_peak``, the live-storage tracker);
* ``planned MB``: the Schedule's peak for the path the step took (the simulator: the planned
  order, persistent state and the whole arena);
* ``measured MB``: the executor's count of its live storages during the co-executed step plus
  the persistent state (``TapeStats.peak_bytes``; the arena counts whole);
* ``vs planned``: measured / planned; ``reduction``: 1 - measured / eager;
* ``frag %``: the arena's bytes over the most its storages hold at once, minus 1;
* ``eager ms``: the median eager step; ``coexec/eager``: the median of the paired ratios;
* ``unplanned/eager``, ``unplanned MB``: a third copy under ``GradientTape(backend="interpret",
  arena=False)``, the runtime without a plan (ops run as issued, every output from the
  allocator), in the same pairs: what the plan costs or saves in time, side by side;
* ``ran ahead %``: of the co-executed step's deferred ops, the share the executor ran before
  their block was complete (as the skeleton issued them); ``waits issue/bytes/region``: the ops
  at which running ahead stopped, because the plan's next op was not issued yet, because it
  would have gone over the block's bound, or because its arena region was still held
  (``TapeStats.run_ahead``);
* ``bit-equal``: parameters and losses of the two copies after the run.

Prints a Markdown table and a summary, and writes ``planned_memory.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import OwnRandomStream, markdown_table  # noqa: E402
from examples.models import ZOO  # noqa: E402
from planner.tracker import eager_peak  # noqa: E402

MB = 1e6


def timed(step) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    loss = step()
    return time.perf_counter() - t0, loss


def measure(name: str, batch: int, pairs: int) -> dict:
    eager, co, unplanned = ZOO[name](batch), ZOO[name](batch), ZOO[name](batch)
    tape = coexec.GradientTape(backend="interpret", key=("planned-memory", name, batch))
    loose = coexec.GradientTape(
        backend="interpret", key=("planned-memory", name, batch, "unplanned"), arena=False
    )
    eager.step = OwnRandomStream()(eager.step)
    own = OwnRandomStream()

    @own
    def coexec_step() -> torch.Tensor:
        with tape:
            return co.step()

    @OwnRandomStream()
    def unplanned_step() -> torch.Tensor:
        with loose:
            return unplanned.step()

    losses_e, losses_c = [], []
    for _ in range(3):  # traced, traced (momentum appears), covered
        losses_e.append(eager.step())
        losses_c.append(coexec_step())
        unplanned_step()
    coexec.wait_for_plans()
    losses_e.append(eager.step())
    losses_c.append(coexec_step())  # the first step on the plan
    peak_eager = eager_peak(lambda: losses_e.append(eager.step()))  # two steps of its own...
    losses_c += [coexec_step(), coexec_step()]  # ...matched here
    unplanned_step()
    t_e, t_c, t_u = [], [], []
    for _ in range(pairs):
        te, le = timed(eager.step)
        tc, lc = timed(coexec_step)
        tu, _lu = timed(unplanned_step)
        t_e.append(te)
        t_c.append(tc)
        t_u.append(tu)
        losses_e.append(le)
        losses_c.append(lc)
    s = tape.stats
    schedule = getattr(tape._program, "schedule", None)  # (older checkouts: no Schedule)
    same = all(torch.equal(a, b) for a, b in zip(losses_e, losses_c)) and all(
        torch.equal(a, b) for a, b in zip(eager.model.state_dict().values(), co.model.state_dict().values())
    )
    planned = s.planned_peak_bytes
    return {
        "model": name,
        "batch": batch,
        "ops": s.last_ops,
        "eager MB": peak_eager / MB,
        "planned MB": planned / MB if planned else float("nan"),
        "measured MB": s.peak_bytes / MB,
        "vs planned": s.peak_bytes / planned if planned else float("nan"),
        "reduction %": 100 * (1 - s.peak_bytes / peak_eager),
        "frag %": 100 * schedule.fragmentation if schedule is not None else float("nan"),
        "eager ms": 1e3 * statistics.median(t_e),
        "coexec/eager": statistics.median(c / e for c, e in zip(t_c, t_e)),
        "unplanned/eager": statistics.median(u / e for u, e in zip(t_u, t_e)),
        "unplanned MB": loose.stats.peak_bytes / MB,
        "planned blocks": getattr(s, "planned_blocks", 0),
        "ran ahead %": _ran_ahead(s),
        "waits issue/bytes/region": _waits(s),
        "bit-equal": same,
    }


def _ran_ahead(stats) -> float:
    """Of the latest step's deferred ops, the share run before their block was complete."""
    ra = getattr(stats, "run_ahead", None)  # (older checkouts: not counted)
    total = ra.ahead + ra.at_launch if ra is not None else 0
    return 100 * ra.ahead / total if total else float("nan")


def _waits(stats) -> str:
    ra = getattr(stats, "run_ahead", None)
    return f"{ra.waited_for_issue}/{ra.waited_for_bytes}/{ra.waited_for_region}" if ra is not None else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--pairs", type=int, default=7, help="eager and coexec steps, alternating")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args()
    rows = []
    for batch in map(int, args.batches.split(",")):
        for name in args.models.split(","):
            if name not in ZOO:
                raise SystemExit(f"unknown model {name!r}; the zoo has {', '.join(ZOO)}")
            rows.append(measure(name, batch, args.pairs))
            print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    table = markdown_table(rows)
    lines = [table, ""]
    for batch in sorted({r["batch"] for r in rows}):
        sel = [r for r in rows if r["batch"] == batch]
        red = [r["reduction %"] for r in sel]
        lines.append(
            f"batch {batch}: reduction at run time mean {statistics.mean(red):.1f}% "
            f"({min(red):.1f}-{max(red):.1f}%), measured/planned at most "
            f"{max(r['vs planned'] for r in sel):.4f}, above eager on {sum(r['reduction %'] < 0 for r in sel)} "
            f"model(s), coexec/eager geometric mean "
            f"{statistics.geometric_mean([r['coexec/eager'] for r in sel]):.2f} (unplanned "
            f"{statistics.geometric_mean([r['unplanned/eager'] for r in sel]):.2f}), "
            f"bit-equal {sum(r['bit-equal'] for r in sel)}/{len(sel)}"
        )
    text = "\n".join(lines)
    print()
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planned_memory.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
