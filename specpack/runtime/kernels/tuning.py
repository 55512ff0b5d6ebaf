"""Kernel settings chosen from a short measurement on this machine, once per CPU model.

Which panel grouping (1 or 4 panels per work item; 4 runs one or two rows through wide tiles),
prefetch distance and thread count stream weights fastest depends on the machine: its memory
system, its L3, whether its cores are SMT siblings. The first time a format's weights are packed on
a CPU model, `settings` first picks the tile set for three rows or more where the CPU offers two
(AVX-512 or AVX2: the same bits) by timing 64 rows through one matrix, where the product is
compute-bound as in a prefill or a wide tree; then it times a stream of packed weights twice the
L3's size (within 64-256 MB) at one and nine rows under each candidate setting (with the tile set for one or
two rows among them; one to five seconds), keeps the fastest (one row weighs double: decoding), and caches
it in `$SPECPACK_CACHE/kernels/tuning.json`, keyed by CPU model, cores and kernel source.
Every setting gives the same bits: only speed changes. The same run times torch's `F.linear` at
one row on the fp32 stream and logs a warning if the kernel is slower there.

`SPECPACK_KERNEL_TUNE=0` keeps the built-in defaults; `=force` measures again.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import time
from pathlib import Path

import torch

from specpack._machine import cpu_model
from specpack.runtime.kernels import _lib
from specpack.runtime.kernels.linear import BF16_TILES, ISAS, QUANTIZED, PackedLinear, isa_bits

log = logging.getLogger(__name__)
DEFAULTS = {"group": 1, "prefetch": 128, "isa": "avx2", "isa_few": "avx2"}
PREFETCH = (0, 64, 128, 256)  # cache lines ahead
GROUPS = (1, 4)
SHAPE = (4096, 1024)  # one matrix of the stream; as many as exceed the L3
MIN_STREAM = 64 << 20  # bytes, at least twice the L3
# and at most this: a VM that reports its host's whole L3 (480 MB on a 2-vCPU Xeon here) would stream
# 960 MB per pass, 17.6 s per format where 256 MB took 4.7 s, chose the same settings and read the same
# rate (24-26 GB/s: not cache-resident)
MAX_STREAM = 256 << 20
REPS = 3
# Fewer threads than cores are chosen only when at least this much faster: one candidate's pass can fall
# in a moment a neighbour takes a core (50% steal on this VM once chose 1 thread for w8a8, and every
# format then ran its layers on one), and on a 2-core machine both cores stream faster in a quiet one.
FEWER_THREADS_MARGIN = 1.10
TUNING_VERSION = 2  # in the cache key: settings chosen by an older rule are measured again
# Settings measured while other work took more than this share of the machine's CPU time (other processes, or a
# VM's steal) are used by the process that measured them but not cached: a compiler on the other core made the
# two-core EPYC pick one thread for w8a8 (beyond FEWER_THREADS_MARGIN), and every block format then ran on one
# (SmolLM2 Q4_1 verify layers 1.28x -> 1.77x one row's cost) in every later process.
BUSY_SHARE = 0.25


def _setting() -> str:
    return os.environ.get("SPECPACK_KERNEL_TUNE", "1").strip().lower()


def _l3_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, KeyError):
        return 32 << 20


def _key(weights: str) -> str:
    return f"{cpu_model()}|{_lib.cores()} cores|{_lib.source_hash()}|v{TUNING_VERSION}|{weights}"


def _cache_path() -> Path:
    return _lib._cache_root() / "kernels" / "tuning.json"


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    path = _cache_path()
    data = _read_cache()
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a racing process writes its own whole file


_measuring = False  # packing the measurement's own stream uses the defaults


def pack(weight, bias=None, threads: int | None = None, weights: str = "fp32") -> PackedLinear:
    """Lay out `weight` [N, K] for the kernel, once, at load time, in format `weights` (fp32, fp16,
    bf16, int8 or w8a8; kernels/linear.py), with this machine's tuned settings.

    The packed copy is ~1x the weight's bytes in that format (N rounded up to 16); drop your
    reference to `weight` afterwards to release it. Falls back to `F.linear` on an fp32 copy of
    the same (rounded) weight when the kernels are not available.
    """
    return PackedLinear(weight, bias, threads, weights, _format_settings(weights))


def of_panels(panels, weights: str, shape: tuple[int, int], bias=None, threads: int | None = None) -> PackedLinear:
    """`pack` for panels already laid out in `weights` (linear.panel_layout), with the same tuned settings."""
    return PackedLinear.of_panels(panels, weights, shape, bias, threads, _format_settings(weights))


def _format_settings(weights: str) -> dict:
    return settings("bf16" if weights == BF16_TILES else weights) if _lib.available() else {}


def settings(weights: str = "fp32") -> dict:
    """{"group", "prefetch", "threads", "isa", "isa_few"} for `weights` on this machine: cached, else
    measured now (once per format and process), else the defaults."""
    if _measuring or _setting() in ("0", "false", "no", "off") or not _lib.available():
        return dict(DEFAULTS, threads=_lib.cores())
    return _tuned(weights)["settings"]


@functools.cache
def _tuned(weights: str) -> dict:
    key = _key(weights)
    entry = _read_cache().get(key)
    if not entry or _setting() == "force" or not _valid(entry.get("settings")):
        entry = measure(weights)
        if entry.get("busy", 0.0) > BUSY_SHARE:
            log.warning("other work took %.0f%% of the CPU while the %s kernel settings were measured: they are used "
                        "by this process only, not cached (the next start measures again)", 100 * entry["busy"],
                        weights)
        else:
            try:
                _write_cache(key, entry)
            except OSError as exc:
                log.warning("cannot cache the kernel settings in %s: %s", _cache_path(), exc)
    _lib.set_tuned_threads(entry["settings"]["threads"])  # attention's too
    return entry


def _valid(s) -> bool:
    return (isinstance(s, dict) and s.get("group") in GROUPS and isinstance(s.get("prefetch"), int)
            and isinstance(s.get("threads"), int) and s["threads"] >= 1 and s.get("isa") in ISAS
            and s.get("isa_few") in ISAS)


def measure(weights: str, stream_bytes: int | None = None, reps: int = REPS) -> dict:
    """Time each candidate setting on a stream of `stream_bytes` of weights packed as `weights`
    (default: twice the L3, at least 64 MB: read from memory, as a model's are each token); return
    the fastest and what was measured."""
    n = _lib.cores()
    total = stream_bytes or min(MAX_STREAM, max(MIN_STREAM, 2 * _l3_bytes()))
    log.info("measuring the CPU kernels' settings for %s weights on %s (once per CPU model)", weights, cpu_model())
    start, before = time.perf_counter(), _cpu_times()
    stream = _random_stream(weights, total)
    x1, x9 = torch.randn(1, SHAPE[1]), torch.randn(9, SHAPE[1])
    isa, isa_ms = _isa(stream[0], n, reps)
    candidates = [{"group": g, "prefetch": p, "threads": t, "isa": isa, "isa_few": f}
                  for g in GROUPS for p in PREFETCH for t in sorted({n, max(1, n // 2)})
                  for f in (ISAS if isa_ms else ISAS[:1])]
    times = {i: [] for i in range(len(candidates))}
    for _ in range(reps):  # interleaved, so a busy moment hits every candidate alike
        for i, c in enumerate(candidates):
            _use(stream, c)
            times[i].append(_pass(stream, x1) + _pass(stream, x9) / 2)
    chosen = _fastest(candidates, {i: min(t) for i, t in times.items()}, n)
    _use(stream, chosen)
    one_row = min(_pass(stream, x1) for _ in range(reps)) * 1e3
    torch_ms = _torch_ms(len(stream), x1, reps) if weights == "fp32" else None
    entry = {"settings": chosen, "ms_one_row": round(one_row, 3), "stream_mb": round(total / 2**20),
             "torch_ms_one_row": None if torch_ms is None else round(torch_ms, 3),
             "isa_ms_64_rows": isa_ms,
             "seconds": round(time.perf_counter() - start, 2), "busy": _others_share(before, _cpu_times(), n)}
    log.info("kernel settings for %s weights on %s: %s", weights, cpu_model(), entry)
    if torch_ms is not None and one_row > torch_ms:
        log.warning("the packed kernel streams fp32 weights slower than torch's F.linear at one row here "
                    "(%.2f vs %.2f ms over %d MB): report it with `specpack --version` and your CPU model",
                    one_row, torch_ms, entry["stream_mb"])
    return entry


def _cpu_times() -> tuple[float, float, float]:
    """(wall seconds, CPU seconds the machine spent busy: /proc/stat's user to steal, this process's and its finished
    children's CPU seconds)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        ticks = [int(f) for f in fields]  # user nice system idle iowait irq softirq steal
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    own = os.times()  # its children too: a compiler building the kernels is this process's work
    return time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system


def _others_share(before, after, cores: int) -> float:
    """The share of the machine's CPU time (wall x cores) that went to anything but this process between the two
    `_cpu_times` readings (0 where /proc/stat cannot be read)."""
    wall = (after[0] - before[0]) * cores
    others = (after[1] - before[1]) - (after[2] - before[2])
    return round(max(0.0, others / wall), 3) if wall > 0 and others == others else 0.0


def _fastest(candidates: list[dict], ms: dict[int, float], cores: int) -> dict:
    """The fastest candidate, unless it uses fewer threads than `cores` and the fastest that uses them
    all is within FEWER_THREADS_MARGIN of it (then that one)."""
    best = min(ms, key=ms.get)
    full = [i for i, c in enumerate(candidates) if c["threads"] == cores]
    if candidates[best]["threads"] < cores and full:
        all_cores = min(full, key=ms.get)
        if ms[all_cores] <= FEWER_THREADS_MARGIN * ms[best]:
            return candidates[all_cores]
    return candidates[best]


def _isa(layer, threads: int, reps: int) -> tuple[str, dict]:
    """The tile set to use ("avx512" where the CPU has it and it is faster on 64 rows through
    `layer`, a compute-bound product; else "avx2") and each one's milliseconds."""
    if not _lib._library()[0].sp_avx512():
        return "avx2", {}
    x64 = torch.randn(64, layer.in_features)
    ms = {}
    for isa in ISAS:
        _use([layer], {**DEFAULTS, "threads": threads, "isa": isa})  # 64 rows: "isa" decides
        ms[isa] = round(min(_pass([layer], x64) for _ in range(reps + 1)) * 1e3, 3)
    return min(ISAS, key=lambda i: (ms[i], -ISAS.index(i))), ms


def _random_stream(weights: str, total: int) -> list:
    """Packed layers of SHAPE holding `total` bytes of small random weights in format `weights`,
    written straight into the packed layout (their values do not matter to the timing)."""
    global _measuring

    N, K = SHAPE
    _measuring = True
    try:
        template = pack(torch.zeros(N, K), weights=weights)  # its layout, with the default settings
    finally:
        _measuring = False
    per = template.weight.numel() * template.weight.element_size()
    stream = []
    for _ in range(max(1, -(-total // per))):
        w = torch.empty_like(template.weight)
        if weights in QUANTIZED:
            w.random_(0, 256)
            w[..., : 16 * 4].view(torch.float32).fill_(1e-3)  # the blocks' scales
        else:
            w.uniform_(-0.02, 0.02)
        layer = copy.copy(template)
        layer.weight, layer._wptr = w, w.data_ptr()
        stream.append(layer)
    return stream


def _pass(stream, x) -> float:
    t = time.perf_counter()
    for p in stream:
        p(x)
    return time.perf_counter() - t


def _use(stream, s: dict) -> None:
    for p in stream:
        p.threads, p.group, p.prefetch, p.isa = s["threads"], s["group"], s["prefetch"], isa_bits(s)


def _torch_ms(count: int, x, reps: int) -> float:
    """torch's F.linear at one row over `count` fp32 matrices of SHAPE, on all cores."""
    import torch.nn.functional as F

    dense = [torch.empty(SHAPE).uniform_(-0.02, 0.02) for _ in range(count)]
    threads = torch.get_num_threads()
    torch.set_num_threads(_lib.cores())
    try:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for w in dense:
                F.linear(x, w)
            best = min(best, time.perf_counter() - t)
        return best * 1e3
    finally:
        torch.set_num_threads(threads)


@functools.cache
def fallback_message(reason: str) -> str:
    """What runs where the kernels cannot (no AVX2/F16C, ARM, no library), and how fast it streams
    weights here: one short measurement of torch's `F.linear` at one row, once per process."""
    import torch.nn.functional as F

    N, K = SHAPE
    with torch.no_grad():
        stream = [torch.randn(N, K) for _ in range(3)]
        x, best = torch.randn(1, K), float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for w in stream:
                F.linear(x, w)
            best = min(best, time.perf_counter() - t)
    rate = 3 * N * K * 4 / best / 1e9
    return (f"specpack's CPU kernels are off ({reason}): linear layers run torch's F.linear on "
            f"{torch.get_num_threads()} threads instead, {rate:.1f} GB/s of fp32 weights at one row here "
            f"(the packed kernel streams about 2-3x that on AVX2 machines; fp16/bf16/int8 weights save no time "
            f"on this path), and a row's logits may then depend on the rows batched with it")
