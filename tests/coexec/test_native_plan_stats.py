"""The native backend's memory plans in the tape's statistics and in ``coexec.wait_for_plans()``
(issue 51, §6: the wait ignored them and ``plans_made`` stayed 0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coexec
from executor import native

pytestmark = pytest.mark.skipif(not native.enabled(), reason="the native backend needs the native module")


def test_wait_for_plans_waits_for_a_native_budgets_plan_and_stats_count_it() -> None:
    native.wait()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    tape = coexec.GradientTape(memory_budget="64MB", key=("native plan stats",))
    assert tape.backend == "native"
    for _ in range(3):  # (two warm-up steps, then the third is described and sent to be planned)
        with tape:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert coexec.wait_for_plans(120)
    with tape:  # (takes the plan that arrived)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    s = tape.stats
    assert s.planned_peak_bytes is not None
    assert s.plans_made == 1 and s.planning_seconds > 0
