"""Compile, cache, load and register a C++ XLA FFI kernel of this folder.

`load(name)` compiles ``models/kernels/NAME.cc`` once per host and source into
``$XDG_CACHE_HOME/jaxrl/kernels/NAME-<hash>.so`` (``~/.cache`` by default; the hash covers
the source, the flags, the jaxlib version and the CPU's feature flags, since the code is
built for this CPU with ``-march=native``), loads it with ctypes and registers the handler
symbols it is asked for as CPU FFI targets. Several processes building at once each write
their own temporary file and rename it into place (the last rename wins; all are equal).

``JAXRL_CPU_KERNELS=0`` turns every kernel off (the callers keep their XLA paths).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger(__name__)

#: Environment switch: "0" turns the native kernels off.
ENABLE_ENV = "JAXRL_CPU_KERNELS"
#: g++ flags: built for this CPU (512-bit vectors where it has them), no C++ warnings.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-std=c++17",
         "-shared", "-fPIC", "-w")  # fmt: skip
_HERE = Path(__file__).resolve().parent


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled or loaded (the message holds the compiler's output)."""


def enabled() -> bool:
    """True unless ``JAXRL_CPU_KERNELS=0`` or the default backend is not the CPU."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return False
    return jax.default_backend() == "cpu"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel sources test them (``avx512f``, ``avx512_bf16``,
    ``amx_bf16``, ...; from /proc/cpuinfo, empty where it cannot be read)."""
    line = _cpu_flags()
    return frozenset(line.split(":", 1)[1].split()) if line.startswith("flags") else frozenset()


def library_path(name: str, folder: Path = _HERE) -> Path:
    """Where the compiled ``FOLDER/NAME.cc`` (this folder by default) of this source, flags,
    jaxlib and CPU is cached."""
    source = (folder / f"{name}.cc").read_bytes()
    key = hashlib.sha256()
    for part in (source, " ".join(FLAGS).encode(), jaxlib.__version__.encode(),
                 _cpu_flags().encode(), platform.machine().encode()):  # fmt: skip
        key.update(part)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "jaxrl" / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"


def compile_kernel(name: str, folder: Path = _HERE) -> Path:
    """The shared library of ``FOLDER/NAME.cc`` (this folder by default; another package's
    plain C ABI kernel: `transport.cast_kernel`), compiled now unless already cached.

    Raises:
        KernelBuildError: no g++ on PATH, or the compiler failed (its output inside).
    """
    out = library_path(name, folder)
    if out.exists():
        return out
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise KernelBuildError("no C++ compiler (g++ or $CXX) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(folder / f"{name}.cc"), "-o", tmp,
           "-lpthread"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load(name: str, symbols: tuple[str, ...]) -> bool:
    """Compile (once) and load ``NAME.cc`` and register each of `symbols` (its
    ``XLA_FFI_DEFINE_HANDLER_SYMBOL`` names) as a CPU FFI target of the same name. Returns
    False, after one warning, where that fails or `enabled()` is False; the answer is
    kept for the process."""
    if not enabled():
        return False
    try:
        lib = ctypes.CDLL(str(compile_kernel(name)))
        for symbol in symbols:
            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(symbol, capsule, platform="cpu")
    except (KernelBuildError, OSError, AttributeError, subprocess.TimeoutExpired) as e:
        log.warning("the native kernel %s is off (its XLA path serves): %s", name, e)
        return False
    return True
