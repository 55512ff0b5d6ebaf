"""`specpack run` with default settings against --draft-len D and plain decoding, side by side, on the
real model (SmolLM2-135M) with the shipped heads (issue 43: what a user gets without options).

Every prompt runs plain, default and fixed in turn (the modes take turns, so a slow spell of the
machine lands on all of them), through `generate_text`, the library call behind `specpack run`.
Prints, per head and workload: tokens/s, speedup over plain, the drafter's acceptance length (over
the steps that drafted), tokens per step (every step counted), and how many steps drafted.

    .venv/bin/python bench/run_defaults.py --prompts 8 --max-new-tokens 64

Runs on older checkouts too (PYTHONPATH=that-tree): figures a checkout does not report are
computed from what it does (its acceptance length then counts every step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def workloads(n: int) -> dict[str, list[tuple[str, bool]]]:
    from decode import humaneval_prompts

    chat = [json.loads(line)["messages"][-1]["content"]
            for line in (Path(__file__).parent / "workloads/chat.jsonl").read_text().splitlines() if line.strip()]
    return {"HumanEval": [(p, False) for p in humaneval_prompts(n)], "open chat": [(p, True) for p in chat[:n]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--heads", default="EAGLE-3,DSpark", help="shipped heads to run (make demo builds them)")
    args = ap.parse_args()

    import specpack
    from specpack.demo import cache_dir, prepare, prepare_head
    from specpack.serving.generate import GenerateRequest, generate_text

    cache = cache_dir()
    _, pub = prepare(cache, lambda s: print(s, file=sys.stderr))
    print(f"specpack at {Path(specpack.__file__).parent}; {args.prompts} prompts a workload, "
          f"{args.max_new_tokens} new tokens")
    for label in args.heads.split(","):
        art = prepare_head(cache, label, lambda s: print(s, file=sys.stderr))
        if art is None:
            print(f"{label}: no shipped head")
            continue
        model = specpack.load(art, public_key=pub)
        D = model.manifest.drafter.draft_slots if model.manifest.drafter.kind == "block" else 4
        for name, prompts in workloads(args.prompts).items():
            runs = {"plain": [], "default": [], f"--draft-len {D}": []}
            for text, chat in prompts:
                for mode, over in (("plain", {"speculative": False}), ("default", {}),
                                   (f"--draft-len {D}", {"draft_len": D})):
                    req = GenerateRequest(prompt=text, chat=chat, max_new_tokens=args.max_new_tokens, **over)
                    runs[mode].append(generate_text(art, req, model=model))
            same = all(a["token_ids"] == b["token_ids"] for rs in runs.values() for a, b in zip(rs, runs["plain"]))
            print(f"\n{label}, {name} (outputs identical to plain: {'yes' if same else 'NO'})")
            print(f"  {'mode':<16}{'tok/s':>8}{'speedup':>9}{'AL':>7}{'tok/step':>10}{'drafted':>14}")
            base = _rate(runs["plain"])
            for mode, rs in runs.items():
                steps = sum(r["steps"] for r in rs)
                drafted = sum(r.get("drafted_steps", r["steps"]) for r in rs)
                accepted = sum(r["accepted"] - r.get("lookup_accepted", 0) for r in rs)
                al = 1 + accepted / drafted if drafted else 1.0
                per_step = 1 + sum(r["accepted"] for r in rs) / steps if steps else 1.0
                print(f"  {mode:<16}{_rate(rs):>8.1f}{_rate(rs) / base:>8.2f}x{al:>7.2f}{per_step:>10.2f}"
                      f"{f'{drafted}/{steps}':>14}")


def _rate(runs) -> float:
    return sum(len(r["token_ids"]) for r in runs) / sum(r["seconds"] for r in runs)


if __name__ == "__main__":
    main()
