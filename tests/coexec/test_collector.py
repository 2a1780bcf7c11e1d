"""The cyclic garbage collector is held back while a step is recorded (coexec/collector.py):
a step's trace dies young, so a step that makes few objects collects nothing, and the
program's own thresholds are back after every step, however it ended."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from coexec import collector


@pytest.fixture
def default_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_no_collection_runs_inside_a_co_executed_step(default_thresholds):
    model, opt = _model()
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    tape = coexec.GradientTape(backend="interpret")
    inside: list[tuple] = []
    collections = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    def step() -> None:
        with tape:
            inside.append(gc.get_threshold())
            n = len(collections)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            collections_inside.append(len(collections) - n)

    collections_inside: list[int] = []
    gc.callbacks.append(count)
    try:
        for _ in range(6):
            step()
            gc.collect(0)  # (the young generation as full as the step left it: any step may start a collection)
    finally:
        gc.callbacks.remove(count)
    assert tape.stats.phase == "coexec" and tape.stats.coexec_steps >= 2
    assert all(t == (collector.STEP_THRESHOLD, 10, 10) for t in inside)
    assert collections_inside[-3:] == [0, 0, 0]
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_come_back_after_a_step_that_raises(default_thresholds):
    model, _ = _model()
    tape = coexec.GradientTape(backend="interpret")
    with pytest.raises(ValueError, match="in the step"):
        with tape:
            model(torch.randn(2, 6)).sum().backward()
            raise ValueError("in the step")
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_the_program_sets_in_a_step_are_kept(default_thresholds):
    model, _ = _model()
    tape = coexec.GradientTape(backend="interpret")
    with tape:
        model(torch.randn(2, 6)).sum().backward()
        gc.set_threshold(5000, 20, 20)
    assert gc.get_threshold() == (5000, 20, 20)


def test_a_disabled_or_rarer_collector_is_left_alone(default_thresholds):
    for setting in ((0, 10, 10), (500_000, 10, 10)):
        gc.set_threshold(*setting)
        collector.hold()
        assert gc.get_threshold() == setting
        collector.release()
        assert gc.get_threshold() == setting


def test_nested_holds_restore_once_the_last_ends(default_thresholds):
    collector.hold()
    collector.hold()
    collector.release()
    assert gc.get_threshold()[0] == collector.STEP_THRESHOLD
    collector.release()
    assert gc.get_threshold() == (700, 10, 10)
    collector.release()  # (an extra release changes nothing)
    assert gc.get_threshold() == (700, 10, 10)
