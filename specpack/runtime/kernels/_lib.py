"""Building and loading the CPU kernels' library (pool.c, linear.c, w8a8.c, bf16_tiles.c, attention.c, layers.c, ...), once per process.

`pip install` builds the library as part of the package (setup.py: `_native*.so` beside these
sources), so a machine without a C compiler still gets it. A missing or stale one (the sources
changed since: an editable install) is compiled on first use with the system C compiler into
`$SPECPACK_CACHE/kernels/<hash>/` (default `~/.cache/specpack`), atomically, so concurrent
processes are safe. Where neither works (no AVX2/FMA/F16C, not Linux, no library and no compiler,
a failed build, or `SPECPACK_KERNELS=0`), `available()` is False and every kernel's caller keeps
torch's path (kernels/tuning.py's `fallback_message` says which, and how fast it is here).
`SPECPACK_KERNELS_PREBUILT=0` ignores the install-time build.
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

SOURCES = [Path(__file__).with_name(n) for n in ("pool.c", "panels.c", "linear.c", "w8a8.c", "w4a8.c", "w6a8.c", "amx.c", "bf16_tiles.c", "attention.c", "argmax.c", "layers.c", "decoder.c", "screen.c", "gguf_rows.c")]
HEADERS = [Path(__file__).with_name(n) for n in ("kernels.h", "simd.h", "attention_kv.h")]
COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=gnu11", "-pthread"]
CFLAGS = [*COMPILE_FLAGS, "-fPIC", "-shared"]
PREBUILT = "_native"  # the install-time build: specpack/runtime/kernels/_native<extension suffix>
# Idle pool threads spin this long after a job before sleeping, so the next layer's matmul finds
# them awake. Measured on SmolLM2 (idle 2-vCPU machine, decode loop): 0 us -> 34-35 tokens/s plain,
# 300 us -> 38-40 (T=1 forward 29 -> 26 ms), though a spinning worker costs its SMT sibling some FMA
# throughput in the torch ops between matmuls. On a machine busy with other work, spinning takes
# cycles from it: SPECPACK_KERNEL_SPIN_US=0 there.
SPIN_US = int(os.environ.get("SPECPACK_KERNEL_SPIN_US", 300))


@functools.cache
def source_hash() -> str:
    """16 hex digits of the kernels' sources (read once per process, as the library is loaded once):
    a library built from other sources is not used."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:16]


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
        define = f'-DSP_SOURCE_HASH="{source_hash()}"'
        proc = subprocess.run([cc, *CFLAGS, define, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, out)  # atomic; a racing process renames an identical file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    c_int = ctypes.c_int
    lib.sp_linear.argtypes = [p, i64, i64, i64, p, c_int, i64, p, p, i64, p, i64, c_int, c_int, c_int, c_int]
    lib.sp_linear.restype = None
    lib.sp_attention.argtypes = [p, i64, i64, i64, p, p, c_int, i64, i64, i64, i64, i64, i64, p, p, p, p, i64,
                                 ctypes.c_float, p, i64, ctypes.c_int]
    lib.sp_attention.restype = None
    f = ctypes.c_float
    lib.sp_rmsnorm.argtypes = [p, i64, i64, i64, p, f, p, i64]
    lib.sp_silu_mul.argtypes = [p, i64, i64, i64, p, i64]
    lib.sp_rope_cache.argtypes = [p, i64, i64, i64, i64, i64, p, p, i64, p, p, f, p, p, c_int, i64, i64, i64, p, p]
    for fn in (lib.sp_rmsnorm, lib.sp_silu_mul, lib.sp_rope_cache):
        fn.restype = None
    lib.sp_decoder_layers.argtypes = [p, i64, i64, p, p, p, p, i64, p]
    lib.sp_decoder_layers.restype = None
    lib.sp_context_kv.argtypes = [p, i64, i64, p, p, p]
    lib.sp_context_kv.restype = None
    lib.sp_eagle3_step.argtypes = [p, p, p, p, p, p, i64, p, p]
    lib.sp_eagle3_step.restype = None
    lib.sp_eagle3_chain.argtypes = [p, p, p, p, p, p, i64, i64, p, p, p, i64, p, p, p]
    lib.sp_eagle3_chain.restype = i64
    lib.sp_block_context.argtypes = [p, i64, p, p, p, p, p, p]
    lib.sp_block_context.restype = None
    lib.sp_block_draft.argtypes = [p, i64, p, p, p, p, p, p, p, i64, p, p, i64, p, p]
    lib.sp_block_draft.restype = i64
    lib.sp_argmax.argtypes = [p, i64, i64, i64, p]
    lib.sp_argmax.restype = None
    lib.sp_gguf_rows.argtypes = [c_int, p, i64, i64, p, i64, i64, p]
    lib.sp_gguf_rows.restype = i64
    lib.sp_screen.argtypes = [p, i64, i64, i64, p, i64, i64, p, p, c_int, i64, p, c_int]
    lib.sp_screen.restype = None
    lib.sp_avx512.restype = c_int
    lib.sp_vnni.restype = c_int
    lib.sp_set_spin_us.argtypes = [ctypes.c_long]
    lib.sp_w8a8_amx.argtypes = [ctypes.c_int]
    lib.sp_w8a8_amx.restype = None
    lib.sp_amx.restype = ctypes.c_int
    lib.sp_bf16_tiles.restype = ctypes.c_int
    lib.sp_attention_avx512.argtypes = [ctypes.c_int]
    lib.sp_attention_avx512.restype = None
    lib.sp_source_hash.restype = ctypes.c_char_p
    lib.sp_set_spin_us(SPIN_US)
    return lib


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") once loaded (the install-time build, else one compiled now), else (None, why
    not). Built at most once per process."""
    problem = _cpu_problem()
    if problem is not None:
        return None, problem
    lib = _prebuilt()
    if lib is not None:
        return lib, ""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None, "no C compiler found (set CC or install gcc/clang) and no kernels built at install"
    key = hashlib.sha256((source_hash() + " ".join([cc, *CFLAGS])).encode()).hexdigest()[:16]
    path = _cache_root() / "kernels" / key / "specpack_kernels.so"
    try:
        if not path.exists():
            log.info("compiling the CPU kernels -> %s", path)
            _compile(cc, path)
        return _declare(ctypes.CDLL(str(path))), ""
    except (OSError, RuntimeError) as exc:
        return None, f"building the kernel failed: {exc}"


def prebuilt_path() -> Path | None:
    """The library `pip install` built beside the sources, if any."""
    from importlib.machinery import EXTENSION_SUFFIXES

    here = Path(__file__).parent
    return next((here / (PREBUILT + s) for s in EXTENSION_SUFFIXES if (here / (PREBUILT + s)).is_file()), None)


def _prebuilt() -> ctypes.CDLL | None:
    """The install-time library when it exists, loads and was built from these sources."""
    path = prebuilt_path()
    if path is None or os.environ.get("SPECPACK_KERNELS_PREBUILT", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.sp_source_hash.restype = ctypes.c_char_p
        built_from = lib.sp_source_hash().decode()
    except (OSError, AttributeError) as exc:
        log.info("ignoring the install-time kernels %s: %s", path, exc)
        return None
    if built_from != source_hash():
        log.info("the install-time kernels %s are stale (sources changed since): compiling", path)
        return None
    return _declare(lib)


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


_tuned_threads: int | None = None


def set_tuned_threads(n: int | None) -> None:
    """A thread count a tuning measurement chose (kernels/tuning.py, per weight format), or None to
    forget them: kernels without weights of their own (attention) take the most any format chose; a
    kernel with weights takes its format's."""
    global _tuned_threads
    _tuned_threads = None if n is None else max(n, _tuned_threads or 0)


def default_threads() -> int:
    """Kernel threads: $SPECPACK_KERNEL_THREADS, else the tuned count (capped at the cores this
    process may run on), else those cores."""
    env = os.environ.get("SPECPACK_KERNEL_THREADS")
    if env:
        return max(1, int(env))
    return min(_tuned_threads, cores()) if _tuned_threads else cores()
