"""Benchmark small-M fp32 linear layers on the shapes of SmolLM2-135M, side by side in one run.

For each shape and M (rows = tokens verified at once) it prints, per path: ms, weight GB/s, and the
ratio t(M)/t(1). Paths: torch `F.linear` (MKL), NumPy/OpenBLAS on a K-major copy, oneDNN packed
(`torch.utils.mkldnn`), and ours (`specpack.runtime.kernels`). Then the whole decoder's weight
stream (30 layers + head) per path, and (with --decoder) a decode-like loop with the small torch
ops between the matmuls, under each thread setting.

    python bench/kernel_bench.py [--reps 30] [--rounds 3] [--ms 1,2,4,8,9,16] [--decoder]

Each path runs its own phase (pools of different libraries spinning at once would fight), a
shape's phases repeat --rounds times, and every figure is the median over rounds of medians. Each
phase first waits for idle CPUs (the machine is shared); small weights are cycled through copies
worth 3x the L3 so that they stream from memory as in a real forward (--hot to reuse one).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, 9 heads x 64, 3 KV heads, MLP 1536, vocab 49152, 30 layers.
SHAPES = {  # name: (N, K, count per token)
    "qkv": (960, 576, 30),
    "o": (576, 576, 30),
    "gate_up": (3072, 576, 30),
    "down": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}
PATHS = ("torch", "numpy", "onednn", "ours")
COLD_BYTES = 96 << 20  # 3x the L3: in a real forward every weight comes from memory


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def make_paths(w: torch.Tensor) -> dict:
    """Path name -> function of x [M, K] returning [M, N], each on its own layout of `w`."""
    from specpack.runtime.kernels import available, pack

    paths = {"torch": lambda x: F.linear(x, w)}
    wk = np.ascontiguousarray(w.numpy().T)  # K-major [K, N]
    paths["numpy"] = lambda x: x.numpy() @ wk
    try:
        import torch.utils.mkldnn

        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w
        dnn = torch.utils.mkldnn.to_mkldnn(lin)
        dnn(torch.zeros(1, w.shape[1]))
        paths["onednn"] = dnn
    except (ImportError, RuntimeError, AttributeError) as exc:
        log_once(f"(oneDNN packed path unavailable: {exc})")
    if available():
        paths["ours"] = pack(w)
    return paths


@functools.cache
def log_once(msg: str) -> None:
    print(msg)


def cycling(fns: list):
    """Call the copies in turn, so that each call reads its weight from memory, not from L3."""
    it = itertools.cycle(fns)
    return lambda x: next(it)(x)


def busy_fraction(dt: float = 0.1) -> float:
    """Share of all CPUs busy over `dt` seconds (/proc/stat), while this process sleeps."""
    def sample():
        v = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    (t0, i0), _, (t1, i1) = sample(), time.sleep(dt), sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def wait_for_idle(limit_s: float = 60.0) -> None:
    """Other processes on a 2-core machine halve a 2-thread kernel: wait until the CPUs are
    quiet (up to `limit_s`, then measure anyway)."""
    start = time.perf_counter()
    while busy_fraction() > 0.08 and time.perf_counter() - start < limit_s:
        time.sleep(0.2)


def bench_shape(N: int, K: int, ms: list[int], reps: int, rounds: int, cold: bool, idle: bool) -> dict:
    """{path: {M: median ms}} for one weight shape."""
    copies = max(1, -(-COLD_BYTES // (N * K * 4))) if cold else 1
    per_copy = [make_paths(torch.randn(N, K)) for _ in range(copies)]
    paths = {p: cycling([c[p] for c in per_copy]) for p in per_copy[0]}
    xs = {m: torch.randn(m, K) for m in ms}
    runs = {p: {m: [] for m in ms} for p in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            if idle:
                wait_for_idle()
            with torch.inference_mode():
                for m in ms:
                    runs[name][m].append(median_ms(lambda: fn(xs[m]), reps))
    return {p: {m: statistics.median(v) for m, v in r.items()} for p, r in runs.items()}


def print_table(name: str, N: int, K: int, res: dict, ms: list[int]) -> None:
    gb = N * K * 4 / 1e9
    print(f"\n{name}: N={N} K={K} ({gb * 1e3:.1f} MB)")
    print("  M  " + "".join(f"| {p:^25s}" for p in PATHS if p in res) + "| ours/torch")
    print("     " + "".join("|    ms    GB/s  t(M)/t(1) " for p in PATHS if p in res) + "|")
    for m in ms:
        cells = "".join(f"| {res[p][m]:7.3f} {gb / res[p][m] * 1e3:6.1f}  {res[p][m] / res[p][ms[0]]:6.2f}    "
                        for p in PATHS if p in res)
        ratio = f"{res['ours'][m] / res['torch'][m]:.2f}" if "ours" in res else "-"
        print(f"{m:3d}  {cells}| {ratio}")


def print_decoder(all_res: dict, ms: list[int]) -> None:
    """Whole weight stream of one forward: sum over 30 layers + head."""
    total_gb = sum(N * K * 4 * c for N, K, c in SHAPES.values()) / 1e9
    paths = [p for p in PATHS if all(p in r for r in all_res.values())]
    print(f"\nwhole decoder, weights streamed per forward ({total_gb * 1e3:.0f} MB; 30 layers + head)")
    print("  M  " + "".join(f"| {p:^22s}" for p in paths) + "| ours/torch")
    for m in ms:
        tot = {p: sum(all_res[s][p][m] * SHAPES[s][2] for s in SHAPES) for p in paths}
        one = {p: sum(all_res[s][p][ms[0]] * SHAPES[s][2] for s in SHAPES) for p in paths}
        cells = "".join(f"| {tot[p]:6.2f} ms {total_gb / tot[p] * 1e3:5.1f} {tot[p] / one[p]:5.2f} "
                        for p in paths)
        ratio = f"{tot['ours'] / tot['torch']:.2f}" if "ours" in tot else "-"
        print(f"{m:3d}  {cells}| {ratio}")


# ---------------------------------------------------------------- decode-like loop

def decoder_step(layers, head, x, kv_len: int):
    """One forward of T tokens through SmolLM2-shaped layers with the small torch ops between the
    matmuls (RMSNorm, attention over `kv_len` cached positions, SiLU): what the kernel's pool
    shares the cores with."""
    T = x.shape[0]
    for qkv, o, gate_up, down, k_cache, v_cache in layers:
        h = F.rms_norm(x, (576,))
        q, k, v = qkv(h).split([576, 192, 192], dim=-1)
        q = q.view(T, 9, 64).transpose(0, 1)                      # [9, T, 64]
        keys = torch.cat([k_cache, k.view(T, 3, 64).transpose(0, 1)], 1)  # [3, L+T, 64]
        vals = torch.cat([v_cache, v.view(T, 3, 64).transpose(0, 1)], 1)
        a = F.scaled_dot_product_attention(q, keys.repeat_interleave(3, 0), vals.repeat_interleave(3, 0))
        x = x + o(a.transpose(0, 1).reshape(T, 576))
        g, u = gate_up(F.rms_norm(x, (576,))).chunk(2, dim=-1)
        x = x + down(F.silu(g) * u)
    return head(F.rms_norm(x, (576,)))


def bench_decoder(ms: list[int], reps: int, rounds: int, idle: bool, kv_len: int = 256) -> None:
    from specpack.runtime.kernels import available, pack
    from specpack.runtime.kernels import linear as kl

    if not available():
        print("\n(decode loop skipped: kernel unavailable)")
        return
    shapes = [SHAPES[s][:2] for s in ("qkv", "o", "gate_up", "down")]
    ws = [[torch.randn(N, K) * 0.02 for N, K in shapes] for _ in range(30)]
    cache = [(torch.randn(3, kv_len, 64), torch.randn(3, kv_len, 64)) for _ in range(30)]
    head_w = torch.randn(49152, 576) * 0.02
    torch_layers = [[(lambda x, w=w: F.linear(x, w)) for w in lw] + list(c) for lw, c in zip(ws, cache)]
    packed = [[pack(w) for w in lw] for lw in ws] + [[pack(head_w)]]
    ours_layers = [lp + list(c) for lp, c in zip(packed, cache)]
    # name, layers, head, torch threads, kernel threads, spin
    configs = [("torch F.linear", torch_layers, lambda x: F.linear(x, head_w), 2, None, None)]
    for tt, kt, spin in [(1, 2, kl.SPIN_US), (1, 1, kl.SPIN_US), (2, 2, kl.SPIN_US), (1, 2, 50)]:
        configs.append((f"ours k{kt} spin{spin}us", ours_layers, packed[-1][0], tt, kt, spin))
    lib = kl._library()[0]
    runs = {(c[0], c[3], m): [] for c in configs for m in ms}
    for _ in range(rounds):
        for name, layers, head, tt, kt, spin in configs:
            torch.set_num_threads(tt)
            if kt is not None:
                for p in sum(packed, []):
                    p.threads = kt
                lib.sp_set_spin_us(spin)
            if idle:
                wait_for_idle()
            with torch.inference_mode():
                for m in ms:
                    x = torch.randn(m, 576)
                    runs[name, tt, m].append(median_ms(lambda: decoder_step(layers, head, x, kv_len), reps))
    lib.sp_set_spin_us(kl.SPIN_US)
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"\ndecode-like loop: 30 layers + head, KV length {kv_len}, small torch ops between matmuls (ms)")
    print(f"{'config':22s} {'torch thr':>9s} " + "".join(f"{'M=' + str(m):>9s}" for m in ms) + "   t(8)/t(1)")
    for name, _, _, tt, _, _ in configs:
        row = {m: statistics.median(runs[name, tt, m]) for m in ms}
        r8 = f"{row[8] / row[1]:.2f}" if 8 in row and 1 in row else ""
        print(f"{name:22s} {tt:9d} " + "".join(f"{row[m]:9.2f}" for m in ms) + f"   {r8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30, help="timed calls per median")
    ap.add_argument("--rounds", type=int, default=3, help="phases per shape (median of medians)")
    ap.add_argument("--ms", default="1,2,4,8,9,16", help="row counts, the first is the baseline")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="subset of " + ",".join(SHAPES) + " ('' for none)")
    ap.add_argument("--decoder", action="store_true", help="also time a decode-like loop")
    ap.add_argument("--hot", action="store_true", help="reuse one weight (L3-resident when small)")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for idle CPUs per phase")
    args = ap.parse_args()
    from specpack.runtime.kernels import available, unavailable_reason

    ms = [int(m) for m in args.ms.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; numpy {np.__version__}; "
          f"ours: {'available' if available() else unavailable_reason()}")
    torch.manual_seed(0)
    all_res = {}
    for name in filter(None, args.shapes.split(",")):
        N, K, _ = SHAPES[name]
        all_res[name] = bench_shape(N, K, ms, args.reps, args.rounds, not args.hot, not args.no_wait)
        print_table(name, N, K, all_res[name], ms)
    if set(all_res) == set(SHAPES):
        print_decoder(all_res, ms)
    if args.decoder:
        bench_decoder(ms, max(5, args.reps // 3), args.rounds, not args.no_wait)


if __name__ == "__main__":
    main()
