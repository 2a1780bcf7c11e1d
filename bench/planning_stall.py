"""Does planning stall a step? (issue 14: "Planning must never stall a step")

    python bench/planning_stall.py [--episodes 60] [--lbfgs-steps 12] [--repeat 3] [--debug] [--thread]

Two programs that used to stall for seconds while the arena was re-planned after each new
trace, on the step's critical path:

* REINFORCE: a policy network plays episodes of random length (12-200 steps, drawn from the
  returns so far), then one policy-gradient update; every episode length was a new trace
  until ``max_traces`` before gathered lists and sized nodes (issue 17); now it is one path
  after two traces, and each new length a path that asks for no plan (docs/coexec.md);
* LBFGS: ``optimizer.step(closure)`` on a small regression, where each step runs the closure
  up to 20 times and the optimizer reads many scalars (``.item()``) between them.

Each program runs eagerly, under ``coexec.GradientTape(backend="interpret", arena=False)`` (no
plans: what tracing and co-execution cost alone), and under
``coexec.GradientTape(backend="interpret")`` (same seed, same process), each ``--repeat`` times,
interleaved; a step's time is its median over the runs (on a 2-core machine one step varies by a
third between runs). The script prints per program: the median eager step, the slowest
co-executed or fallback step, their ratio, how many steps took over 3x the median eager step,
the most that planning added to one step (its time minus the same step's time without plans:
same seed, so the same episodes and traces; co-executed steps with plans also run in the arena),
the largest difference between two runs of one step in that mode (how much of "added" is noise),
the time steps waited for a plan (``tape.stats.plan_wait_seconds``), and the CPU time this
process spent on plans over all steps (``tape.stats.plan_local_seconds``: the step that made a
new path pickling it for the planning process, and the planner thread sending requests and
reading plans beside the steps, without garbage collections; the most of a run), and the most
one plan took (each new trace asks for one; its ratio to the median eager step is what planning
takes from a step in this process). With ``--debug`` the tape logs plans starting and arriving
in the background; with ``--thread`` a fourth run makes the plans on the planner thread, as when
the planning process cannot start (coexec/plan_process.py), sharing the GIL with the steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from coexec.planning import PLANNER  # noqa: E402
from common import markdown_table  # noqa: E402


THREAD = "plans on the planner thread"
LOCAL: list[float] = []  # per plan made: its local_seconds (see _record_local_seconds)


def _record_local_seconds() -> None:
    """Keep each plan's CPU time in this process (tape.stats.plan_local_seconds sums them)."""
    count = coexec.tape.Program._count_local_seconds

    def counted(self, done):
        if not done.cancelled() and done.exception() is None:
            LOCAL.append(done.result().local_seconds)
        count(self, done)

    coexec.tape.Program._count_local_seconds = counted


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.body(x), dim=-1)


def reinforce(episodes: int, tape_args: dict | None) -> tuple[list[float], list[float], object]:
    """Per-episode step times and losses; with ``tape_args``, each update runs under a tape."""
    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    tape = coexec.GradientTape(**tape_args) if tape_args is not None else None
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for ep in range(episodes):
        length = int(torch.randint(12, 201, (1,), generator=gen))
        t0 = time.perf_counter()
        with tape if tape is not None else _Nothing():
            state = torch.randn(4)
            log_probs, rewards = [], []
            for _ in range(length):
                probs = policy(state)
                action = torch.multinomial(probs, 1)
                log_probs.append(torch.log(probs[action]))
                rewards.append(float(state[0].item() > 0) + 0.1 * action.item())
                state = state * 0.9 + 0.1 * torch.randn(4)
            returns, running = [], 0.0
            for r in reversed(rewards):
                running = r + 0.99 * running
                returns.insert(0, running)
            returns = torch.tensor(returns)
            returns = (returns - returns.mean()) / (returns.std() + 1e-8)
            loss = -(torch.cat(log_probs) * returns).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return times, losses, tape


def lbfgs(steps: int, tape_args: dict | None) -> tuple[list[float], list[float], object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=20, history_size=10)
    x, y = torch.randn(256, 8), torch.randn(256, 1)
    tape = coexec.GradientTape(**tape_args) if tape_args is not None else None
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        with tape if tape is not None else _Nothing():

            def closure():
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            loss = opt.step(closure)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return times, losses, tape


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--lbfgs-steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each mode, interleaved")
    ap.add_argument("--debug", action="store_true", help="the tape logs plans to stderr")
    ap.add_argument(
        "--thread", action="store_true",
        help="also run with plans made on the planner thread (as when the planning process "
        "cannot start: sharing the GIL with the steps)",
    )  # fmt: skip
    args = ap.parse_args()
    _record_local_seconds()
    rows = []
    modes = [("eager", None), ("coexec, no plans", {"arena": False}), ("coexec", {})]
    if args.thread:
        modes.append(("coexec, plans on a thread", {THREAD: True}))
    for name, fn, n in (("REINFORCE", reinforce, args.episodes), ("LBFGS", lbfgs, args.lbfgs_steps)):
        runs: dict[str, list[tuple[list[float], list[float], object]]] = {m: [] for m, _ in modes}
        largest: dict[str, float] = {}  # the most CPU time one plan took in this process
        for r in range(args.repeat):
            for mode, tape_args in modes:
                if tape_args is not None:
                    tape_args = {**tape_args, "debug": args.debug, "backend": "interpret"}
                    PLANNER._in_process = tape_args.pop(THREAD, False)
                LOCAL.clear()
                runs[mode].append(fn(n, tape_args))
                coexec.wait_for_plans()  # plans of this run are not made during the next one
                largest[mode] = max(largest.get(mode, 0.0), *LOCAL, 0.0)
                gc.collect()  # and each run starts from an empty garbage collector
                PLANNER._in_process = False
                print(f"{name}, {mode}, run {r + 1}: step times (ms):", _ms(runs[mode][-1][0]), flush=True)
        # per step, the median over the runs: a step's time varies by a third between runs here
        times = {m: [statistics.median(ts) for ts in zip(*(t for t, _, _ in rs))] for m, rs in runs.items()}
        base = statistics.median(times["eager"])
        eager_losses = runs["eager"][0][1]
        for mode, _ in modes:
            ts = times[mode]
            slowest = max(range(n), key=lambda i: ts[i])
            s = runs[mode][-1][2].stats if mode != "eager" else None
            added = [a - b for a, b in zip(ts, times["coexec, no plans"])] if s and mode != "coexec, no plans" else None
            most = max(range(n), key=lambda i: added[i]) if added else None
            local = max(r[2].stats.plan_local_seconds for r in runs[mode]) if s else 0.0
            spread = max(max(ts) - min(ts) for ts in zip(*(t for t, _, _ in runs[mode])))
            rows.append(
                {
                    "program": name,
                    "run": mode,
                    "steps": n,
                    "median step (ms)": f"{1e3 * statistics.median(ts):.1f}",
                    "slowest step (ms)": f"{1e3 * ts[slowest]:.0f} (step {slowest})",
                    "slowest / median eager": f"{ts[slowest] / base:.1f}x",
                    "steps > 3x median eager": sum(t > 3 * base for t in ts),
                    "most added by planning (ms)": "" if most is None else f"{1e3 * added[most]:.0f} (step {most})",
                    "added / median eager": "" if most is None else f"{added[most] / base:.1f}x",
                    "spread between runs (ms)": f"{1e3 * spread:.0f}" if args.repeat > 1 else "",
                    "total (s)": f"{sum(ts):.2f}",
                    "waiting for plans (s)": f"{s.plan_wait_seconds:.3f}" if s else "",
                    "planning CPU here: all, largest plan (ms)": (
                        f"{1e3 * local:.0f}, {1e3 * largest[mode]:.0f} ({largest[mode] / base:.1f}x)" if s else ""
                    ),
                    "traces / coexec / fallbacks": f"{s.traces} / {s.coexec_steps} / {s.fallbacks}" if s else "",
                    "bit-equal losses": all(losses == eager_losses for _, losses, _ in runs[mode]),
                }
            )
    print(f"(per step: the median of {args.repeat} runs; eager median step {1e3 * base:.1f} ms)")
    print(markdown_table(rows))


def _ms(times: list[float]) -> str:
    return " ".join(f"{1e3 * t:.0f}" for t in times)


if __name__ == "__main__":
    main()
