"""Building and loading the CPU kernels' library (pool.c, linear.c, attention.c), once per process.

The library is compiled on first use with the system C compiler into
`$SPECPACK_CACHE/kernels/<hash>/` (default `~/.cache/specpack`), atomically, so concurrent
processes are safe. Where it cannot be (no compiler, no AVX2, a failed build, or
`SPECPACK_KERNELS=0`), `available()` is False and every kernel's caller keeps torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(n) for n in ("pool.c", "linear.c", "attention.c")]
HEADERS = [Path(__file__).with_name("kernels.h")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=gnu11", "-fPIC", "-shared", "-pthread"]
# Idle pool threads spin this long after a job before sleeping, so the next layer's matmul finds
# them awake. Measured on SmolLM2 (idle 2-vCPU machine, decode loop): 0 us -> 34-35 tokens/s plain,
# 300 us -> 38-40 (T=1 forward 29 -> 26 ms), though a spinning worker costs its SMT sibling some FMA
# throughput in the torch ops between matmuls. On a machine busy with other work, spinning takes
# cycles from it: SPECPACK_KERNEL_SPIN_US=0 there.
SPIN_US = int(os.environ.get("SPECPACK_KERNEL_SPIN_US", 300))


def _cache_root() -> Path:
    root = os.environ.get("SPECPACK_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "specpack"


def _cpu_problem() -> str | None:
    """Why this CPU cannot run the kernel, or None when it can."""
    if sys.platform != "linux":
        return f"the kernel needs Linux (futex threads), not {sys.platform}"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        return f"cannot read /proc/cpuinfo to check for AVX2: {exc}"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else None


def _compile(cc: str, out: Path) -> None:
    """Build the library to `out` atomically: compile to a temp file beside it, then rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, out)  # atomic; a racing process renames an identical file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.sp_linear.argtypes = [p, i64, i64, i64, p, ctypes.c_int, i64, p, p, i64, p, i64, ctypes.c_int]
    lib.sp_linear.restype = None
    lib.sp_attention.argtypes = [p, i64, i64, i64, p, p, i64, i64, i64, i64, i64, i64, p, p, p, p, i64,
                                 ctypes.c_float, p, i64, ctypes.c_int]
    lib.sp_attention.restype = None
    lib.sp_set_spin_us.argtypes = [ctypes.c_long]
    lib.sp_set_prefetch.argtypes = [ctypes.c_int]
    lib.sp_set_group.argtypes = [ctypes.c_int]
    lib.sp_set_spin_us(SPIN_US)
    return lib


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") once built and loaded, else (None, why not). Built at most once per process."""
    problem = _cpu_problem()
    cc = shutil.which(os.environ.get("CC", "cc"))
    if problem is None and cc is None:
        problem = "no C compiler found (set CC or install gcc/clang)"
    if problem is not None:
        return None, problem
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(text + " ".join([cc, *CFLAGS]).encode()).hexdigest()[:16]
    path = _cache_root() / "kernels" / key / "specpack_kernels.so"
    try:
        if not path.exists():
            log.info("compiling the CPU kernels -> %s", path)
            _compile(cc, path)
        return _declare(ctypes.CDLL(str(path))), ""
    except (OSError, RuntimeError) as exc:
        return None, f"building the kernel failed: {exc}"


def _disabled() -> bool:
    return os.environ.get("SPECPACK_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    if _disabled():
        return "disabled by SPECPACK_KERNELS=0"
    return _library()[1] or None


@functools.cache
def _log_once(reason: str) -> None:
    log.warning("fast linear kernel unavailable, using torch: %s", reason)


def available() -> bool:
    """True when the C kernel is enabled, this CPU has AVX2+FMA, and the library built."""
    reason = unavailable_reason()
    if reason is not None and not _disabled():
        _log_once(reason)
    return reason is None


def default_threads() -> int:
    """Kernel threads: $SPECPACK_KERNEL_THREADS, else the cores this process may run on."""
    env = os.environ.get("SPECPACK_KERNEL_THREADS")
    return max(1, int(env)) if env else len(os.sched_getaffinity(0))
