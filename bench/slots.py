"""Per-slot agreement of a model drafter, as decoding sees it and as training measured it, on held-out
HumanEval prompts (none of them seeds of the shipped heads' data).

A silent mis-binding (a target layer id off by one, a wrong mask token, a dropped head) shows here as
the runtime falling far below the training record's validation agreement (training.json). Two
figures per slot k, from greedy decoding with the head (fixed draft length, every output checked
equal to plain decoding):

  per position   at every `--every`-th position of the greedy text, a fresh draft from the whole
                 context (the drafter reset, fed every target feature at once) against the text's next
                 tokens; "run" is the mean run of leading correct slots + 1 (the AL a drafter of this
                 draft length would reach if every position were a step). Slot 1 and the run compare
                 with training's validation figures; later slots do not (the draft feeds its own tokens
                 forward, training feeds the true ones)
  after a miss   (with --every 1) per position, at the positions right after one whose fresh draft
                 missed slot 1: where decoding's steps land after a rejection
  per step       what decoding verified: each draft against the tokens that followed it; "run" is the
                 measured acceptance length. Steps skip the positions accepted drafts cover (the easy
                 ones), so per step sits below per position even for a correctly bound head; "after a
                 miss" shows how much of that gap the misses' clustering alone explains.

A fresh draft must equal the incremental one decoding made at the same position (the drafter's own
cache kept across steps): the script counts the steps where they differ. Near the end of the text the
engine drafts no more tokens than are left to generate, so there the incremental draft is compared with
the fresh one's first tokens (and counted as clipped).

    python bench/slots.py [--heads eagle3,dspark | DIR,...] [--prompts 5] [--max-new-tokens 128] [--every 3 | 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from decode import humaneval_prompts

DRAFT_LEN = {"eagle3": 3, "block": 5}  # the draft lengths the heads' validation figures are for


def head_dir(name: str) -> Path:
    from specpack.demo import HEADS

    return Path(name) if "/" in name else HEADS / f"smollm2-135m-{name}"


class Recorder:
    """Wraps a drafter's `draft` to keep (context length, drafted tokens) of slot 0's jobs."""

    def __init__(self, drafter):
        self.drafter, self.inner, self.log = drafter, drafter.draft, []
        drafter.draft = self

    def __call__(self, jobs):
        made = self.inner(jobs)
        self.log += [(len(j.context), d.tokens.tolist()) for j, d in zip(jobs, made) if j.slot == 0]
        return made

    def fresh(self, text: list[int], aux: torch.Tensor, at: int, k: int) -> list[int]:
        """The draft for position `at` of `text` from scratch, every context feature at once (aux:
        the target's features of the whole text; a position's depend on the tokens before it only)."""
        from specpack.runtime.drafters.base import DraftJob

        self.drafter.reset(len(text) + 16)
        return self.inner([DraftJob(0, torch.tensor(text[:at]), aux[: at - 1], k, None)])[0].tokens.tolist()


class Tally:
    def __init__(self, k: int):
        self.hits, self.runs, self.n = [0] * k, 0, 0

    def add(self, draft: list[int], truth: list[int]) -> None:
        self.n += 1
        ok = [q < len(draft) and draft[q] == t for q, t in enumerate(truth)]
        self.hits = [h + o for h, o in zip(self.hits, ok)]
        self.runs += next((q for q, o in enumerate(ok) if not o), len(ok))

    def line(self) -> str:
        n = max(self.n, 1)
        return " / ".join(f"{h / n:.2f}" for h in self.hits) + f"  run {1 + self.runs / n:.2f}  ({self.n})"


def measure(name: str, prompts: int, max_new: int, every: int) -> None:
    import specpack
    from specpack.demo import cache_dir
    from specpack.packager import BuildOptions, build

    src = head_dir(name)
    art = cache_dir() / f"slots-{src.name}"  # unsigned, rebuilt each run
    build(BuildOptions(target=cache_dir() / "smollm2-135m-instruct-f32", drafter=str(src), out=art, force=True))
    model = specpack.load(art)
    k = DRAFT_LEN.get(model.manifest.drafter.kind, 3)
    rec, tok = Recorder(model.drafter), model.tokenizer
    position, after_miss, step, differ, compared, clipped = Tally(k), Tally(k), Tally(k), 0, 0, 0
    for text in humaneval_prompts(prompts):
        ids = tok(text).input_ids
        plain = model.generate(ids, max_new_tokens=max_new, speculative=False).tokens
        rec.log.clear()
        spec = model.generate(ids, max_new_tokens=max_new, draft_len=k, adaptive=False)
        if spec.tokens != plain:
            sys.exit(f"{name}: speculative output differs from plain decoding")
        full = ids + list(plain)
        model.target.setup_cache(len(full) + 8)
        aux = model.target(torch.tensor(full), capture=model.drafter.capture_layers).aux
        steps = [(at, d) for at, d in rec.log if at + k <= len(full)]
        for at, d in steps:
            step.add(d, full[at : at + k])
        fresh = {at: rec.fresh(full, aux, at, k) for at, _ in steps[::every]}
        checked = [(fresh[at], d) for at, d in steps if at in fresh]
        differ += sum(f[: len(d)] != d for f, d in checked)
        compared, clipped = compared + len(checked), clipped + sum(len(d) < len(f) for f, d in checked)
        last_miss = None
        for at in range(len(ids), len(full) - k, every):
            draft = fresh[at] if at in fresh else rec.fresh(full, aux, at, k)
            position.add(draft, full[at : at + k])
            if last_miss == at - 1:
                after_miss.add(draft, full[at : at + k])
            last_miss = at if draft[:1] != full[at : at + 1] else last_miss
    record = json.loads((src / "training.json").read_text()) if (src / "training.json").is_file() else {}
    val = record.get("result", {}).get("validation")
    print(f"\n{name} ({model.manifest.drafter.kind}, draft length {k}, {prompts} HumanEval prompts, "
          f"{max_new} new tokens)")
    if val:
        print(f"  training validation  {' / '.join(f'{a:.2f}' for a in val['agreement'])}  "
              f"run {val['estimated_acceptance_length']:.2f}")
    print(f"  per position         {position.line()}")
    if after_miss.n:
        print(f"  after a miss         {after_miss.line()}")
    print(f"  per step             {step.line()}")
    print(f"  incremental drafts   {compared - differ} of {compared} equal to fresh ones ({clipped} clipped at the end)"
          + ("" if not differ else "  <- the drafter's cache across steps differs from a fresh start"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="eagle3,dspark", help="shipped head names (heads/smollm2-135m-NAME) or dirs")
    ap.add_argument("--prompts", type=int, default=5, help="held-out HumanEval prompts (0..N-1)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--every", type=int, default=3, help="teacher-forced drafts at every N-th position")
    args = ap.parse_args()
    from specpack.demo import cache_dir, prepare

    prepare(cache_dir(), lambda s: print(s, file=sys.stderr))  # the imported target (first run only)
    for name in args.heads.split(","):
        measure(name, args.prompts, args.max_new_tokens, args.every)


if __name__ == "__main__":
    main()
