"""bench/gpu_check.py, the check a lent GPU machine runs first, end to end on the CPU (`--device cpu`,
the tiny models only): every path of it but CUDA's own and the real model's, so that it still runs
when a session finally gets a GPU. (Run by hand with the real model and the shipped heads, this mode
found a crash: the AMX tiles after torch's own bf16 matmuls, now tests/test_kernels.py.)"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_prepared_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--no-real",
                           "--no-8b", "--max-new-tokens", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    backends = [r for r in results if "backend" in r]
    extras = [r for r in results if "check" in r]
    assert {r["model"] for r in results} == {"tiny llama", "tiny deepseek-v3", "tiny qwen3-moe"}
    assert backends and all(r["ok"] and r["spec_equals_plain"] for r in backends)
    assert {r["check"] for r in extras} == {"batched engine", "onnx graph"}
    assert all("error" not in r and r["identical"] == r["of"] for r in extras)
