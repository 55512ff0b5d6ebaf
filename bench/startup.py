"""Startup and memory, side by side in one run: time to first token and peak RSS of `specpack run`, time
to ready, first-request latency and peak RSS of `specpack serve` (16 sequences of 2048 positions, as
`llama-server -np 16 -c 32768`; `--slots`), on SmolLM2-135M-Instruct (the embedded
GGUF imported to fp32; `--weights fp32` and `w8a8`), beside llama.cpp on the same model (F32 GGUF:
`llama-completion`, `llama-server`).

  .venv/bin/python bench/startup.py --llama-cpp <sdist>/vendor/llama.cpp       # docs/development.md builds it
  .venv/bin/python bench/startup.py                                            # specpack only

Each command starts as a user starts it (a fresh process: Python, verification, loading, the cost-curve
measurement, the first token). Peak RSS is the child's own high-water mark (`wait4` rusage for `run`,
/proc VmHWM for a server, read before it is stopped). The weight bytes beside it are the stored fp32 tensors,
and for w8a8 one byte per linear weight (its int8 panels; the scales are a rounding error).
Never asserted in a test; figures in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import _stop, free_port, wait_ready  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
SPECPACK = [sys.executable, "-m", "specpack"]
MiB = 2 ** 20


def timed_run(args: list[str], env: dict | None = None) -> dict:
    """Start `args`, time its first byte on stdout and its end; its peak RSS from wait4."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - start if first else float("nan")
    proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args[:4])} ... exited with {proc.returncode}")
    return {"first_output_s": ttft, "total_s": time.perf_counter() - start, "peak_rss_mib": usage.ru_maxrss / 1024}


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def first_token_s(url: str, model: str, max_tokens: int) -> float:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        first = None
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    return first


def timed_server(args: list[str], model: str, port: int, max_tokens: int, env: dict | None = None) -> dict:
    """Time to /health answering 200, then one streamed request's first token; peak RSS after it."""
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    try:
        wait_ready(url, proc)
        ready = time.perf_counter() - start
        ttft = first_token_s(url, model, max_tokens)
        return {"ready_s": ready, "first_token_s": ttft, "peak_rss_mib": peak_rss_mib(proc.pid)}
    finally:
        _stop(proc)
        proc.wait(30)


def specpack_rows(artifact: Path, pub: Path, max_new: int, slots: int) -> dict:
    """Each command twice: a first start (SPECPACK_COST_CACHE=0: the cost curve measured, as on a machine
    that never ran this artifact) and a next start (the curve kept by an earlier start)."""
    rows = {}
    first = {**os.environ, "SPECPACK_COST_CACHE": "0"}
    for weights in ("fp32", "w8a8"):
        run = [*SPECPACK, "run", str(artifact), "--trust-key", str(pub), "--prompt", PROMPT, "--chat",
               "--max-new-tokens", str(max_new), "--weights", weights]
        port = free_port()
        serve = [*SPECPACK, "serve", str(artifact), "--trust-key", str(pub), "--weights", weights, "--port", str(port),
                 "--model-name", "smollm2", "--max-seqs", str(slots), "--max-model-len", "2048"]
        rows[f"run {weights} --no-spec"] = timed_run(run + ["--no-spec"])
        rows[f"run {weights}, first start"] = timed_run(run, first)
        rows[f"serve {weights}, first start"] = timed_server(serve, "smollm2", port, max_new, first)
        timed_run(run)  # keep the curves (run prices drafts for one sequence, serve for --slots)
        timed_server(serve, "smollm2", port, max_new)
        rows[f"run {weights}, next start"] = timed_run(run)
        rows[f"serve {weights}, next start"] = timed_server(serve, "smollm2", port, max_new)
    return rows


def llama_rows(llama: Path, gguf: Path, max_new: int, slots: int) -> dict:
    binary = llama / "build/bin/llama-completion"
    run = timed_run([str(binary), "-m", str(gguf), "-p", PROMPT, "-n", str(max_new), "-t", "2", "--temp", "0",
                     "-no-cnv", "--no-display-prompt", "-c", "2048"])
    port = free_port()
    serve = timed_server([str(llama / "build/bin/llama-server"), "-m", str(gguf), "-t", "2", "-np", str(slots), "-c", str(2048 * slots),
                          "--host", "127.0.0.1", "--port", str(port), "--no-webui"], "smollm2", port, max_new)
    return {"llama-completion F32": run, "llama-server F32": serve}


def weight_bytes(manifest: dict) -> dict:
    fp32 = manifest["memory"]["target_weight_bytes"]
    t = manifest["target"]
    embed = t["vocab_size"] * t["hidden_size"] * 4  # tied embedding: kept fp32 in w8a8
    return {"fp32": fp32, "w8a8": embed + (fp32 - embed) // 4}


def report(rows: dict, weights: dict, kv_mib: float, slots: int) -> None:
    print(f"\n{'':30s}{'ready s':>9s}{'1st token s':>13s}{'peak RSS MiB':>14s}{'RSS / (weights + KV)':>22s}")
    for name, r in rows.items():
        w = weights["w8a8" if "w8a8" in name else "fp32"]
        ratio = r["peak_rss_mib"] / (w / MiB + kv_mib * (slots if "serve" in name else 1))
        first = r.get("first_token_s", r.get("first_output_s"))
        print(f"{name:30s}{r.get('ready_s', float('nan')):9.1f}{first:13.2f}{r['peak_rss_mib']:14.0f}{ratio:22.2f}")
    print(f"(weights: fp32 {weights['fp32'] / MiB:.0f} MiB, w8a8 {weights['w8a8'] / MiB:.0f} MiB estimated (int8 linears, fp32 embedding); KV: 2048 "
          f"positions fp32 {kv_mib:.0f} MiB a sequence, {slots} sequences for the servers; `run` has no ready time: "
          "its first token is its start)")


def prepare_files() -> list[str]:
    """The n-gram artifact, its public key and the F32 GGUF llama.cpp runs (each made once)."""
    from decode import f32_gguf
    from specpack.demo import cache_dir, find_gguf, prepare

    artifact, pub = prepare(cache_dir(), lambda s: print(s, file=sys.stderr))
    gguf = f32_gguf(find_gguf(), cache_dir() / "SmolLM2-135M-Instruct.F32.gguf")
    return [str(artifact), str(pub), str(gguf)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, help="a built llama.cpp tree (build/bin/llama-completion, llama-server)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16, help="the servers' sequences (serve --max-seqs, llama-server -np)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # the child that makes the files
    args = ap.parse_args()
    if args.prepare:
        print(json.dumps(prepare_files()))
        return 0
    # the files are made in a child: a process's peak RSS (wait4) counts what its parent held when it forked
    # (Linux keeps the pre-exec high-water mark), so this one must stay small (an earlier run of this script,
    # which wrote the F32 GGUF itself, read llama-completion at 1,102 MiB for its 592)
    made = subprocess.run([sys.executable, __file__, "--prepare"], check=True, stdout=subprocess.PIPE, text=True)
    artifact, pub, gguf = map(Path, json.loads(made.stdout))
    rows = specpack_rows(artifact, pub, args.max_new_tokens, args.slots)
    if args.llama_cpp:
        rows.update(llama_rows(args.llama_cpp, gguf, args.max_new_tokens, args.slots))
    manifest = json.loads((artifact / "specpack.json").read_text())
    kv_mib = manifest["memory"]["target_kv_bytes_per_token"] * 2048 / MiB  # one 2048-position sequence, fp32
    report(rows, weight_bytes(manifest), kv_mib, args.slots)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
