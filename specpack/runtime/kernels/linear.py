"""Fast fp32 linear layer for a few rows (speculative verification), in C with AVX2/FMA.

`pack(weight)` lays the weight out once, at load time, as K-major panels of 16 output columns;
`PackedLinear(x)` then streams every weight byte once whatever the number of rows M, so verifying 8
drafted tokens costs about what decoding one does. Where the kernel cannot run (no compiler, no
AVX2, a failed build, or `SPECPACK_KERNELS=0`), `pack` keeps the weight and calls `F.linear`.

Determinism: every output element is summed in the same fixed k-blocks, one FMA chain per block
(see linear.c), so results do not depend on M, on the thread count or on the machine's core count: row i of an M-row product is
bit-identical to the product of row i alone. Speculative and plain greedy decoding therefore see
the same logits. The values differ from `F.linear`'s in the last bits (another summation order).

The library is compiled on first use with the system C compiler into
`$SPECPACK_CACHE/kernels/<hash>/` (default `~/.cache/specpack`), atomically, so concurrent
processes are safe.
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

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

NR = 16  # output columns per panel (linear.c)
SOURCE = Path(__file__).with_name("linear.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-std=gnu11", "-fPIC", "-shared", "-pthread"]
# Below this many weight bytes one thread wins: waking the pool costs more than it saves.
MIN_PARALLEL_BYTES = 256 * 1024
# Idle pool threads spin this long after a job before sleeping, so the next layer's matmul finds
# them awake. Measured on SmolLM2 (idle 2-vCPU machine, decode loop): 0 us -> 34-35 tokens/s plain,
# 300 us -> 38-40 (T=1 forward 29 -> 26 ms), though a spinning worker costs its SMT sibling some FMA
# throughput in the torch ops between matmuls. On a machine busy with other work, spinning takes
# cycles from it: SPECPACK_KERNEL_SPIN_US=0 there.
SPIN_US = int(os.environ.get("SPECPACK_KERNEL_SPIN_US", 300))
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


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
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else None


def _compile(cc: str, out: Path) -> None:
    """Build the library to `out` atomically: compile to a temp file beside it, then rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, out)  # atomic; a racing process renames an identical file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.sp_linear.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, ctypes.c_int]
    lib.sp_linear.restype = None
    lib.sp_set_spin_us.argtypes = [ctypes.c_long]
    lib.sp_set_prefetch.argtypes = [ctypes.c_int]
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
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *CFLAGS]).encode()).hexdigest()[:16]
    path = _cache_root() / "kernels" / key / "linear.so"
    try:
        if not path.exists():
            log.info("compiling %s -> %s", SOURCE.name, path)
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


def _advise_huge_pages(t: Tensor) -> None:
    """Ask for 2 MB pages on the aligned interior of `t` before it is first written (THP in
    "madvise" mode): streaming the 113 MB head then runs ~8% faster (fewer TLB misses, and the
    hardware prefetchers stop at page ends). Best effort: nothing happens where unsupported."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * 4) // HUGE_PAGE * HUGE_PAGE
    if end > start and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)


def pack_panels(weight: Tensor) -> Tensor:
    """[N, K] -> [ceil(N/16), K, 16]: panel p, row k holds W[16p:16p+16, k], zero-padded past N."""
    N, K = weight.shape
    P = -(-N // NR)
    panels = torch.empty(P, K, NR, dtype=torch.float32)
    _advise_huge_pages(panels)
    full = N // NR
    panels[:full] = weight[: full * NR].reshape(full, NR, K).transpose(1, 2)
    if full < P:
        panels[full].zero_()
        panels[full, :, : N - full * NR] = weight[full * NR:].T
    return panels


class PackedLinear:
    """`y = x @ W.T + bias` for fp32 CPU x of shape [..., K], for inference (no autograd); made by
    `pack`.

    `threads` is the kernel's thread count (default: `default_threads()`); it changes speed only,
    never results. `backend` is "avx2" or "torch" (the fallback, which keeps the weight as given).
    Any number of rows works; the kernel is built for 1..16 (speculative verification).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, threads: int | None = None):
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise TypeError(f"pack() needs a 2-D fp32 CPU weight, got {tuple(weight.shape)} "
                            f"{weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise TypeError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.threads = threads or default_threads()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.backend = "avx2" if available() else "torch"
        with torch.no_grad():
            self.weight = pack_panels(weight.detach()) if self.backend == "avx2" else weight.detach()
        self._parallel = self.weight.numel() * 4 >= MIN_PARALLEL_BYTES
        if self.backend == "avx2":  # looked up once: a call costs a few microseconds in all
            self._fn = _library()[0].sp_linear
            self._wptr = self.weight.data_ptr()
            self._bptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        K, N = self.in_features, self.out_features
        if x.dtype != torch.float32 or x.shape[-1] != K or not x.is_cpu:
            raise TypeError(f"expected fp32 CPU input [..., {K}], got {tuple(x.shape)} {x.dtype} "
                            f"on {x.device}")
        if self.backend == "torch":
            y = F.linear(x, self.weight, self.bias)
            return y if out is None else out.copy_(y)
        lead = x.shape[:-1]
        M = lead.numel()
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(M, K)
            if x.stride(-1) != 1 or (M > 1 and x.stride(0) < K):
                x = x.contiguous()
        if out is None:
            out = torch.empty((*lead, N), dtype=torch.float32)
        elif (out.shape != (*lead, N) or out.dtype != torch.float32 or not out.is_contiguous()
              or not out.is_cpu):
            raise TypeError(f"out must be a contiguous fp32 tensor of shape {(*lead, N)}")
        self._fn(x.data_ptr(), M, K, x.stride(0), self._wptr, N, self._bptr, out.data_ptr(), N,
                 self.threads if self._parallel else 1)
        return out

    def __repr__(self) -> str:
        return (f"PackedLinear(in={self.in_features}, out={self.out_features}, "
                f"backend={self.backend}, threads={self.threads})")


def pack(weight: Tensor, bias: Tensor | None = None, threads: int | None = None) -> PackedLinear:
    """Lay out `weight` [N, K] (fp32) for the kernel, once, at load time.

    The packed copy is ~1x the weight (N rounded up to 16); drop your reference to `weight`
    afterwards to release it. Falls back to `F.linear` on the same weight when `available()` is
    False.
    """
    return PackedLinear(weight, bias, threads)
