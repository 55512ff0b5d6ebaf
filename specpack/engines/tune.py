"""`specpack tune ART --engine vllm`: a validated profile measured through the external engine itself.

The engine's server starts on the verified artifact without speculation, then once per draft length
with the artifact's drafter exported for it (`specpack.engines`); every workload prompt is completed
greedily through its OpenAI API one at a time (the outputs must equal the plain server's on every
prompt), then by 1..N concurrent clients. Acceptance comes from the engine's own counters (vLLM's
`spec_decode_num_accepted_tokens` / `num_drafts`), throughput from the clients. The best draft length
at one client and the concurrency up to which it still beats the plain server go into a profile with
`backend` = the engine, evidence naming it and its version, stored and re-signed as `tune` does; `serve
--engine` then follows it (its draft length, and the crossover as the engine's batch-size schedule).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import platform
import socket
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from specpack._version import __version__
from specpack.errors import InputError

log = logging.getLogger(__name__)


@dataclass
class EnginePass:
    """One server's figures over the workload."""

    draft_len: int  # 0: the plain server
    outputs: list[list[int]]
    tokens_per_s: float  # one request at a time
    acceptance_length: float
    concurrency: dict  # clients -> (aggregate tokens/s, p50 s, p95 s)
    version: str = "unknown"  # the engine's, as its server reports it


def tune_engine(artifact, workload, engine: str = "vllm", draft_lens=None, concurrency=(1, 2, 4),
                max_new_tokens: int = 64, key=None, public_key=None, extra: tuple[str, ...] = (),
                dtype: str = "float32", device: str = "cpu", progress: bool = False):
    """Measure `artifact` through `engine` on `workload` and store the profile (see the module
    docstring); returns (the profile, the path of the updated manifest, the passes measured)."""
    from specpack import engines
    from specpack.packager.artifact import read_manifest
    from specpack.runtime.api import load_tokenizer
    from specpack.schemas.manifest import check_draft_len, default_draft_len
    from specpack.tuning.profiles import check_writable, store_profile
    from specpack.tuning.tune import encode_workload
    from specpack.tuning.workload import read_workload

    engines.find(engine)  # a clear error before anything is measured
    artifact = Path(artifact)
    check_writable(artifact, key)
    manifest, wl = read_manifest(artifact), read_workload(workload)
    lens = sorted(set(draft_lens or [default_draft_len(manifest)]))
    for d in lens:
        check_draft_len(manifest, d)
    levels = sorted(set(concurrency))
    context = min(manifest.target.max_position_embeddings, 4096)
    model = SimpleNamespace(tokenizer=load_tokenizer(artifact), context_length=context)
    prompts = [(p.ids, p.max_new_tokens) for p in encode_workload(model, wl, max_new_tokens)]
    start = time.perf_counter()
    args = dict(public_key=public_key, extra=("--dtype", dtype, "--max-model-len", str(context), *extra))
    plain = _measure(engines.prepare(artifact, engine, port=_free_port(), speculative=False, **args), prompts, levels)
    passes = {}
    for d in lens:
        launch = engines.prepare(artifact, engine, port=_free_port(), draft_len=d, **args)
        passes[d] = _measure(launch, prompts, levels, d)
        bad = [i for i, (a, b) in enumerate(zip(passes[d].outputs, plain.outputs)) if a != b]
        if bad:
            raise InputError(f"{engine} with {d} draft tokens gave other greedy outputs than without speculation on "
                             f"workload lines {[wl.items[i].line for i in bad]}",
                             hint="the engine's speculation is not lossless here: no profile was stored")
    profile = _profile(manifest, wl, max_new_tokens, engine, device, dtype, plain, passes, levels, plain.version,
                       time.perf_counter() - start)
    return profile, store_profile(artifact, profile, key), {0: plain, **passes}


def _measure(launch, prompts, levels, draft_len: int = 0) -> EnginePass:
    from specpack.engines.server import EngineServer

    with EngineServer(launch) as srv:
        before = srv.counts() if draft_len else None
        t0, outputs = time.perf_counter(), [srv.complete(ids, n) for ids, n in prompts]
        seconds = time.perf_counter() - t0
        al = (srv.counts() - before).acceptance_length if draft_len else 1.0
        figures = {c: _clients(srv, prompts, c) for c in levels}
        version = _version(srv)
    return EnginePass(draft_len, outputs, sum(map(len, outputs)) / seconds, al, figures, version)


def _clients(srv, prompts, clients: int) -> tuple[float, float, float]:
    """Aggregate tokens/s and p50 / p95 request latency of `clients` closed-loop clients sending the
    workload (max(clients, prompts) requests, so every client is busy)."""
    jobs = [prompts[i % len(prompts)] for i in range(max(clients, len(prompts)))]

    def one(job):
        t0 = time.perf_counter()
        return len(srv.complete(*job)), time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    lat = sorted(s for _, s in done)
    return sum(n for n, _ in done) / wall, statistics.median(lat), lat[min(len(lat) - 1, int(0.95 * len(lat)))]


def _profile(manifest, wl, max_new_tokens, engine, device, dtype, plain: EnginePass, passes: dict, levels,
             version: str, seconds: float):
    from specpack.schemas.profile import (ConcurrencyPoint, DraftLenPoint, Evidence, ProfileMemory, ProfileSettings,
                                          Software, WorkloadInfo, make_profile)
    from specpack.tuning.profiles import kv_and_weight_bytes, this_machine

    best = max(passes.values(), key=lambda p: p.tokens_per_s)
    pays = best.tokens_per_s > plain.tokens_per_s
    chosen = best if pays else plain
    points = [ConcurrencyPoint(concurrency=c, baseline_tokens_per_s=plain.concurrency[c][0],
                               speculative_tokens_per_s=best.concurrency[c][0], baseline_p50_s=plain.concurrency[c][1],
                               baseline_p95_s=plain.concurrency[c][2], speculative_p50_s=best.concurrency[c][1],
                               speculative_p95_s=best.concurrency[c][2]) for c in levels] if pays else []
    limit = 1
    for p in points:
        if p.speculative_tokens_per_s <= p.baseline_tokens_per_s:
            break
        limit = p.concurrency
    new_tokens = sum(map(len, plain.outputs))
    evidence = Evidence(
        workload=WorkloadInfo(name=wl.name, sha256=wl.sha256, prompts=len(wl.items), max_new_tokens=max_new_tokens,
                              new_tokens=new_tokens),
        baseline_tokens_per_s=plain.tokens_per_s, speculative_tokens_per_s=chosen.tokens_per_s,
        speedup=chosen.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
        acceptance_length=chosen.acceptance_length, position_acceptance=[], greedy_equal=True,
        prompts_checked=len(plain.outputs),
        draft_len_sweep=[DraftLenPoint(draft_len=d, tokens_per_s=p.tokens_per_s, acceptance_length=p.acceptance_length,
                                       speedup=p.tokens_per_s / plain.tokens_per_s) for d, p in sorted(passes.items())],
        concurrency_sweep=points, hardware=this_machine(gpus=device == "cuda").hardware(device),
        software=Software(specpack=__version__, python=platform.python_version(),
                          platform=f"{platform.system()}-{platform.machine()}", packages={engine: version}),
        measured_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), seconds=seconds)
    settings = ProfileSettings(speculative=pays, draft_len=best.draft_len if pays else 0,
                               max_concurrency=limit if pays else 0)
    weights, kv = kv_and_weight_bytes(manifest, dtype, manifest.target.max_position_embeddings)
    memory = ProfileMemory(weights_bytes=weights, kv_cache_bytes=kv, context_tokens=manifest.target.max_position_embeddings,
                           required_bytes=weights + kv, measured_peak_bytes=0)
    return make_profile(backend=engine, device=device, dtype=dtype, drafter=manifest.drafter.kind if pays else "none",
                        settings=settings, memory=memory, evidence=evidence)


def _version(srv) -> str:
    """The engine's version as its server reports it (vLLM: /version), else "unknown"."""
    try:
        with urllib.request.urlopen(srv.url + "/version", timeout=30) as r:
            return str(json.load(r)["version"])
    except (OSError, ValueError, KeyError):
        return "unknown"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
