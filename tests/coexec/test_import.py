"""Importing coexec leaves torch as it was (issue 51, §6): what a step needs is installed by the
step that needs it. Checked in a fresh interpreter (this one has run steps)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_PROBE = textwrap.dedent(
    """
    import torch
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    def snapshot():
        return {
            "Parameter.__new__": torch.nn.Parameter.__new__,
            "optimizer foreach types": list(optimizer._foreach_supported_types),
            "utils foreach types": list(foreach_utils._foreach_supported_types),
            "optimizer post hooks": dict(optimizer._global_optimizer_post_hooks),
            "optimizer pre hooks": dict(optimizer._global_optimizer_pre_hooks),
            "Tensor attributes": dict(vars(torch.Tensor)),
            "random functions": [getattr(torch, k) for k in ("manual_seed", "seed", "get_rng_state", "set_rng_state")],
            "autograd": (torch.autograd.backward, torch.autograd.grad),
        }

    before = snapshot()
    import coexec  # noqa: F401
    after = snapshot()
    print(sorted(k for k in before if before[k] != after[k]))
    """
)


def test_importing_coexec_changes_nothing_in_torch() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=root, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
