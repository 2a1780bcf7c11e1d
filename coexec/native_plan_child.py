"""The child process that makes native-backend memory plans (``coexec/native_plans.py``):
``python -m coexec.native_plan_child``, one plan at a time over a pipe."""

from __future__ import annotations

import os
import pickle
import sys

import torch

from coexec.native_budget import PathsToPlan, plan_native, plan_native_paths
from coexec.plan_process import _read, _write


def main() -> None:
    """The child's loop: a described step (or a program's paths to plan together,
    :class:`PathsToPlan`), a budget (None: none), the host bandwidth (None: no
    offloading) and whether to plan an arena in, (True, plan or plans) or (False, error) out."""
    out = os.fdopen(os.dup(1), "wb")  # (fd 1 is the pipe: anything printed goes to stderr)
    os.dup2(2, 1)
    torch.set_num_threads(1)
    while True:
        try:
            d, budget, bandwidth, arena = pickle.loads(_read(sys.stdin.buffer))
        except EOFError:
            return
        try:
            if isinstance(d, PathsToPlan):
                answer = (True, plan_native_paths(d.planned, budget, bandwidth=bandwidth, state_of=d.state_only))
            else:
                answer = (True, plan_native(d, budget, bandwidth, arena))
        except Exception as e:  # noqa: BLE001 (raised in the training process)
            answer = (False, e)
        _write(out, pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    main()
