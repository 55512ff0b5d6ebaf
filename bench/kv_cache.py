"""The KV cache in fp32 vs fp16 (`--kv-cache fp16`) on the embedded SmolLM2-135M, side by side in one run.

For each weight precision asked for (default fp32 and w8a8), the model loaded twice, its target's KV
cache in the model's dtype (fp32) and in fp16:

  distance      the largest |logit difference| between the two caches over every position of long
                teacher-forced sequences (a prompt and the fp32 cache's greedy continuation), and
                whether greedy decoding gives the same tokens
  step cost     one target forward at long contexts: 1 sequence decoding one token, and 16
                sequences one token each (a loaded server's step), at 256 / 1024 / 2048 cached
                positions per sequence (median ms, best of interleaved rounds), and their ratio
  decode        tokens/s decoding from a long prompt (about 1500 tokens of HumanEval prompts), plain
                and with the n-gram drafter; speculative output must equal plain

The two caches take turns in every round: this machine drifts by 10-20% over minutes.

    python bench/kv_cache.py [--weights fp32,w8a8] [--contexts 256,1024,2048] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from decode import humaneval_prompts  # noqa: E402
from kernel_bench import median_ms  # noqa: E402
from precision import busy, machine  # noqa: E402

CACHES = ("model", "fp16")


def long_prompt(tok, tokens: int) -> list[int]:
    """HumanEval prompts one after another, cut to `tokens`."""
    ids: list[int] = []
    for p in humaneval_prompts(200):
        ids += tok(p).input_ids
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def distance(pair: dict, ids: list[int], max_new: int) -> tuple[float, bool]:
    ref, low = pair["model"], pair["fp16"]
    want = ref.generate(ids, max_new, speculative=False).tokens
    seq = torch.tensor(ids + want)
    logits = []
    for m in (ref, low):
        m.target.setup_cache(len(seq) + 1)
        logits.append(m.target(seq).logits[len(ids) - 1:])
    got = low.generate(ids, max_new, speculative=False).tokens
    return float((logits[0] - logits[1]).abs().max()), got == want


def step(target, seqs: int, context: int) -> None:
    """One forward of `seqs` sequences, one new token each, after `context` cached positions."""
    from specpack.runtime.models.rows import Rows, Segment

    rows = Rows.of([Segment(s, context, 1) for s in range(seqs)], target.device)
    target.forward_rows(torch.arange(seqs), rows, (), None)


def step_table(pair: dict, contexts: list[int], rounds: int = 3) -> dict:
    """{(sequences, context): {cache: ms}}."""
    for m in pair.values():
        m.target.setup_cache(max(contexts) + 8, 16)
    best: dict = {}
    for _ in range(rounds):
        for seqs in (1, 16):
            for c in contexts:
                for name, m in pair.items():
                    ms = median_ms(lambda: step(m.target, seqs, c), 7)
                    cell = best.setdefault((seqs, c), {})
                    cell[name] = min(cell.get(name, float("inf")), ms)
    return best


def decode(m, ids: list[int], max_new: int, spec: bool):
    r = m.generate(ids, max_new, speculative=spec, draft_len=8, adaptive=True)
    return r.tokens, r.stats.decode_tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="fp32,w8a8")
    ap.add_argument("--contexts", default="256,1024,2048")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    args = ap.parse_args()
    import specpack
    from specpack.demo import cache_dir, prepare

    artifact, pub = prepare(cache_dir(), lambda s: print(s, file=sys.stderr))
    contexts = [int(c) for c in args.contexts.split(",")]
    print(machine())
    for weights in args.weights.split(","):
        pair = {c: specpack.load(artifact, public_key=pub, weights=weights, kv_cache=c) for c in CACHES}
        ids = long_prompt(pair["model"].tokenizer, args.prompt_tokens)
        d, same = distance(pair, ids, args.max_new_tokens)
        print(f"\n## {weights} weights: fp16 cache vs fp32 cache\ndistance over {len(ids)} + {args.max_new_tokens} "
              f"positions: max |logit diff| {d:.4f}; greedy tokens equal: {same}")
        print(f"step cost, ms (best of 3 interleaved rounds of a median of 7); {busy()}")
        for (seqs, c), cell in step_table(pair, contexts).items():
            print(f"  {seqs:2d} seq x {c:5d} positions: fp32 {cell['model']:7.2f}  fp16 {cell['fp16']:7.2f}  "
                  f"fp32 / fp16 {cell['model'] / cell['fp16']:.2f}")
        print(f"decode from a {len(ids)}-token prompt, {args.max_new_tokens} tokens, tokens/s after the first; {busy()}")
        for spec in (False, True):
            rates, toks = {}, {}
            for name, m in pair.items():
                toks[name], rates[name] = decode(m, ids, args.max_new_tokens, spec)
            plain = {name: decode(m, ids, args.max_new_tokens, False)[0] for name, m in pair.items()} if spec else toks
            equal = all(toks[n] == plain[n] for n in CACHES)
            print(f"  {'n-gram' if spec else 'plain ':6s}: fp32 {rates['model']:6.1f}  fp16 {rates['fp16']:6.1f}  "
                  f"fp16 / fp32 {rates['fp16'] / rates['model']:.2f}" + (f"  speculative == plain: {equal}" if spec else ""))


if __name__ == "__main__":
    main()
