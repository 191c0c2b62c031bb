"""Build kernels.c with the system C compiler on first use and load it with ctypes.

The shared library is cached under ~/.cache/minedraft/kernels/ (or $MINEDRAFT_KERNEL_CACHE), named by a hash
of the source, the compiler command and this CPU's feature flags, so a new source, compiler or machine gets its
own build. `march` picks the instruction set: "native" (this CPU: AVX-512, AVX2 or plain C, whichever it has),
"x86-64-v3" (AVX2 + FMA) or "x86-64" (plain C); all give the same bits (see kernels.c).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O2", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
ISA_NAMES = {0: "plain C", 1: "AVX2", 2: "AVX-512"}


class KernelsUnavailable(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def cache_dir() -> Path:
    return Path(os.environ.get("MINEDRAFT_KERNEL_CACHE") or Path.home() / ".cache" / "minedraft" / "kernels")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    P, L, I, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.md_isa.restype = lib.md_panel_width.restype = I
    lib.md_matmul.argtypes = [P, L, I, I, P, I, P, P, L]
    lib.md_rmsnorm.argtypes = [P, L, I, P, I, F, P, L]
    lib.md_exp.argtypes = [P, P, L]
    lib.md_layer.argtypes = [P, P, P]
    lib.md_force_scalar.argtypes = lib.md_profile.argtypes = [I]
    lib.md_profile_times.restype = ctypes.POINTER(ctypes.c_double)
    for f in (lib.md_matmul, lib.md_rmsnorm, lib.md_exp, lib.md_layer, lib.md_force_scalar, lib.md_profile):
        f.restype = None
    return lib


@lru_cache(maxsize=None)
def load(march: str = "native") -> ctypes.CDLL:
    """The kernel library for `march`, compiled if this source/compiler/CPU has no cached build yet.
    Raises KernelsUnavailable when there is no compiler or the build fails."""
    cc = _compiler()
    if cc is None:
        raise KernelsUnavailable("no C compiler found (gcc, cc or clang; or set CC)")
    src = SOURCE.read_bytes()
    cmd = [cc, f"-march={march}", *FLAGS]
    key = hashlib.sha256(src + " ".join(cmd).encode() + _cpu_flags().encode()).hexdigest()[:20]
    out = cache_dir() / f"kernels-{march}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            res = subprocess.run([*cmd, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
            if res.returncode != 0:
                raise KernelsUnavailable(f"{' '.join(cmd)} failed: {res.stderr.strip()[-2000:]}")
            os.replace(tmp, out)  # atomic: a concurrent worker sees no half-written library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return _declare(ctypes.CDLL(str(out)))


def try_load() -> ctypes.CDLL | None:
    """The native library, or None with one warning (the runner then keeps its torch path)."""
    try:
        return load()
    except (KernelsUnavailable, OSError) as e:
        warnings.warn(f"minedraft kernels unavailable, using the torch model path: {e}", RuntimeWarning, stacklevel=2)
        return None
