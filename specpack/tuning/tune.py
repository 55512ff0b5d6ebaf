"""`specpack tune`: measure settings on a workload and store them as a validated profile.

    baseline (no speculation) → sweep draft length from a heuristic start, checking greedy
    equality on every prompt → the target's cost curve (step time vs rows) → sweep draft tree shapes
    (depth, top-k, nodes) from the best length and the rows a verify takes at no cost, for drafters
    that branch → the best chain and tree again with prompt lookup beside the drafter, for model
    drafters → concurrency sweep through the serve queue → profile → manifest → sign

Figures are measured, never assumed; the draft-length heuristic only chooses where to start.
"""

from __future__ import annotations

import datetime as dt
import statistics
import logging
import platform
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from specpack._version import __version__
from specpack.errors import InputError, SpecpackError
from specpack.packager.update import recover
from specpack.runtime.drafters.base import TreeShape
from specpack.runtime.engine.cost import KEY_PROBE, measure as measure_cost
from specpack.runtime.engine.scheduler import Job, Scheduler
from specpack.runtime.engine.stats import MAX_DRAFT_LEN, MAX_TREE_NODES, MAX_TREE_TOPK, GenerationStats
from specpack.schemas.profile import (ConcurrencyPoint, CostCurve, DraftLenPoint, Evidence, Profile, ProfileMemory,
                                      ProfileSettings, Software, WorkloadInfo, make_profile)
from specpack.tuning.profiles import (KERNELS, Machine, cache_dtype_name, check_writable, kernels_build,
                                      kv_and_weight_bytes, package_version, store_profile, this_machine)
from specpack.tuning.workload import Workload, encode_request, read_workload

log = logging.getLogger(__name__)
MIN_GAIN = 1.02  # a longer/shorter draft must beat the best so far by 2% to be taken (noise)
TREE_SEARCH = 8  # tree shapes one search measures at most
LOOKUPS = (8,)  # prompt lookup lengths measured beside a model drafter by default (bench/lookup.py: 8 pays on code)


@dataclass(frozen=True)
class Prompt:
    line: int
    ids: list[int]
    max_new_tokens: int


@dataclass
class Pass:
    """One pass over the workload at one setting."""

    speculative: bool
    draft_len: int
    stats: GenerationStats
    outputs: list[list[int]]
    tree: Optional[TreeShape] = None  # draft trees of this shape, `draft_len` deep; None: chains
    lookup: int = 0  # prompt lookup copies of up to this many tokens beside the drafter; 0: off

    @property
    def tokens_per_s(self) -> float:
        return self.stats.tokens_per_s


@dataclass
class TuneResult:
    profile: Profile
    baseline: Pass
    sweep: dict[int, Pass]
    manifest_path: Path
    signed: bool
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        p = self.profile
        return {"profile": p.model_dump(mode="json"), "manifest": str(self.manifest_path), "signed": self.signed,
                "plots": [str(x) for x in self.plots], "notes": self.notes}


def merge_stats(all_stats: Sequence[GenerationStats]) -> GenerationStats:
    """Counters summed over generations (rates follow from the sums, not from averaging rates)."""
    total = GenerationStats()
    for s in all_stats:
        total.add(s)
    return total


def encode_workload(model, workload: Workload, max_new_tokens: int) -> list[Prompt]:
    """Token ids of every line; InputError lists every line that does not fit the context."""
    prompts, problems = [], []
    for item in workload.items:
        try:
            ids = encode_request(model.tokenizer, item.request)
        except InputError as exc:
            problems.append(f"line {item.line}: {exc.message}")
            continue
        new = item.request.max_tokens or max_new_tokens
        if len(ids) + new > model.context_length:
            problems.append(f"line {item.line}: {len(ids)} prompt tokens + {new} new exceed the context "
                            f"of {model.context_length}")
        prompts.append(Prompt(item.line, ids, new))
    if problems:
        raise InputError(f"workload '{workload.path}' does not fit this model", problems=problems,
                         hint="shorten those prompts or lower max_tokens / --max-new-tokens")
    return prompts


def measure_workload(model, prompts: Sequence[Prompt], draft_len: int, speculative: bool,
                     reference: Optional[Pass] = None, tick=None, tree: Optional[TreeShape] = None,
                     lookup: int = 0) -> Pass:
    """Greedy generation of every prompt, one at a time (draft trees of shape `tree`, or chains; with
    prompt lookup copies of up to `lookup` tokens); with `reference`, check token equality on every
    prompt and raise naming each line that differs."""
    stats, outputs = [], []
    for p in prompts:
        r = model.generate(p.ids, max_new_tokens=p.max_new_tokens, draft_len=draft_len,
                           speculative=speculative, tree=tree, lookup=lookup)
        stats.append(r.stats)
        outputs.append(r.tokens)
        if tick:
            tick()
    result = Pass(speculative, draft_len, merge_stats(stats), outputs, tree, lookup)
    if reference is not None:
        bad = [p.line for p, a, b in zip(prompts, outputs, reference.outputs) if a != b]
        if bad:
            shape = (f", trees {tree.topk}x{tree.nodes}" if tree else "") + (f", lookup {lookup}" if lookup else "")
            raise SpecpackError(f"speculative output at draft length {draft_len}{shape} differs from decoding "
                                f"without speculation on workload lines {bad}: no profile was written",
                                hint="this is a bug in the runtime or the drafter binding; please report it")
    return result


@dataclass(frozen=True)
class LoadPoint:
    tokens_per_s: float
    p50_s: float
    p95_s: float


def measure_concurrency(model, prompts: Sequence[Prompt], clients: int, draft_len: int, speculative: bool,
                        tick=None, cost=None, prior=None, tree: Optional[TreeShape] = None,
                        lookup: int = 0) -> LoadPoint:
    """Aggregate tokens/s and request latency of `clients` concurrent closed-loop clients sending the
    workload through the batched engine `serve` runs (its scheduler with `clients` slots and the
    `cost` model and prompt lookup of up to `lookup` tokens; max(clients, prompts) requests in all)."""
    n_requests = max(clients, len(prompts))
    latencies: list[float] = []

    def client(c: int) -> int:
        tokens = 0
        for i in range(c, n_requests, clients):
            p = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            result = sch.submit(Job(p.ids, p.max_new_tokens, speculative=speculative)).result()
            latencies.append(time.perf_counter() - t0)
            tokens += len(result.tokens)
            if tick:
                tick()
        return tokens

    max_len = max(len(p.ids) + p.max_new_tokens for p in prompts)
    with Scheduler(model, clients, max_len, draft_len, speculative=speculative, cost=cost, prior=prior,
                   tree=tree, lookup=lookup) as sch, \
            ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(client, range(clients)))
        seconds = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
    return LoadPoint(tokens / seconds if seconds > 0 else 0.0, statistics.median(latencies), q[18])


def heuristic_draft_len(manifest, device: str) -> int:
    """Where the sweep starts. GPU: D = 128/G - 1 with G query heads per KV head (NVIDIA's
    co-design arithmetic, a hypothesis the sweep tests). CPU: the artifact's own default."""
    from specpack.schemas.manifest import default_draft_len

    if device == "cuda":
        t = manifest.target
        g = max(1, t.num_attention_heads // t.num_key_value_heads)
        return max(1, min(MAX_DRAFT_LEN, round(128 / g - 1)))
    return max(1, min(MAX_DRAFT_LEN, default_draft_len(manifest)))


def max_draft_len(drafter) -> int:
    """The longest draft `drafter` accepts (MTP without layer reuse: its number of layers) or makes
    (a block drafter: its draft slots; it drafts no more however many are asked for)."""
    check = getattr(drafter, "check_draft_len", None)
    longest = min(MAX_DRAFT_LEN, getattr(drafter, "max_draft_len", MAX_DRAFT_LEN))
    while check is not None and longest > 1:
        try:
            check(longest)
            break
        except InputError:
            longest -= 1
    return longest


def _memo(measure, given=None) -> tuple[dict, Callable]:
    """(results, at): `at(x)` measures setting x once into `results`; every `given` setting is
    measured up front, in order."""
    results: dict = {}

    def at(x):
        if x not in results:
            results[x] = measure(x)
        return results[x]

    for x in sorted(set(given or ())):
        at(x)
    return results, at


def sweep_draft_len(measure, start: int, lengths: Optional[Sequence[int]] = None,
                    longest: int = MAX_DRAFT_LEN) -> dict[int, Pass]:
    """Measure the given `lengths`, or search 1..`longest` from `start`: try best ± step, move
    while it pays, halve the step when it does not (each length measured once)."""
    results, at = _memo(measure, lengths)
    if lengths:
        return results
    best = min(start, longest)
    step = max(1, best // 2)
    at(best)
    while step >= 1:
        moves = [d for d in (best - step, best + step) if 1 <= d <= longest]
        better = [d for d in moves if at(d).tokens_per_s > at(best).tokens_per_s * MIN_GAIN]
        if better:
            best = max(better, key=lambda d: at(d).tokens_per_s)
        else:
            step //= 2
    return results


Shape = tuple[int, int, int]  # a draft tree: (depth, top-k, nodes)


def tree_start(depth: int, longest: int, rows: int | None = None) -> Shape:
    """Where the tree search starts: the best chain's depth plus one, four children per node, four
    nodes per level (EAGLE-2's dynamic trees keep about as many), or fewer where a verify of `rows`
    rows is all the target takes before it turns compute-bound (`CostModel.riding_rows`: on a 2-core
    CPU at fp32 five to eight rows, where 21 would cost ~1.5x one; BENCHMARKS.md): the root and at
    most `rows - 1` nodes, never fewer than the depth."""
    d = max(1, min(depth + 1, longest))
    nodes = 4 * d if rows is None else max(d, min(4 * d, rows - 1))
    return d, 4, min(MAX_TREE_NODES, nodes)


def sweep_tree(measure, start: Shape, shapes: Optional[Sequence[Shape]] = None, longest: int = MAX_DRAFT_LEN,
               limit: int = TREE_SEARCH) -> dict[Shape, Pass]:
    """Measure the given `shapes`, or search from `start`: try one step along each of depth (±1),
    top-k (x2, /2) and nodes (x2, /2), move to the first that beats the best by MIN_GAIN, stop when
    none does or after `limit` shapes (each measured once)."""
    results, at = _memo(measure, shapes)
    if shapes:
        return results
    best, moved = start, True
    at(best)
    while moved and len(results) < limit:
        d, k, m = best
        steps = [(d + 1, k, m), (d - 1, k, m), (d, 2 * k, m), (d, k // 2, m), (d, k, 2 * m), (d, k, m // 2)]
        steps = [s for s in steps if _valid_shape(s, longest) and s not in results]
        moved = False
        for s in steps[: limit - len(results)]:
            if at(s).tokens_per_s > at(best).tokens_per_s * MIN_GAIN:
                best, moved = s, True
                break
    return results


def _valid_shape(s: Shape, longest: int = MAX_DRAFT_LEN) -> bool:
    d, k, m = s
    return 1 <= d <= longest and 2 <= k <= MAX_TREE_TOPK and d <= m <= MAX_TREE_NODES


def tune(artifact, workload, backend: str = "torch", device: str = "cpu", dtype: str = "float32",
         weights: str = "fp32", concurrency: Sequence[int] = (1, 2, 4, 8, 16),
         kv_cache: str = "model",
         draft_lens: Optional[Sequence[int]] = None,
         max_new_tokens: int = 128, repeats: int = 2, key=None, public_key=None, progress: bool = False,
         plot_dir=None, machine: Optional[Machine] = None,
         tree_shapes: Optional[Sequence[Shape]] = None, lookups: Sequence[int] | None = None) -> TuneResult:
    """Measure `artifact` on `workload` on `backend` (onnxruntime and tensorrt need the artifact's ONNX
    export) and write the best setting as a validated profile for that backend into its manifest
    (re-signed with `key`; a signed artifact without `key` is refused before any work).
    Each setting is measured `repeats` times and its fastest pass kept (less noise). Drafters that
    branch also get draft trees measured: `tree_shapes` (depth, top-k, nodes) when given (empty:
    none), else a search from the best draft length. Model drafters (not n-gram lookup) get the best
    chain and the best tree measured again with prompt lookup beside them, at each of `lookups`
    (default LOOKUPS; empty: none)."""
    from specpack.runtime.api import check_kv_cache, check_weights, load

    _check_options(concurrency, draft_lens, max_new_tokens, repeats, tree_shapes, lookups)
    check_weights(weights, backend, device, dtype)
    check_kv_cache(kv_cache, backend, dtype)
    wl = read_workload(workload)
    check_writable(Path(artifact), key)  # every option is checked before the first write
    recover(Path(artifact))
    start = time.perf_counter()
    model = load(artifact, public_key=public_key, device=device, dtype=dtype, progress=progress, weights=weights,
                 kv_cache=kv_cache, backend=backend)
    prompts = encode_workload(model, wl, max_new_tokens)
    with _Progress(progress) as bar:
        figures = _measure_all(model, prompts, device, concurrency, draft_lens, repeats, bar, tree_shapes,
                               LOOKUPS if lookups is None else lookups)
    machine = machine or this_machine(gpus=device.startswith("cuda"))
    profile = _profile(model, wl, max_new_tokens, backend, device.split(":")[0], dtype, figures, machine,
                       time.perf_counter() - start, weights, kv_cache)
    path = store_profile(artifact, profile, key)
    result = TuneResult(profile, figures["baseline"], figures["sweep"], path, key is not None)
    if plot_dir is not None:
        from specpack.tuning.report import save_plots

        result.plots, result.notes = save_plots(result, Path(plot_dir))
    log.info("tuned %s: %s", artifact, profile.name)
    return result


def remeasure(model, profile: Profile, workload) -> dict:
    """Measure `profile`'s settings again on `workload` (the one it was tuned on) with a loaded
    model: the figures to hold against its evidence. Acceptance is deterministic for greedy
    decoding, so it must match exactly; tokens/s only within the machine's noise."""
    wl = read_workload(workload)
    if wl.sha256 != profile.evidence.workload.sha256:
        raise InputError(f"workload '{wl.path}' is not the one profile {profile.name} was tuned on",
                         hint=f"use the workload '{profile.evidence.workload.name}' (sha256 "
                              f"{profile.evidence.workload.sha256[:12]}…)")
    prompts = encode_workload(model, wl, profile.evidence.workload.max_new_tokens)
    s = profile.settings
    tree = TreeShape(s.tree_topk, s.tree_nodes) if s.draft_shape == "tree" else None
    base = measure_workload(model, prompts, 1, False)
    spec = measure_workload(model, prompts, s.draft_len, True, base, tree=tree, lookup=s.lookup or 0) \
        if s.speculative else base
    return {"baseline_tokens_per_s": base.tokens_per_s, "speculative_tokens_per_s": spec.tokens_per_s,
            "acceptance_length": spec.stats.acceptance_length,
            "position_acceptance": spec.stats.position_acceptance, "new_tokens": base.stats.new_tokens,
            "acceptance_matches": spec.stats.acceptance_length == profile.evidence.acceptance_length
            and spec.stats.position_acceptance == profile.evidence.position_acceptance}


def _check_options(concurrency, draft_lens, max_new_tokens, repeats, tree_shapes=None, lookups=None) -> None:
    problems = [f"concurrency {c!r} must be a positive integer" for c in concurrency
                if not (isinstance(c, int) and c >= 1)]
    problems += [f"tree shape {s!r} is not depth 1..{MAX_DRAFT_LEN} x top-k 2..{MAX_TREE_TOPK} x nodes "
                 f"depth..{MAX_TREE_NODES}" for s in tree_shapes or ()
                 if not (isinstance(s, tuple) and len(s) == 3 and all(isinstance(x, int) for x in s)
                         and _valid_shape(s))]
    problems += [f"draft length {d!r} is outside 1..{MAX_DRAFT_LEN}" for d in draft_lens or ()
                 if not (isinstance(d, int) and 1 <= d <= MAX_DRAFT_LEN)]
    problems += [f"lookup length {n!r} is outside 1..{MAX_DRAFT_LEN}" for n in lookups or ()
                 if not (isinstance(n, int) and 1 <= n <= MAX_DRAFT_LEN)]
    if not concurrency:
        problems.append("give at least one concurrency level")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        problems.append(f"max_new_tokens {max_new_tokens!r} must be a positive integer")
    if not (isinstance(repeats, int) and repeats >= 1):
        problems.append(f"repeats {repeats!r} must be a positive integer")
    if problems:
        raise InputError("invalid tune options", problems=problems)


def _measure_all(model, prompts, device, concurrency, draft_lens, repeats, bar, tree_shapes=None,
                 lookups: Sequence[int] = ()) -> dict:
    import torch

    if model.drafter is None:
        raise InputError("the artifact has no drafter to tune")
    longest = max_draft_len(model.drafter)
    refused = [d for d in draft_lens or () if d > longest]
    if refused:
        raise InputError(f"the {model.manifest.drafter.kind} drafter takes at most {longest} draft tokens, "
                         f"not {refused}", hint=f"give --draft-lens within 1..{longest}")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for spec in (False, True):  # warm up: first calls pay for allocation and kernel setup
        model.generate(prompts[0].ids, max_new_tokens=4, speculative=spec)
    def fastest(draft_len: int, speculative: bool, reference=None, tree=None, lookup: int = 0) -> Pass:
        runs = [measure_workload(model, prompts, draft_len, speculative, reference, bar.tick, tree, lookup)
                for _ in range(repeats)]
        return max(runs, key=lambda p: p.tokens_per_s)

    bar.phase("baseline")
    baseline = fastest(1, False)
    bar.phase("draft length")
    sweep = sweep_draft_len(lambda d: fastest(d, True, baseline),
                            heuristic_draft_len(model.manifest, device.split(":")[0]), draft_lens, longest)
    chain = max(sweep.values(), key=lambda p: p.tokens_per_s)
    bar.phase("cost curve")  # before the trees: their search starts from the rows a verify takes at no cost
    model.target.setup_cache(max(64, sum(KEY_PROBE)), 1)
    cost = measure_cost(model.target, [r for r in (1, 2, 4, 8, 16, 32, 64) if r <= 8 * max(concurrency)])
    trees = {}
    if getattr(model.drafter, "tree_drafts", False) and (tree_shapes is None or tree_shapes):
        bar.phase("draft trees")
        trees = sweep_tree(lambda s: fastest(s[0], True, baseline, TreeShape(s[1], s[2])),
                           tree_start(chain.draft_len, longest, cost.riding_rows()), tree_shapes, longest)
    copies = {}
    if lookups and not getattr(model.drafter, "free_drafts", False):  # n-gram drafts are lookups already
        bar.phase("prompt lookup")
        shapes = [chain] + ([max(trees.values(), key=lambda p: p.tokens_per_s)] if trees else [])
        copies = {(p.draft_len, p.tree, n): fastest(p.draft_len, True, baseline, p.tree, n)
                  for n in sorted(set(lookups)) for p in shapes}
    best = max([*sweep.values(), *trees.values(), *copies.values()], key=lambda p: p.tokens_per_s)
    pays = best.tokens_per_s > baseline.tokens_per_s
    bar.phase("concurrency")
    prior = best.stats.position_acceptance or None
    priced = model.price(cost, best.draft_len) if pays else cost  # as serve prices drafts with the stored curve
    points = _concurrency_sweep(model, prompts, sorted(set(concurrency)), best, bar, priced, prior) if pays else []
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"baseline": baseline, "sweep": sweep, "trees": trees, "lookups": copies, "best": best, "pays": pays,
            "points": points,
            "peak": peak, "limit": _concurrency_limit(points) if pays else 0, "cost": cost}


def _concurrency_sweep(model, prompts, levels, best: Pass, bar, cost, prior) -> list[ConcurrencyPoint]:
    points = []
    for n in levels:
        base = measure_concurrency(model, prompts, n, best.draft_len, False, bar.tick)
        spec = measure_concurrency(model, prompts, n, best.draft_len, True, bar.tick, cost, prior, best.tree,
                                   best.lookup)
        points.append(ConcurrencyPoint(concurrency=n, baseline_tokens_per_s=base.tokens_per_s,
                                       speculative_tokens_per_s=spec.tokens_per_s, baseline_p50_s=base.p50_s,
                                       baseline_p95_s=base.p95_s, speculative_p50_s=spec.p50_s,
                                       speculative_p95_s=spec.p95_s))
    return points


def _concurrency_limit(points: list[ConcurrencyPoint]) -> int:
    """The highest concurrency before the first one at which speculation lost (at least 1:
    the single-stream sweep already showed it pays for one request)."""
    limit = 1
    for p in points:
        if p.speculative_tokens_per_s <= p.baseline_tokens_per_s:
            break
        limit = p.concurrency
    return limit


def _profile(model, wl: Workload, max_new_tokens, backend, device, dtype, f: dict, machine: Machine,
             seconds: float, weights: str = "fp32", kv_cache: str = "model") -> Profile:
    base, best, pays = f["baseline"], f["best"], f["pays"]
    chosen = best if pays else base
    weight_bytes, kv = kv_and_weight_bytes(model.manifest, dtype, model.context_length, cache_dtype_name(model))
    evidence = Evidence(
        workload=WorkloadInfo(name=wl.name, sha256=wl.sha256, prompts=len(wl.items), max_new_tokens=max_new_tokens,
                              new_tokens=base.stats.new_tokens),
        baseline_tokens_per_s=base.tokens_per_s, speculative_tokens_per_s=chosen.tokens_per_s,
        speedup=chosen.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0,
        acceptance_length=chosen.stats.acceptance_length, position_acceptance=chosen.stats.position_acceptance,
        greedy_equal=True, prompts_checked=len(base.outputs),
        draft_len_sweep=[_point(p, base) for _, p in sorted(f["sweep"].items())]
        + [_point(p, base) for _, p in sorted(f["trees"].items())]
        + [_point(p, base) for p in f["lookups"].values()],
        concurrency_sweep=f["points"], hardware=machine.hardware(device), software=_software(backend),
        measured_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), seconds=seconds)
    tree = best.tree if pays else None
    settings = ProfileSettings(speculative=pays, draft_len=best.draft_len if pays else 0,
                               draft_shape="tree" if tree else "chain", tree_topk=tree.topk if tree else 1,
                               tree_nodes=tree.nodes if tree else 0, lookup=(best.lookup or None) if pays else None,
                               max_concurrency=f["limit"], cost_curve=CostCurve(**f["cost"].to_dict()))
    memory = ProfileMemory(weights_bytes=weight_bytes, kv_cache_bytes=kv, context_tokens=model.context_length,
                           required_bytes=weight_bytes + kv, measured_peak_bytes=f["peak"])
    return make_profile(backend=backend, device=device, dtype=dtype, weights=None if weights == "fp32" else weights,
                        kv_cache=None if kv_cache == "model" else kv_cache, drafter=model.manifest.drafter.kind if pays else "none",
                        settings=settings, memory=memory, evidence=evidence)


def _point(p: Pass, base: Pass) -> DraftLenPoint:
    t = p.tree
    return DraftLenPoint(draft_len=p.draft_len, tree_topk=t.topk if t else 1, tree_nodes=t.nodes if t else 0,
                         lookup=p.lookup or None, tokens_per_s=p.tokens_per_s,
                         acceptance_length=p.stats.acceptance_length, speedup=p.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0)


def _software(backend: str) -> Software:
    packages = {name: package_version(name) for name in (backend, "transformers", "tokenizers", "numpy")}
    packages[KERNELS] = kernels_build()  # the cost curve is only reused with these kernels
    return Software(specpack=__version__, python=platform.python_version(),
                    platform=f"{platform.system()}-{platform.machine()}", packages=packages)


class _Progress:
    """A generation counter on stderr (tqdm) while tuning; silent when off."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(desc="tune", unit="gen", leave=False)

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def phase(self, name: str) -> None:
        log.info("tune: %s", name)
        if self.bar is not None:
            self.bar.set_description(f"tune: {name}")

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
