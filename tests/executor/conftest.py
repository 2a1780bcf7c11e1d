from __future__ import annotations

import pytest

from executor import Executor


@pytest.fixture
def ex():
    """A fresh executor, closed after the test."""
    executor = Executor("test-executor")
    try:
        yield executor
    finally:
        executor.close()
