"""The attention kernel (kernels/attention.c) on SmolLM2's shape: 9 query heads, 3 KV heads, head
dim 64, one sequence whose R new rows (a draft, a tree) attend its cached context, per layer.

In ONE run, interleaved: the AVX2 loops and the AVX-512 ones (scores three queries at a time, value
sums six query heads at a time; the same bits, checked here too), for contexts of 100, 400 and 1600
positions and R = 1, 4, 9, 13 rows; microseconds per call (one layer) and x30 (the forward's 30
layers). The cache stays hot here (a real forward reads it after the weights have flushed it): an
upper bound on what the loops gain inside a forward.

    python bench/attention.py [--rounds 7] [--threads N] [--kv-cache fp32|fp16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specpack.runtime.kernels import attention as ka
from specpack.runtime.kernels._lib import _library, default_threads

H, KVH, HD = 9, 3, 64
CONTEXTS = (100, 400, 1600)
ROWS = (1, 4, 9, 13)


def case(ctx: int, R: int, dtype):
    g = torch.Generator().manual_seed(ctx * 100 + R)
    kc = torch.randn(1, KVH, ctx + 16, HD, generator=g).to(dtype)
    vc = torch.randn(1, KVH, ctx + 16, HD, generator=g).to(dtype)
    q = torch.randn(R, H, HD, generator=g)
    slot, starts = torch.zeros(R, dtype=torch.long), torch.full((R,), ctx)
    return q, kc, vc, slot, starts, starts + 1 + torch.arange(R)  # a chain of R new rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--kv-cache", choices=("fp32", "fp16"), default="fp32")
    args = ap.parse_args()
    lib = _library()[0]
    if not lib.sp_avx512():
        raise SystemExit("this CPU has no AVX-512: only the AVX2 loops run here")
    dtype = torch.float16 if args.kv_cache == "fp16" else torch.float32
    cases = {(c, r): case(c, r, dtype) for c in CONTEXTS for r in ROWS}
    times: dict = {}
    for _ in range(args.rounds):
        for key, (q, kc, vc, slot, ctx, end) in cases.items():
            outs = []
            args_ = (q, kc, vc, slot, ctx, end, None, HD ** -0.5)
            for zmm in (0, 1):
                lib.sp_attention_avx512(zmm)
                outs.append(ka.attention(*args_, threads=args.threads))
                reps = max(1, 20000 // (key[0] * key[1]))
                t0 = time.perf_counter()
                for _ in range(reps):
                    ka.attention(*args_, threads=args.threads)
                times.setdefault((*key, zmm), []).append((time.perf_counter() - t0) / reps)
            if not torch.equal(*outs):
                raise SystemExit(f"AVX2 and AVX-512 loops differ at context {key[0]}, {key[1]} rows")
    lib.sp_attention_avx512(1)
    print(f"attention, {H} heads / {KVH} KV heads / dim {HD}, {args.kv_cache} cache, {args.threads} threads; "
          f"us per call (x30 layers, ms); the same bits both ways")
    print(f"{'context':>8} {'rows':>5} {'AVX2':>16} {'AVX-512':>16} {'ratio':>6}")
    for c in CONTEXTS:
        for r in ROWS:
            a, b = (statistics.median(times[(c, r, z)]) * 1e6 for z in (0, 1))
            print(f"{c:>8} {r:>5} {a:>8.1f} ({a * 0.03:5.2f}) {b:>8.1f} ({b * 0.03:5.2f}) {a / b:>6.2f}")


if __name__ == "__main__":
    main()
