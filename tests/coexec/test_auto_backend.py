"""``GradientTape()``'s default, ``backend="auto"``: the native backend where it can serve the
tape (a machine without a GPU, the module built, no option only the interpret backend has),
else the interpret backend; a native module that turns out not to build moves the tape to the
interpret backend at its next step, training on bit-equal."""

from __future__ import annotations

import pytest
import torch

import coexec
from examples.programs import PROGRAMS
from executor import native
from tests.coexec.helpers import assert_same_as_eager

pytestmark = pytest.mark.skipif(not native.enabled(), reason="auto picks native only where it is built")


def test_the_default_is_auto_and_runs_native_on_this_cpu() -> None:
    program = next(p for p in PROGRAMS if p.name == "static_mlp")
    tape = assert_same_as_eager(lambda: program(0), lambda p, i: p.step(i), 6, backend="auto")
    assert tape.backend == "native" and not tape.arena
    s = tape.stats
    assert (s.steps, s.coexec_steps, s.traces, s.fallbacks) == (6, 6, 1, 0)  # (a static program: one trace)
    assert coexec.GradientTape().backend == "native"


def test_a_budget_or_an_arena_stays_native() -> None:
    assert coexec.GradientTape(memory_budget="1GB").backend == "native"
    assert coexec.GradientTape(memory_budget="1GB", offload=True).backend == "native"
    tape = coexec.GradientTape(arena=True)
    assert tape.backend == "native" and tape.arena
    tape = coexec.GradientTape(arena=True, memory_budget="1GB")
    assert tape.backend == "native" and tape.arena


def test_sync_none_stays_native() -> None:
    """A native step ends with its values computed: ``sync="none"`` asks nothing it cannot give."""
    tape = coexec.GradientTape(sync="none")
    assert tape.backend == "native" and tape.sync == "none"


def test_a_machine_with_a_gpu_chooses_interpret(monkeypatch) -> None:
    """The capture answers CPU tensors only; the interpret backend is the GPU path."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert coexec.GradientTape().backend == "interpret"


def test_the_native_module_switched_off_chooses_interpret(monkeypatch) -> None:
    monkeypatch.setenv("COEXEC_NATIVE", "0")
    assert coexec.GradientTape().backend == "interpret"


def test_a_build_that_fails_later_moves_the_tape_to_interpret(monkeypatch, capsys) -> None:
    """Chosen while the module was building, native steps ran eagerly; its build then failed
    (the warning said why): the next step is the interpret backend's, and the training stays
    eager's."""
    program = next(p for p in PROGRAMS if p.name == "static_mlp")
    eager, co = program(0), program(0)
    monkeypatch.setattr(native, "settled", lambda: False)  # (still building)
    tape = coexec.GradientTape(key=("auto", "build fails"), debug=True)
    assert tape.backend == "native"
    for i in range(6):
        if i == 2:  # (the build has ended, without a module)
            monkeypatch.setattr(native, "settled", lambda: True)
            monkeypatch.setattr(native, "unavailable", lambda: True)
        want = eager.step(i)
        with tape:
            got = co.step(i)
        assert torch.equal(want, got)
    assert tape.backend == "interpret" and tape.arena
    assert tape.stats.traces >= 1 and tape.stats.last_phase == "coexec"
    for a, b in zip(eager.model.state_dict().values(), co.model.state_dict().values()):
        assert torch.equal(a, b)
    assert "the native module is not available: backend 'interpret' from this step on" in capsys.readouterr().err
