"""The packed linear kernel's two tile sets side by side: AVX2 vs AVX-512, on SmolLM2-135M's decoder stream.

For each weight format and row count M, one run times the 120 linear layers of the 30-layer decoder
(q/k/v, o, gate·up, down) with every slab on AVX2 tiles and with every slab on AVX-512 tiles (the
`isa` setting, kernels/linear.c), checks that both give the same bits, and prints the ratio. The
same interleaved rounds for both, median of 7. Needs a CPU with AVX-512F (else both run AVX2).

    python bench/tiles.py [--formats fp32,fp16,bf16,int8,w8a8] [--ms 1,2,9,16,64,128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specpack.runtime.kernels import _lib
from specpack.runtime.kernels.tuning import pack

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # SmolLM2-135M: 30 layers
ISA = {"avx2": 0, "avx512": 3}  # linear.c's isa bits: 1-2 row slabs | 3+ row slabs


def timed(layers, xs, reps: int = 7) -> tuple[float, list]:
    times, outs = [], None
    for _ in range(reps):
        t = time.perf_counter()
        outs = [layer(xs[layer.in_features]) for layer in layers]
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp32,fp16,bf16,int8,w8a8")
    ap.add_argument("--ms", default="1,2,9,16,64,128")
    args = ap.parse_args()
    if not _lib.available():
        raise SystemExit(f"the CPU kernels are unavailable here: {_lib.unavailable_reason()}")
    print(f"AVX-512 on this CPU: {'yes' if _lib._library()[0].sp_avx512() else 'no (both columns run AVX2)'}")
    torch.manual_seed(0)
    for fmt in args.formats.split(","):
        layers = [pack(torch.randn(n, k) * 0.02, weights=fmt) for n, k in SHAPES]
        for m in (int(v) for v in args.ms.split(",")):
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            ms, outs = {}, {}
            for name, bits in ISA.items():
                for layer in layers:
                    layer.isa = bits
                ms[name], outs[name] = timed(layers, xs)
            same = all(torch.equal(a, b) for a, b in zip(outs["avx2"], outs["avx512"]))
            print(f"{fmt:5s} M={m:4d}  AVX2 {ms['avx2']:7.2f} ms  AVX-512 {ms['avx512']:7.2f} ms  "
                  f"ratio {ms['avx2'] / ms['avx512']:.2f}  same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
