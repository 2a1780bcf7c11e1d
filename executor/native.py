"""The executor's native module (``native/module.cpp``): built at first use, in the background,
and cached across processes.

It holds the native engine (``native/engine.h``, driven by ``executor/engine.py``): the
executor's queue, value table and run loop on a C++ thread that never takes the GIL, so ops run
while the skeleton's Python runs instead of waiting for the GIL after every kernel
(docs/coexec.md, *Performance*). The same kernels run in the same order with the same thread
count, so results do not change. Building takes a minute on a 2-core machine the first time
(then the compiled module is loaded from ``torch.utils.cpp_extension``'s cache:
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, under a name that carries a hash of
the sources, so a checkout builds only when they changed); until it is ready, and where it
cannot be built (no C++ compiler), the executor runs in Python, after one warning.

``COEXEC_NATIVE=0`` in the environment keeps the Python executor (to compare the two).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

_DIR = Path(__file__).resolve().parent / "native"
_SOURCES = [_DIR / "module.cpp", _DIR / "capture.cpp"]
_FLAGS = ["-O2"]
_GENERATOR = Path(__file__).resolve().parent / "structured_meta.py"


def _name() -> str:
    """The module's name: a hash of every source file and the flags, so a build in the cache
    is used exactly when it was built from these sources."""
    import torch

    # (torch's version: the module is compiled against its headers, and capture_shapes.h's
    # table is generated from its native_functions.yaml by structured_meta.py)
    h = hashlib.sha256(repr(_FLAGS).encode() + torch.__version__.encode() + _GENERATOR.read_bytes())
    for f in sorted(_DIR.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    return f"coexec_native_{h.hexdigest()[:12]}"


_NAME = _name()
_STALE_LOCK_SECONDS = 1800  # a build takes about a minute on 2 cores
_lock = threading.Lock()
_done = threading.Event()
_module: ModuleType | None = None
_started = False


def enabled() -> bool:
    """Is the native runner wanted (not switched off by ``COEXEC_NATIVE=0``)?"""
    return os.environ.get("COEXEC_NATIVE", "1") != "0"


def settled() -> bool:
    """Has the module's build ended (loaded, failed, or switched off)? (A cheap check.)"""
    return _done.is_set()


def unavailable() -> bool:
    """Is the module known not to load here: switched off, or its build failed? (False while
    it is still building.)"""
    return not enabled() or (_done.is_set() and _module is None)


def ready() -> ModuleType | None:
    """The built module if it is ready now (loaded here if it was built before); else None,
    after starting its build in the background (once per process)."""
    if _module is None and not _done.is_set():
        _start()
    return _module


def wait(timeout: float | None = None) -> ModuleType | None:
    """The built module, waiting up to ``timeout`` seconds for its build (None: it cannot be
    built, it is switched off, or it was not ready in time)."""
    _start()
    _done.wait(timeout)
    return _module


def _start() -> None:
    global _started
    with _lock:
        if _started:
            return
        _started = True
    if not enabled():
        _done.set()
        return
    if _built_path().exists():  # (loading takes about 0.1 s: the first step is captured too)
        _build()
        return
    threading.Thread(target=_build, name="coexec-native-build", daemon=True).start()


def _build() -> None:
    global _module
    try:
        _module = _load(_compile())
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: run in Python
        text = getattr(e, "stderr", None) or str(e)
        lines = text.strip().splitlines() or [""]
        said = next((x for x in lines if "error:" in x), lines[-1])  # (the compiler's, not its command)
        warnings.warn(
            "coexec: the native engine could not be built, so the executor runs ops "
            f"one Python call at a time (slower, same results): {type(e).__name__}: {said.strip()}",
            RuntimeWarning,
            stacklevel=1,
        )
    finally:
        _done.set()


def _load(path: Path) -> ModuleType:
    """Import the built module. (Not ``cpp_extension.load``: it checks the build again in
    every process, and a checkout at another path looked changed to it, rebuilt under the
    same name and waited for good on a lock a process left behind. The name's hash already
    says the build is of these sources.)"""
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built_path() -> Path:
    """Where the built module is (or will be) in torch's extension cache."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(_NAME, False)) / f"{_NAME}.so"


def _compile() -> Path:
    """The built module in torch's extension cache, built there first, in a child process,
    where it is not built yet. (Built in this process's background thread, a build cut short
    by the program's exit left torch's ``lock`` file behind, and every later build waited on
    it for good; a child finishes the build.) A lock older than any build is such a leftover
    (a killed build) and goes first."""
    built = _built_path()
    if built.exists():
        return built
    where = built.parent
    lock = where / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
            lock.unlink()
    except FileNotFoundError:
        pass
    from executor import structured_meta

    print(
        f"coexec: building the native module in {where} (once per source change and torch "
        "version; about a minute on 2 cores; steps run eagerly until it is ready, those under a "
        "memory_budget or with arena=True wait for it)",
        file=sys.stderr,
        flush=True,
    )
    where.mkdir(parents=True, exist_ok=True)
    structured_meta.write(where / structured_meta.HEADER)  # (included by capture_shapes.h)
    script = (
        "from torch.utils import cpp_extension; "
        f"cpp_extension.load(name={_NAME!r}, sources={[str(s) for s in _SOURCES]!r}, extra_cflags={_FLAGS!r}, "
        f"extra_include_paths={[str(where)]!r})"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    return built
