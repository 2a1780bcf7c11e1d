"""Did the autograd engine run Python? (A backward that did cannot be replayed as a block of its
ops: hooks, custom ``autograd.Function`` s and checkpoint's recomputation must run each time.)

Used while a gradient block is made: by the default backend (``coexec/gradients.py``) and by the
native capture (``executor/capture.py``).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

# Whether the watch sees the engine's device threads (a CUDA backward runs in one).
WATCHES_ALL_THREADS = hasattr(threading, "setprofile_all_threads")
_ENGINE_CODE = torch.autograd.graph._engine_run_backward.__code__


class PythonWatch:
    """Sees whether the autograd engine called any Python outside ``own`` (path prefixes of the
    caller's own files) while active: ``seen`` names the first such function, else None.

    The engine runs a CPU backward in the calling thread and a CUDA one in a device thread of
    its own, where the Python it calls is a frame with no caller. Python 3.12 can profile every
    thread (``threading.setprofile_all_threads``); before it only the calling thread is watched
    (:data:`WATCHES_ALL_THREADS`)."""

    def __init__(self, own: tuple[str, ...] = ()) -> None:
        self.seen: str | None = None
        self.blind = False  # a profiler was active: nothing was watched (``seen`` says so)
        self._own = own
        self._old: Any = None
        self._old_new_threads: Any = None
        self._inside = False
        self._thread = threading.get_ident()

    def __enter__(self) -> PythonWatch:
        self._old = sys.getprofile()
        if self._old is not None:
            # (a profiler such as cProfile: its C-level hook cannot be put back from Python, and
            # it would not be seen while this one is in place)
            self.seen = f"a profiler is active ({type(self._old).__name__})"
            self.blind = True
            return self
        if WATCHES_ALL_THREADS:
            self._old_new_threads = threading.getprofile()
            threading.setprofile_all_threads(self._event)
        else:
            sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.blind:
            return
        if WATCHES_ALL_THREADS:  # other threads' own profilers, if any, are not restored
            threading.setprofile_all_threads(None)
            threading.setprofile(self._old_new_threads)
        sys.setprofile(self._old)

    def _event(self, frame: Any, event: str, arg: Any) -> None:
        if threading.get_ident() == self._thread:
            # Python called while the engine (a C call from _engine_run_backward) runs
            if (
                frame.f_code is _ENGINE_CODE
                and event[0] == "c"
                and getattr(arg, "__name__", "") == "run_backward"
            ):
                self._inside = event == "c_call"
            elif event == "call" and self._inside and self.seen is None:
                back = frame.f_back
                if back is not None and back.f_code is _ENGINE_CODE:
                    self._see(frame)
        elif event == "call" and self._inside and self.seen is None and frame.f_back is None:
            self._see(frame)  # called from C in another thread while the engine runs

    def _see(self, frame: Any) -> None:
        name = frame.f_code.co_filename
        if not self._own or not name.startswith(self._own):
            self.seen = f"{frame.f_code.co_name} ({name}:{frame.f_code.co_firstlineno})"
