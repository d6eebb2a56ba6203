"""The simulated NVML library (``probes/simnvml``): where it is, building it, attaching it to pynvml.

pynvml keeps its library handle in the module
global ``pynvml.nvmlLib`` and loads ``CDLL("libnvidia-ml.so.1")`` only while that is ``None``
(``pynvml._LoadNvmlLibrary``). The probe sets ``pynvml.nvmlLib = ctypes.CDLL(<path>)`` before the
first ``nvmlInit`` (and clears pynvml's function-pointer cache if a real-but-unusable library
was loaded earlier). Everything after that is pynvml's own code: ``nvmlInit`` →
``nvmlInitWithFlags`` in our library, ``_nvmlGetFunctionPointer`` lookups, ctypes structs,
``NVMLError`` classes. Alternatively a process started with
``LD_LIBRARY_PATH=probes/simnvml RANKSIGHT_SIMNVML_DIR=<dir>`` makes pynvml's own ``CDLL`` find the
simulated library; the probe notices either way, because the simulated library exports
``simnvmlIsSimulated`` and real NVML does not. Samples are labelled from that check, never
from how the library was found.

NVML is process-global: one simulated state directory per process (one agent = one node).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

SIMNVML_DIR_ENV = "RANKSIGHT_SIMNVML_DIR"
SIMNVML_LIB_ENV = "RANKSIGHT_SIMNVML_LIB"
SIMNVML_SRC = Path(__file__).resolve().parent / "simnvml" / "simnvml.c"
SIMNVML_LIB = Path(__file__).resolve().parent / "simnvml" / "libnvidia-ml.so.1"


class SimNvmlError(RuntimeError):
    """The simulated NVML library cannot be used in this process (explained in the message)."""


def simnvml_library_path() -> Path:
    """Where the simulated library is expected: ``$RANKSIGHT_SIMNVML_LIB`` or ``probes/simnvml/libnvidia-ml.so.1``."""
    env = os.environ.get(SIMNVML_LIB_ENV)
    return Path(env) if env else SIMNVML_LIB


def build_simnvml(dest: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Compile ``probes/simnvml/simnvml.c`` with gcc (the Makefile's flags) unless ``dest`` exists.

    Returns the library path. Raises :class:`SimNvmlError` when gcc is missing or the build fails.
    The file is written atomically, so concurrent builders and loaders never see half a library.
    """
    out = Path(dest) if dest is not None else SIMNVML_LIB
    if out.exists() and not force:
        return out
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SimNvmlError("cannot build the simulated NVML library: gcc not found")
    if not SIMNVML_SRC.exists():
        raise SimNvmlError(f"cannot build the simulated NVML library: {SIMNVML_SRC} missing")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    proc = subprocess.run([gcc, "-O2", "-shared", "-fPIC", "-Wall", "-o", str(tmp), str(SIMNVML_SRC)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SimNvmlError(f"gcc failed building the simulated NVML library:\n{proc.stderr.strip()}")
    os.replace(tmp, out)
    return out


def pynvml_module():
    """pynvml, imported on first use: the host and python-sim paths never need it."""
    import pynvml

    return pynvml


def is_simulated_library(lib: Any) -> bool:
    """Whether a loaded NVML library is ours: it exports ``simnvmlIsSimulated``, real NVML does not."""
    return lib is not None and hasattr(lib, "simnvmlIsSimulated")


_lock = threading.Lock()
_sim_dir: str | None = None
_sim_users = 0


def attach_simulated(lib_path: Path, sim_dir: Path) -> None:
    """Make pynvml use the simulated library at ``lib_path`` for ``sim_dir`` (see module doc)."""
    global _sim_dir, _sim_users
    pynvml = pynvml_module()
    sim_dir_s = str(Path(sim_dir).absolute())
    with _lock:
        if _sim_users > 0 and _sim_dir != sim_dir_s:
            raise SimNvmlError(
                f"simulated NVML already serves {_sim_dir} in this process; NVML is process-global, "
                f"so {sim_dir_s} needs its own process (one agent per node)")
        with pynvml.libLoadLock:
            current = pynvml.nvmlLib
            if current is None or not is_simulated_library(current):
                if current is not None and getattr(pynvml, "_nvmlLib_refcount", 0) > 0:
                    raise SimNvmlError("a real NVML library is initialised in this process; not replacing it")
                try:
                    lib = ctypes.CDLL(str(lib_path))
                except OSError as e:
                    raise SimNvmlError(f"cannot load simulated NVML library {lib_path}: {e}") from e
                if not is_simulated_library(lib):
                    raise SimNvmlError(f"{lib_path} is not the ranksight simulated NVML library")
                pynvml.nvmlLib = lib
                # Function pointers looked up in a previously loaded (unusable) library must go.
                cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
                if isinstance(cache, dict):
                    cache.clear()
        os.environ[SIMNVML_DIR_ENV] = sim_dir_s  # read by the library's nvmlInit
        _sim_dir = sim_dir_s
        _sim_users += 1


def detach_simulated() -> None:
    """One user of the attached simulated library fewer (the library itself stays loaded)."""
    global _sim_users, _sim_dir
    with _lock:
        _sim_users = max(0, _sim_users - 1)
        if _sim_users == 0:
            _sim_dir = None
