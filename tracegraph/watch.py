"""``python -m tracegraph show --record SCRIPT``: run a training script as ``__main__`` (its
loop at module level or in ``main()``) and watch every ``coexec.GradientTape`` block in it:
per ``with`` statement and step, the phase it ran in and why it fell back or made a new trace,
and whether the step converged (3 co-executed steps in a row without fallback, up to the last).

Uses ``coexec.observe`` (imported only here: tracegraph itself does not depend on coexec).
"""

from __future__ import annotations

import os
import runpy
import sys
from dataclasses import dataclass, field
from typing import Any

from .reasons import UNTRACED
from .summary import CONVERGED, converged_at


class _Stop(BaseException):
    """Leaves the user's step once the requested steps ran (a BaseException, so that the
    script's own ``except Exception`` does not swallow it)."""


@dataclass
class Watch:
    """The steps seen so far; stops the script after ``limit`` steps (None: never)."""

    limit: int | None = None
    steps: list[Any] = field(default_factory=list)  # coexec.observe.StepReport
    stopped: bool = False
    exit_code: Any = None  # what the script passed to sys.exit, if it did

    def __call__(self, report: Any) -> None:
        self.steps.append(report)
        if self.limit is not None and len(self.steps) >= self.limit:
            self.stopped = True
            raise _Stop

    def groups(self) -> dict[tuple[str, int], list[Any]]:
        """The steps per ``with`` statement and program, in order of first appearance."""
        out: dict[tuple[str, int], list[Any]] = {}
        for r in self.steps:
            out.setdefault((r.where, r.program), []).append(r)
        return out

    def report(self) -> str:
        n = len(self.steps)
        if self.stopped:
            lines = [f"stopped after {n} steps (--steps {self.limit})"]
        else:
            lines = [f"the script ended after {n} steps of coexec.GradientTape blocks"]
        if not n:
            lines.append("no coexec.GradientTape step ran: is the training loop run on import?")
        for (where, program), steps in self.groups().items():
            lines.append(f"with at {where}" + (f", program {program}:" if program > 1 else ":"))
            lines.extend(f"  step {r.step:>3}  {r.phase:<7}  {_verdict(r)}" for r in steps)
            at = converged_at([r.covered for r in steps], [r.step for r in steps])
            if at is not None:
                lines.append(f"  converged at step {at}")
            else:
                why = [f"step {r.step}: {r.reason.message}" for r in steps if r.reason][-3:]
                lines.append(
                    f"  not converged after {len(steps)} steps ({CONVERGED} co-executed steps "
                    f"in a row without fallback needed); reasons: {'; '.join(why) or 'none'}"
                )
        return "\n".join(lines)


def _verdict(r: Any) -> str:
    if r.phase == "eager":
        return "eager: max_traces reached, runs without coexec"
    if r.covered:
        return "covered"
    if r.reason is None:
        return "covered: co-executes from the next step"
    if r.fell_back:
        return f"fell back: {r.reason.message}"
    if r.reason.category == UNTRACED:
        return f"new path, not traced: {r.reason.message}"
    return f"new trace: {r.reason.message}"


def run_script(path: str, args: list[str], steps: int | None) -> Watch:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]``, watching its tapes;
    stop it after ``steps`` steps if given."""
    from coexec.observe import observe

    watch = Watch(limit=steps)
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with observe(watch):
            runpy.run_path(path, run_name="__main__")
    except _Stop:
        pass
    except SystemExit as e:
        watch.exit_code = e.code
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return watch
