"""The shipped DSpark recipe (bench/distill_smollm2_dspark.sh) on its data plus the target's continuations of
extra seed prompts (default bench/seeds/stdlib_code.jsonl: 671 distinct code prompts), generated into
their own feature cache and appended; the experiment of BENCHMARKS.md's 2026-12-03 DSpark section.

    SPECPACK_THREADS=2 python bench/distill_dspark_extra.py OUT [EXTRA.jsonl]     (NEW_SAMPLES=2: greedy + 1)
    PER_WORKLOAD=5 python bench/distill_smollm2.py eval dspark OUT ~/.cache/specpack
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import distill_smollm2 as bench
import torch

from specpack.distill import data

EXTRA = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent / "seeds" / "stdlib_code.jsonl"
CACHE = Path(os.environ.get("SPECPACK_CACHE", Path.home() / ".cache" / "specpack"))
build_features = data.build_features


def with_extra(target_dir, target, tokenizer, records, self_generate, gen_tokens, cache, capture, progress,
               sampling=data.Sampling()):
    """The bench's features, then the extra prompts' (groups renumbered after the bench's)."""
    base = build_features(target_dir, target, tokenizer, records, self_generate, gen_tokens, cache, capture, progress,
                          sampling)
    recs = data.read_jsonl(EXTRA)
    extra = build_features(target_dir, target, tokenizer, recs, len(recs), gen_tokens,
                           CACHE / "distill" / f"extra-{EXTRA.stem}", capture, progress,
                           data.Sampling(int(os.environ.get("NEW_SAMPLES", 2)), bench.COMMON["temperature"], 1))
    extra.groups = extra.groups + int(base.groups.max()) + 1
    print(f"bench data {len(base.starts)} sequences, {base.num_tokens} tokens; extra {len(extra.starts)} sequences, "
          f"{extra.num_tokens} tokens", flush=True)
    return data.Features.concat([base, extra])


if __name__ == "__main__":
    data.build_features = with_extra
    torch.set_num_threads(int(os.environ.get("SPECPACK_THREADS", os.cpu_count())))
    bench.train("dspark", Path(sys.argv[1]), CACHE)
