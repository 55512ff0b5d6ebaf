#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py, under 5 minutes): torch CUDA and, where importable,
# TensorRT, on a tiny model and on SmolLM2; greedy parity vs CPU torch and the speedup of speculation.
#
#   bench/gpu_check.sh [gpu_check.py options]      e.g. --no-real, --gguf FILE, --json $OUT/gpu.json
#
# It runs with the first Python whose torch sees a CUDA device: $PYTHON, python3, then .venv/bin/python
# (the project venv pins a CPU torch). Wheels placed in .whl/ (pydantic, gguf, tensorrt, ... for a bare
# machine) are installed into /tmp/site first; the repository itself is put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=""
for cand in "${PYTHON:-}" python3 .venv/bin/python; do
  if [ -n "$cand" ] && "$cand" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PY=$cand
    break
  fi
done
if [ -z "$PY" ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  echo "no Python here has a torch that sees a CUDA device; running $PY anyway to print what it sees" >&2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec timeout 300 "$PY" bench/gpu_check.py "$@"
