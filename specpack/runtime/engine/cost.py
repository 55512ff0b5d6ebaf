"""How many tokens each sequence drafts this step: a cost model measured on this machine and each
sequence's recent acceptance.

A step costs `step_ms(rows)` for the target forward (rows = every sequence's 1 + D_i plus prefill
rows; flat while streaming the weights dominates, then rising past the compute knee; measured at an
empty cache), plus `key_ms` per attended key (a row attends its whole sequence: attention and the
per-sequence work grow with context, which the engine learns online from its own step times), plus,
for model drafters, `draft_ratio * step_ms(jobs)` per sequential draft step over `jobs` sequences (one per
drafted position; one in all for a block drafter, whose one forward drafts every position; a
head's forward costs about its share of the weights; learned as it drafts) and the head's catch-up:
a sequence that has not drafted for a while first feeds the head every position committed since
(its first draft of the prompt, too), `draft_ratio` times a target row each. Draft position j of sequence i adds one
row and is worth its survival S_ij (the chance it and every draft before it are accepted). The
step takes the draft positions in order of survival while tokens per millisecond keep rising
(the rule of vLLM's adaptive verification: argmax_k (n + Σ top-k S) / cost(n + k)): full drafts
while a step is bandwidth-bound, shorter ones near the knee, none above it. Lossless whatever it
chooses: only the number of proposed tokens changes.

The drafter's call is `draft_call_ms` (fixed: its catch-up, its setup) plus `draft_ratio` times the
target's time for its passes, and every step carries `overhead_ms`; all are measured at start
(`measure_drafter`, SpecModel.measure_overhead) and refitted online by `LinearFit`.
"""

from __future__ import annotations

import bisect
import functools
import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CostModel:
    """Target step time (ms) at measured row counts; a draft step over J sequences costs
    `draft_ratio * step_ms(J)` (0: free drafts, n-gram)."""

    rows: tuple[int, ...]
    ms: tuple[float, ...]
    draft_ratio: float = 0.0
    # a model drafter's call costs this much beyond its per-pass share (its catch-up on committed
    # positions, its setup): learned with draft_ratio by DraftFit
    draft_call_ms: float = 0.0
    # one head forward drafts every position (block drafters: DFlash, DSpark, LiLiCorr), so a draft of
    # any length costs one head step; else each position costs one (EAGLE-3, MTP, draft models)
    parallel_drafts: bool = False
    key_ms: float = 0.0  # per row per attended key (measured at start when possible, then learned online)
    key_ms_measured: float = 0.0  # the start-up measurement: online learning stays within a factor 4 of it
    # what a step takes beyond the curve's forward and the drafting: the engine's own work (planning,
    # sampling, accepting, emitting) and what a curve of bare forwards leaves out, spent whatever is
    # drafted, so a step that gains more tokens spreads it over them. Measured at start
    # (SpecModel.measure_overhead), then learned online with key_ms (LinearFit). On a target whose forward
    # takes 0.15 ms it is 0.1-0.2 ms, and a model without it found drafts never paid there (issue 43); on
    # SmolLM2 it starts at 0 (its curve, logits for every row, is dearer than a greedy step's forward)
    overhead_ms: float = 0.0

    def step_ms(self, rows: int) -> float:
        """Piecewise-linear in the rows; past the last point, the last slope."""
        xs, ys = self.rows, self.ms
        if rows <= xs[0] or len(xs) == 1:
            return ys[0]
        i = min(bisect.bisect_left(xs, rows), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    @functools.cached_property
    def _curve(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.rows, dtype=float), np.asarray(self.ms, dtype=float)

    def step_ms_many(self, rows: np.ndarray) -> np.ndarray:
        """`step_ms` of every row count in `rows` (the same arithmetic, elementwise)."""
        xs, ys = self._curve
        rows = np.asarray(rows, dtype=float)
        if len(xs) == 1:
            return np.full(rows.shape, ys[0])
        i = np.minimum(np.maximum(np.searchsorted(xs, rows), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return np.where(rows <= xs[0], ys[0], y0 + (y1 - y0) * (rows - x0) / (x1 - x0))

    def passes(self, depth):
        """The head forwards a draft `depth` positions deep takes (an int, or elementwise an array)."""
        if not self.parallel_drafts:
            return depth
        return np.minimum(depth, 1) if isinstance(depth, np.ndarray) else min(depth, 1)

    def time(self, rows: int, depth: int = 0, jobs: int = 0, keys: int = 0, absorbed: int = 0) -> float:
        """A step of `rows` target rows attending `keys` keys in all, after a draft `depth` positions
        deep over `jobs` sequences that first fed the head `absorbed` committed positions."""
        draft = self.passes(depth) * self.draft_ratio * self.step_ms(jobs) + self.draft_call_ms if depth and jobs else 0.0
        return self.step_ms(rows) + self.key_ms * keys + draft + self.absorb_ms() * absorbed

    def row_ms(self) -> float:
        """A target row's cost once compute-bound: the curve's last slope."""
        if len(self.rows) < 2:
            return self.ms[0]
        return max(0.0, (self.ms[-1] - self.ms[-2]) / (self.rows[-1] - self.rows[-2]))

    def riding_rows(self, slack: float = 0.1) -> int:
        """The most rows a step takes at most `slack` dearer than one row: the rows that ride the
        weight stream before the products turn compute-bound (up to the curve's last point)."""
        base = self.step_ms(1) * (1 + slack)
        return max([r for r in range(1, self.rows[-1] + 1) if self.step_ms(r) <= base], default=1)

    def absorb_ms(self) -> float:
        """The head's cost per committed position it catches up on."""
        return self.draft_ratio * self.row_ms()

    def with_draft_ratio(self, ratio: float, call_ms: float | None = None) -> "CostModel":
        return replace(self, draft_ratio=ratio, draft_call_ms=self.draft_call_ms if call_ms is None else call_ms)

    def with_step(self, overhead_ms: float, key_ms: float) -> "CostModel":
        return replace(self, overhead_ms=overhead_ms, key_ms=key_ms)

    def to_dict(self) -> dict:
        out = {"rows": list(self.rows), "ms": [round(m, 3) for m in self.ms]}
        return {**out, "key_ms": self.key_ms_measured} if self.key_ms_measured else out

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        key = float(d.get("key_ms") or 0.0)
        return cls(tuple(d["rows"]), tuple(d["ms"]), key_ms=key, key_ms_measured=key)


KEY_PROBE = (8, 512)  # rows, context: the attention probe


@torch.inference_mode()
def measure(target, rows: Sequence[int] = DEFAULT_ROWS, passes: int = 5, slot: int = 0) -> CostModel:
    """Time one target forward over R rows (one sequence, empty cache) for each R; and, when the
    cache holds KEY_PROBE's context, the cost per attended key (the same rows after that many
    positions). Every forward is timed in `passes` rounds over all of them after a warm-up round, the
    row counts taking turns, and each keeps its fastest: a busy moment (this machine drifts by 10-20%,
    and a neighbour's burst can double one forward) lands on one pass of one point, not on a point's
    every sample, so it cannot bend the curve the engine prices drafts with (a curve whose one-row
    point came out 35% slow made 8 rows look cheap and the drafts they carry dear). A forward over
    more rows never costs less: the curve is made non-decreasing. Uses `slot` of the target's cache,
    which must be free."""
    rows = [r for r in rows if r <= target.cache.max_len]
    probe_rows, context = KEY_PROBE
    shapes = [(0, r) for r in rows]
    if context + probe_rows <= target.cache.max_len:
        shapes = list(dict.fromkeys(shapes + [(context, probe_rows), (0, probe_rows)]))  # (0, 8) once
    best = {shape: float("inf") for shape in shapes}
    for i in range(passes + 1):
        for shape in shapes:
            ms = _time_forward(target, slot, *shape)
            if i:  # the first pass warms up
                best[shape] = min(best[shape], ms)
    ms = np.maximum.accumulate([best[(0, r)] for r in rows]).tolist()
    key_ms = 0.0
    if (context, probe_rows) in best:
        key_ms = max(best[(context, probe_rows)] - best[(0, probe_rows)], 0.0) / (probe_rows * context)
    return CostModel(tuple(rows), tuple(ms), key_ms=key_ms, key_ms_measured=key_ms)


@torch.inference_mode()
def measure_drafter(target, drafter, cost: CostModel, depth: int, rounds: int = 3) -> CostModel:
    """`cost` with a model drafter's call time measured on this machine, in DraftFit's terms
    (`draft_call_ms + draft_ratio * passes(k) * step_ms(1)`): after a prompt's catch-up, calls as a
    decoding sequence makes them (two newly committed positions each), `rounds` of one level and of
    `depth` levels taking turns, each depth's fastest kept (as `measure` keeps each forward's).
    Two depths give both terms; where there is one (an MTP drafter of one layer) or they cost the
    same passes (a block drafter), the ratio stays
    `cost`'s and the call takes the rest. Uses slot 0 of the target's and the drafter's caches."""
    from specpack.runtime.drafters.base import DraftJob
    from specpack.runtime.models.rows import Rows, Segment

    n, new = 24, 2
    total = n + 2 * rounds * new
    tokens = torch.randint(0, target.spec.vocab_size, (total,), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(target.device)
    target.setup_cache(total + 1, 1)
    aux = target.forward_rows(tokens, Rows.of([Segment(0, 0, total)], target.device), tuple(drafter.capture_layers),
                              logits_rows=[]).aux
    drafter.reserve(1, total + depth + 1)
    drafter.start(0)
    drafter.draft([DraftJob(0, tokens[:n], None if aux is None else aux[: n - 1], 1, None)])  # catch-up, warm-up
    best: dict[int, float] = {}
    for i in range(2 * rounds):
        k, feats = (depth, 1)[i % 2] if depth > 1 else 1, None if aux is None else aux[n - 1: n - 1 + new]
        n += new
        t0 = time.perf_counter()
        drafter.draft([DraftJob(0, tokens[:n], feats, k, None)])
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 - cost.absorb_ms() * new
        best[k] = min(best.get(k, float("inf")), max(ms, 0.0))
    x = {k: cost.passes(k) * cost.step_ms(1) for k in best}
    ratio = cost.draft_ratio
    if len(best) == 2 and x[depth] > x[1]:
        ratio = max((best[depth] - best[1]) / (x[depth] - x[1]), 0.0)
    ratio = min(ratio, best[1] / x[1]) if x[1] > 0 else ratio
    return cost.with_draft_ratio(ratio, max(best[1] - ratio * x[1], 0.0))


def _time_forward(target, slot: int, start: int, rows: int) -> float:
    """Milliseconds of one forward over `rows` rows after `start` positions (logits for every row)."""
    from specpack.runtime.models.rows import Rows, Segment

    tokens = torch.randint(0, target.spec.vocab_size, (rows,), generator=torch.Generator().manual_seed(0))
    layout = Rows.of([Segment(slot, start, rows)], target.device)
    tokens = tokens.to(target.device)
    t0 = time.perf_counter()
    target.forward_rows(tokens, layout, logits_rows=list(range(rows)))
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


class LinearFit:
    """y = a + b * x, refitted online by exponentially weighted least squares as observations come.

    The engine keeps two: a model drafter's call (x: the target's time for the call's passes,
    `passes(depth) * step_ms(rows)`; a: `draft_call_ms`, its catch-up and setup; b: `draft_ratio`)
    and its own step (x: the keys the rows attend; y: the step's time beyond the drafting and the
    curve's forward; a: `overhead_ms`, b: `key_ms`). The estimates live in the CostModel and are
    handed in each time; the fit keeps only the weighted moments, starting from the estimate as a
    first point. Observations whose x vary by SPREAD of their mean give the slope (within
    `b_range`); while they do not (a drafter asked for one depth, a block drafter's one pass), the
    slope stays and the intercept takes the rest, so what is observed is priced right either way.
    One observation counts at most CAP times its prediction (the first call, cold; a page fault; a
    busy neighbour): a fit that stopped every draft could never be measured again."""

    SPREAD, CAP = 0.05, 4.0

    def __init__(self, weight: float = 0.2, b_range: tuple[float, float] = (0.0, float("inf"))):
        self.weight, self.b_range = weight, b_range
        self.mx: float | None = None  # weighted means of x and y, their (co)variance
        self.my = self.cxx = self.cxy = 0.0

    def observe(self, a: float, b: float, x: float, y: float) -> tuple[float, float]:
        """The estimates (a, b) refitted after observing y at x."""
        predicted = a + b * x
        if predicted > 0:
            y = min(y, self.CAP * predicted)
        if self.mx is None and predicted <= 0 < x:  # nothing known: all of it per unit of x, at face value
            self.mx, self.my = x, y
            return 0.0, max(y, 0.0) / x
        if self.mx is None:  # nothing observed yet: the estimate is the first point
            self.mx, self.my = x, predicted
        w, dx, dy = self.weight, x - self.mx, y - self.my
        self.mx, self.my = self.mx + w * dx, self.my + w * dy
        self.cxx, self.cxy = (1 - w) * (self.cxx + w * dx * dx), (1 - w) * (self.cxy + w * dx * dy)
        if self.cxx > (self.SPREAD * self.mx) ** 2:
            b = self.cxy / self.cxx
        if self.mx > 0:
            b = min(b, max(self.my, 0.0) / self.mx)  # no negative intercept
        b = min(max(b, self.b_range[0]), self.b_range[1])
        return max(self.my - b * self.mx, 0.0), b

    def moved(self, a: float, b: float) -> None:
        """The estimates were moved from outside (drifting back while nobody drafts): the mean
        follows, so the next observation is weighed against them."""
        if self.mx is not None:
            self.my = a + b * self.mx


class Acceptance:
    """One sequence's per-position conditional acceptance, an exponential moving average over its
    verifications, starting from `prior` and drifting back to it while a position goes untried
    (so a sequence whose drafts stopped paying is probed again later)."""

    def __init__(self, prior: Sequence[float], weight: float = 0.3, relax: float = 0.05,
                 start: Sequence[float] | None = None):
        self.prior, self.rate = list(prior), list(start if start is not None else prior)
        while len(self.prior) < len(self.rate):
            self.prior.append(self.prior[-1] if self.prior else 0.0)
        self.weight, self.relax = weight, relax
        self._survival: list[float] = []  # S_1.. as far as asked since the last update

    def rates(self) -> tuple[float, ...]:
        """The current per-position rates (a new sequence's starting point)."""
        return tuple(self.rate)

    def _at(self, j: int) -> float:
        return self.rate[j] if j < len(self.rate) else (self.rate[-1] if self.rate else 0.0)

    def survival(self, k: int) -> list[float]:
        """S_1..S_k: the chance drafts 1..j are all accepted."""
        out = self._survival
        while len(out) < k:
            out.append((out[-1] if out else 1.0) * self._at(len(out)))
        return out[:k]

    def update(self, proposed: int, accepted: int) -> None:
        self._survival = []
        while len(self.rate) < proposed:
            self.rate.append(self._at(len(self.rate)))
            self.prior.append(self.rate[-1])
        for j in range(len(self.rate)):
            if j < min(accepted + 1, proposed):  # tried: all before it were accepted
                self.rate[j] += self.weight * ((j < accepted) - self.rate[j])
            else:
                self.rate[j] += self.relax * (self.prior[j] - self.rate[j])


class Calibration:
    """How one sequence's tree-draft probabilities translate into acceptance, per depth d: how
    often its verified paths reached depth d over the draft probability it verified at depth d
    (the drafter's own estimate of the same chance), both as moving averages starting equal (the
    drafter taken at its word). A node's estimated survival is its cumulative draft probability
    times its depth's ratio, never above its parent's."""

    def __init__(self, weight: float = 0.3, start: tuple[list[float], list[float]] | None = None):
        self.weight = weight
        self.reached, self.said = (list(start[0]), list(start[1])) if start else ([], [])

    def state(self) -> tuple[list[float], list[float]]:
        """Its averages (a new sequence's starting point)."""
        return list(self.reached), list(self.said)

    def ratio(self, d: int) -> float:
        """Depth d's acceptance per unit of draft probability (1 until measured)."""
        if d > len(self.reached) or self.said[d - 1] <= 0:
            return 1.0
        return self.reached[d - 1] / self.said[d - 1]

    def estimate(self, parents: Sequence[int], scores: Sequence[float]) -> list[float]:
        """Each node's chance of being on the accepted path (nodes in topological order)."""
        out, depth = [], []
        for p, c in zip(parents, scores):
            depth.append(1 if p < 0 else depth[p] + 1)
            out.append(min(1.0 if p < 0 else out[p], self.ratio(depth[-1]) * c))
        return out

    def update(self, depths: Sequence[int], scores: Sequence[float], accepted: int) -> None:
        """One verified tree (each node's depth and draft probability) whose path was `accepted` deep."""
        mass = [0.0] * max(depths, default=0)
        for d, c in zip(depths, scores):
            mass[d - 1] += c
        while len(self.reached) < len(mass):
            self.reached.append(1.0)
            self.said.append(1.0)
        for d, m in enumerate(mass, 1):
            self.reached[d - 1] += self.weight * ((accepted >= d) - self.reached[d - 1])
            self.said[d - 1] += self.weight * (m - self.said[d - 1])


MARGIN = 0.03  # drafts must promise this much more throughput than none: smaller gains are noise here


def choose(limits: Sequence[int], survival: Sequence[Sequence[float]], base_rows: int, cost: CostModel,
           contexts: Sequence[int] | None = None, base_keys: int = 0, margin: float = MARGIN,
           pending: Sequence[int] | None = None, sunk_rows: int = 0, sunk_keys: int = 0,
           widths: Sequence[int] | None = None, drafted: bool = False, drafted_ms: float = 0.0) -> list[int]:
    """Draft lengths for sequences that may draft up to `limits[i]` tokens with survivals
    `survival[i]`, on top of `base_rows` rows attending `base_keys` keys (each sequence's last
    token); a draft row of sequence i attends about `contexts[i]` keys, and its first one makes the
    head catch up on `pending[i]` positions and adds `widths[i]` rows (1; a tree's top-k) to each
    head step. The step also carries `sunk_rows` prompt rows
    (`sunk_keys` keys) that must run anyway: they set where on the curve draft rows are priced, but
    their cost is not held against the drafts (else a step made slow by a prefill chunk would make
    any draft look cheap). No drafts unless they promise `margin` more tokens per millisecond.
    `drafted`: the drafts are made (a confidence head cuts them): only their rows are priced, and
    the `drafted_ms` they took counts in the step's time whatever is kept (see `_best_prefix`)."""
    lengths = [0] * len(limits)
    cut = [surv[:k] for surv, k in zip(survival, limits)]
    if not any(cut):
        return lengths
    s, j, i = _candidates(cut)
    order = np.lexsort((j, -s))  # best first; equal survivals: the shorter draft first, then the sequence
    s, j, i = s[order], j[order], i[order]
    take = _best_prefix(s, j, i, len(limits), base_rows, cost, contexts, base_keys, margin, sunk_rows, sunk_keys,
                        pending, widths, draft=not drafted, drafted_ms=drafted_ms if drafted else 0.0)
    for n, k in zip(i[:take].tolist(), j[:take].tolist()):
        lengths[n] = max(lengths[n], k)
    return lengths


def choose_nodes(survival: Sequence[Sequence[float]], depths: Sequence[Sequence[int]], base_rows: int,
                 cost: CostModel, contexts: Sequence[int] | None = None, base_keys: int = 0, margin: float = 0.0,
                 sunk_rows: int = 0, sunk_keys: int = 0, drafted_ms: float = 0.0) -> list[list[int]]:
    """Which drafted nodes each sequence verifies (ascending indices): nodes n of sequence i with
    estimated survival `survival[i][n]` (never above its parent's; parents first) at depth
    `depths[i][n]`, taken in order of survival while tokens per millisecond keep rising, as
    `choose` does (the drafting itself is done, in `drafted_ms`: only verification rows are priced),
    so every kept node's ancestors are kept."""
    keep: list[list[int]] = [[] for _ in survival]
    if not any(survival):
        return keep
    s, n, i = _candidates(survival)
    order = np.lexsort((n, i, -s))  # best first; equal survivals: by sequence, then parents first
    s, n, i = s[order], n[order] - 1, i[order]
    d = np.concatenate([np.asarray(x, dtype=np.int64) for x in depths if len(x)])[order]
    take = _best_prefix(s, d, i, len(survival), base_rows, cost, contexts, base_keys, margin, sunk_rows, sunk_keys,
                        drafted_ms=drafted_ms)
    for q, m in zip(i[:take].tolist(), n[:take].tolist()):
        keep[q].append(m)
    return [sorted(k) for k in keep]


def _candidates(survival: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (survival, 1-based position, sequence) as three flat arrays, sequence by sequence."""
    sizes = [len(x) for x in survival]
    s = np.concatenate([np.asarray(x, dtype=float) for x in survival if len(x)])
    j = np.concatenate([np.arange(1, k + 1) for k in sizes if k])
    i = np.repeat(np.arange(len(sizes)), sizes)
    return s, j, i


def _best_prefix(s: np.ndarray, j: np.ndarray, i: np.ndarray, sequences: int, base_rows: int, cost: CostModel,
                 contexts, base_keys: int, margin: float, sunk_rows: int, sunk_keys: int, pending=None, widths=None,
                 draft: bool = False, drafted_ms: float = 0.0) -> int:
    """How many candidates to verify, each one row, best first: candidate c is sequence `i[c]`'s row
    at depth `j[c]` with survival `s[c]`. The prefix with the most tokens per millisecond (each
    sequence's last token counts one), none unless that beats no drafts by `margin`. With `draft`,
    the head's steps are priced too. `drafted_ms`: drafts already made took that long; it is spent
    whatever is verified, yet it is part of the step: a row is worth its time when its tokens beat
    the step's whole rate, drafting included, not the rate of the verification alone (which would
    cut a costly draft to its first rows, the more the dearer it was). Every prefix at once (numpy;
    the engine asks each step)."""
    rows, keys = base_rows + sunk_rows, base_keys + sunk_keys
    floor = cost.time(rows, keys=keys)  # this step without drafts
    own = cost.time(base_rows, keys=base_keys) + cost.overhead_ms + drafted_ms  # the decoding rows' step alone
    base = sequences / own
    tokens = np.cumsum(np.concatenate([[float(sequences)], s]))[1:]  # summed in order, as one by one
    n_rows = rows + np.arange(1, len(s) + 1)
    n_keys = keys + (np.cumsum(np.asarray(contexts)[i] + j) if contexts else 0)
    time = cost.step_ms_many(n_rows) + cost.key_ms * n_keys
    if draft:
        first = j == 1
        depth = np.maximum.accumulate(j)
        jobs = np.cumsum(first * (np.asarray(widths)[i] if widths else 1))
        time = time + np.where(jobs > 0, cost.passes(depth) * cost.draft_ratio * cost.step_ms_many(jobs)
                               + cost.draft_call_ms, 0.0)
        if pending:
            time = time + cost.absorb_ms() * np.cumsum(first * np.asarray(pending)[i])
    rate = tokens / (own + time - floor)
    best = int(np.argmax(rate))  # the first of the best: a longer prefix must do strictly better
    return best + 1 if rate[best] > base and rate[best] >= base * (1 + margin) else 0
