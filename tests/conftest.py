import os
import sys

import pytest

# the example programs double as end-to-end test programs
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def plans_in_this_process(monkeypatch):
    """Plans made in the test's process, where it can patch the planner (plans are made in a
    child process otherwise: coexec/plan_process.py)."""
    import coexec
    from coexec.planning import PLANNER

    coexec.wait_for_plans(60)  # no plan of an earlier test is being made in the child
    monkeypatch.setattr(PLANNER, "_in_process", True)
    yield
    coexec.wait_for_plans(60)


def pytest_sessionstart(session):
    """The suite runs on the native engine (built once, cached; ``COEXEC_NATIVE=0`` runs it
    on the Python executor): wait for its build, so every test sees the same executor."""
    from executor import native

    if native.enabled() and native.wait(600) is None:
        raise pytest.UsageError("the native engine did not build (COEXEC_NATIVE=0 skips it)")
