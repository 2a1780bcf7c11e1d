"""A fuzzer for coexec: seeded random dynamic training programs, trained eagerly and under
coexec and compared bit for bit (``python -m coexec.fuzz``; docs/coexec.md, *The fuzzer*)."""

from .runner import FuzzResult, run_program, run_spec
from .spec import FEATURES, Spec, generate

__all__ = ["FEATURES", "FuzzResult", "Spec", "generate", "run_program", "run_spec"]
