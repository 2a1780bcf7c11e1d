"""coexec: imperative-symbolic co-execution for PyTorch training loops.

The user-facing runtime (``GradientTape``) is not built yet; see ``tracegraph`` for the
recorder and TraceGraph it will stand on, and the README for the roadmap.
"""

__version__ = "0.1.0.dev0"
