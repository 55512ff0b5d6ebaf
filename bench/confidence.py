"""Is a DSpark confidence head calibrated? Its prefix survival (the cumulative product of its per-slot
confidences, what `specpack run` cuts drafts with) against what the target accepts, on HumanEval and
open chat.

Every step drafts the whole block (fixed draft length, no cost model), so every drafted position is
verified and its fate known. Per depth d: the mean predicted survival, the observed share of steps that
kept at least d drafted tokens, and their ratio (1: calibrated on average; below 1: the head promises
more than the target keeps). Then reliability bins over every (step, depth): within a bin of predicted
survival, the observed share; a head whose bins agree can be trusted to cut single drafts, not only on
average. Greedy outputs are checked equal to plain decoding.

    python bench/confidence.py [ARTIFACT] [--prompts 8] [--max-new-tokens 128] [--weights fp32] [--json]

ARTIFACT defaults to the demo's DSpark artifact (`make demo` builds it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lookup import workloads  # noqa: E402

DEFAULT = Path.home() / ".cache" / "specpack" / "demo" / "smollm2-135m-dspark"
BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0)


def record(model, prompt: list[int], max_new: int) -> tuple[list[tuple[list[float], int]], list[int]]:
    """(predicted survival per drafted position, drafted tokens kept) for each step but the last (which
    an end of text may cut), and the generated tokens."""
    import torch

    drafter, made, steps = model.drafter, [], []
    inner = drafter.draft

    def draft(jobs):
        out = inner(jobs)
        made.append(torch.cumprod(out[0].confidence.float(), 0).tolist())
        return out

    def emitted(tokens: list[int]) -> None:
        if made:  # a verification: its draft's kept tokens and the target's next one
            steps.append((made.pop(), len(tokens) - 1))

    drafter.draft = draft
    try:
        res = model.generate(prompt, max_new_tokens=max_new, draft_len=drafter.spec.draft_slots, adaptive=False,
                             on_tokens=emitted)
    finally:
        del drafter.draft  # the class's method again
    return steps[:-1], res.tokens


def by_depth(steps: list[tuple[list[float], int]], slots: int) -> list[dict]:
    out = []
    for d in range(1, slots + 1):
        said = [p[d - 1] for p, _ in steps if len(p) >= d]
        seen = [kept >= d for p, kept in steps if len(p) >= d]
        n = max(len(said), 1)
        out.append({"depth": d, "predicted": sum(said) / n, "observed": sum(seen) / n,
                    "ratio": sum(seen) / sum(said) if sum(said) else None})
    return out


def reliability(steps: list[tuple[list[float], int]]) -> list[dict]:
    pairs = [(s, kept >= d) for p, kept in steps for d, s in enumerate(p, 1)]
    out = []
    for lo, hi in zip(BINS, BINS[1:]):
        inside = [(s, hit) for s, hit in pairs if lo <= s < hi or (hi == BINS[-1] and s == hi)]
        if inside:
            out.append({"bin": [lo, hi], "n": len(inside), "predicted": sum(s for s, _ in inside) / len(inside),
                        "observed": sum(hit for _, hit in inside) / len(inside)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?", type=Path, default=DEFAULT, help="a DSpark artifact (default: the demo's)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--weights", default="fp32", help="the target's weight precision (fp32, fp16, bf16, int8, w8a8)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    args = ap.parse_args()

    import specpack

    model = specpack.load(args.artifact, weights=args.weights)
    if getattr(model.drafter, "confidence_head", None) is None:
        sys.exit(f"{args.artifact}: its drafter has no confidence head (a DSpark head with one is needed)")
    slots = model.drafter.spec.draft_slots
    report = {}
    for name, prompts in workloads(model.tokenizer, args.prompts).items():
        steps, same = [], True
        for ids in prompts:
            got, tokens = record(model, ids, args.max_new_tokens)
            steps += got
            same &= tokens == model.generate(ids, max_new_tokens=args.max_new_tokens, speculative=False).tokens
        report[name] = {"steps": len(steps), "identical": same, "al": 1 + sum(k for _, k in steps) / max(len(steps), 1),
                        "predicted_al": 1 + sum(sum(p) for p, _ in steps) / max(len(steps), 1),
                        "depths": by_depth(steps, slots), "bins": reliability(steps)}
    if args.json:
        print(json.dumps({"artifact": str(args.artifact), "weights": args.weights, "workloads": report}, indent=1))
        return
    for name, r in report.items():
        print(f"\n{name}: {r['steps']} steps of {slots} drafted tokens, AL {r['al']:.2f} (predicted "
              f"{r['predicted_al']:.2f}), output == plain: {'yes' if r['identical'] else 'NO'}")
        print(f"  {'depth':>5s} {'predicted':>10s} {'observed':>9s} {'ratio':>6s}")
        for d in r["depths"]:
            ratio = "-" if d["ratio"] is None else f"{d['ratio']:.2f}"
            print(f"  {d['depth']:5d} {d['predicted']:10.3f} {d['observed']:9.3f} {ratio:>6s}")
        print(f"  {'survival bin':>14s} {'n':>5s} {'predicted':>10s} {'observed':>9s}")
        for b in r["bins"]:
            print(f"  {b['bin'][0]:6.2f}-{b['bin'][1]:<7.2f} {b['n']:5d} {b['predicted']:10.3f} {b['observed']:9.3f}")


if __name__ == "__main__":
    main()
