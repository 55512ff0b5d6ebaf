"""Quantized GGUF weights on the CPU, side by side in one run (issue 51): plain decode (tg128) of specpack on
`import-gguf`'s kept blocks against llama.cpp's `llama-bench` on the same file, at the same thread count, and
the peak RSS of `specpack run --no-spec` beside the file's size.

Files: the embedded SmolLM2-135M-Instruct Q4_1 GGUF, and (with --llama-cpp) its weights as an F32 GGUF
quantized by llama.cpp's own `llama-quantize` to Q4_0, Q8_0 and Q4_K_M.

  .venv/bin/python bench/gguf_decode.py --llama-cpp .llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp
  .venv/bin/python bench/gguf_decode.py --types Q4_1 --tokens 128 --reps 5        # specpack only

Each specpack figure is a fresh process (`--one`): load the artifact, warm up, then the median of `--reps`
greedy generations of `--tokens` tokens from a one-token prompt (what llama-bench's tg test decodes). The two
engines alternate `--pairs` times (llama-bench -r `--reps`, then specpack), and the ratio shown is the median
of the pairs' ratios (this 2-core machine's speed drifts by 10-20% between minutes).
Never asserted in a test; figures in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
SPECPACK = [sys.executable, "-m", "specpack"]
MiB = 2 ** 20
QUANTIZED = ("Q4_0", "Q8_0", "Q4_K_M")  # made by llama-quantize from the F32 GGUF


def one(artifact: str, tokens: int, reps: int, threads: int) -> dict:
    """In this process: decode speed of the artifact's target, plain greedy."""
    import specpack
    from specpack.runtime.kernels import _lib

    os.environ.setdefault("SPECPACK_KERNEL_THREADS", str(threads))
    model = specpack.load(artifact)
    bos = 1
    model.generate([bos], max_new_tokens=8, speculative=False)  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = model.generate([bos], max_new_tokens=tokens, speculative=False, eos_ids=())
        times.append(time.perf_counter() - t)
        assert len(out.tokens) == tokens
    return {"tokens_per_s": tokens / statistics.median(times), "threads": _lib.default_threads()}


def files(args, work: Path) -> dict[str, Path]:
    from decode import f32_gguf

    from specpack.demo import find_gguf

    out = {"Q4_1": find_gguf()}
    quantize = Path(args.llama_cpp) / "build/bin/llama-quantize" if args.llama_cpp else None
    wanted = [t for t in args.types.split(",") if t != "Q4_1"]
    if wanted and quantize and quantize.is_file():
        f32 = f32_gguf(out["Q4_1"], work / "smollm2-f32.gguf")
        for t in wanted:
            path = work / f"smollm2-{t}.gguf"
            if not path.is_file():
                subprocess.run([str(quantize), str(f32), str(path), t], check=True, capture_output=True)
            out[t] = path
    return {t: p for t, p in out.items() if t in args.types.split(",")}


def artifact(gguf: Path, work: Path, kind: str) -> Path:
    from specpack.converters.gguf import import_gguf
    from specpack.packager import BuildOptions, NgramParams, build

    target, art = work / f"target-{kind}", work / f"art-{kind}"
    if not target.is_dir():
        import_gguf(gguf, target, progress=False)
    if not art.is_dir():
        build(BuildOptions(target=target, drafter="ngram", out=art, ngram=NgramParams(1, 4, 8)))
    return art


def specpack_decode(art: Path, args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", str(art), "--tokens", str(args.tokens), "--reps",
                          str(args.reps), "--threads", str(args.threads)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_rss(art: Path, tokens: int) -> float:
    """Peak RSS (MiB) of `specpack run --no-spec` (verify, load, decode `tokens`), a fresh process."""
    proc = subprocess.Popen([*SPECPACK, "run", str(art), "--prompt", "Hello", "--no-spec", "--max-new-tokens",
                             str(tokens)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"specpack run {art} failed")
    return usage.ru_maxrss / 1024


def llama_bench(gguf: Path, args) -> float | None:
    exe = Path(args.llama_cpp) / "build/bin/llama-bench" if args.llama_cpp else None
    if exe is None or not exe.is_file():
        return None
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(args.threads), "-p", "0", "-n", str(args.tokens),
                          "-r", str(args.reps), "-o", "json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)[0]["avg_ts"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", help="a llama.cpp tree with build/bin/llama-bench and llama-quantize")
    p.add_argument("--types", default="Q4_1," + ",".join(QUANTIZED))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(Path.home() / ".cache/specpack/bench-gguf"))
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.tokens, args.reps, args.threads)))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"plain decode, tg{args.tokens}, {args.threads} threads, {args.pairs} alternating pairs of {args.reps} "
          f"runs each (medians; ratio: median of the pairs'); RSS: `specpack run --no-spec` peak")
    print(f"{'file':8s} {'GGUF MiB':>9s} {'kept MiB':>9s} {'llama.cpp t/s':>14s} {'specpack t/s':>13s} "
          f"{'ratio':>6s} {'run RSS MiB':>12s}")
    for kind, gguf in files(args, work).items():
        art = artifact(gguf, work, kind)
        kept = sum(f.stat().st_size for f in (work / f"target-{kind}").glob("*.safetensors"))
        pairs = [(llama_bench(gguf, args), specpack_decode(art, args)["tokens_per_s"]) for _ in range(args.pairs)]
        theirs = statistics.median(t for t, _ in pairs) if pairs[0][0] else None
        ours = statistics.median(o for _, o in pairs)
        ratio = f"{statistics.median(o / t for t, o in pairs):6.2f}" if theirs else "     -"
        print(f"{kind:8s} {gguf.stat().st_size / MiB:9.1f} {kept / MiB:9.1f} "
              f"{theirs if theirs else float('nan'):14.1f} {ours:13.1f} {ratio} {run_rss(art, args.tokens):12.0f}",
              flush=True)


if __name__ == "__main__":
    main()
