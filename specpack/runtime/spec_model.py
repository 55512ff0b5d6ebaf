"""`SpecModel`: one module whose submodules are the target and its drafter; plus the loaders."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from specpack.errors import InputError
from specpack.runtime.drafters import DRAFTERS, load_drafter
from specpack.runtime.engine import MAX_DRAFT_LEN, Engine, GenerationResult, Request, SamplingParams
from specpack.runtime.models.dense import Transformer
from specpack.runtime.models.weights import load_target

__all__ = ["SpecModel", "load_target", "load_drafter", "DRAFTERS", "MAX_DRAFT_LEN"]


class SpecModel(nn.Module):
    """A target and its drafter run as one model: draft, verify in one forward, accept, roll back."""

    def __init__(self, target: Transformer, drafter: nn.Module | None = None, context_length: int | None = None):
        super().__init__()
        self.target = target
        self.drafter = drafter
        self.context_length = min(context_length or target.spec.context_length, target.spec.context_length)
        self._costs: dict = {}  # what was measured on this machine: curves by rows, drafter and step costs

    def measure_cost(self, rows: Sequence[int] = (1, 2, 4, 8)):
        """The target's cost curve on this machine (engine.cost.measure: step time for each row count
        in `rows`, and the cost per attended key), measured once per loaded model and kept (and, for a
        loaded artifact, once per machine: engine.cost_store): what the
        engine chooses draft lengths with when no profile brings a curve. Uses the target's cache."""
        from specpack.runtime.engine import cost_store
        from specpack.runtime.engine.cost import KEY_PROBE, measure

        def fresh():
            self.target.setup_cache(max(64, max(rows), sum(KEY_PROBE)), 1)
            return measure(self.target, rows)

        rows = tuple(rows)
        if rows not in self._costs:
            self._costs[rows] = cost_store.recall(getattr(self, "identity", None), rows, fresh)
        return self._costs[rows]

    def price(self, cost, draft_len: int):
        """`cost` (engine.cost.CostModel) as run, serve and tune price drafts with it: the drafter's
        call time measured on this machine (`measure_drafter`, from a starting ratio of its share of the
        weights; n-gram drafts are free; a block drafter's one pass drafts its whole block) and the
        engine's own time per step (`measure_overhead`). The engine keeps learning both as it runs."""
        from dataclasses import replace

        if self.drafter is not None and not getattr(self.drafter, "free_drafts", False):
            mem = self.manifest.memory
            cost = cost.with_draft_ratio(max(0.02, mem.drafter_weight_bytes / max(mem.target_weight_bytes, 1)))
            cost = replace(cost, parallel_drafts=bool(getattr(self.drafter, "parallel_drafts", False)))
            cost = self.measure_drafter(cost, draft_len)
        return cost.with_step(self.measure_overhead(cost), cost.key_ms)

    def measure_drafter(self, cost, depth: int):
        """`cost` (engine.cost.CostModel) with the drafter's call time measured on this machine
        (engine.cost.measure_drafter), once per loaded model and depth: where the engine's online fit
        starts. Free drafters (n-gram) cost nothing. Uses the target's and the drafter's caches."""
        from specpack.runtime.engine.cost import measure_drafter

        if self.drafter is None or getattr(self.drafter, "free_drafts", False):
            return cost
        key = ("drafter", depth, cost.draft_ratio, cost.rows, cost.ms)
        if key not in self._costs:
            self._costs[key] = measure_drafter(self.target, self.drafter, cost, depth)
        measured = self._costs[key]
        return cost.with_draft_ratio(measured.draft_ratio, measured.draft_call_ms)

    def measure_overhead(self, cost, steps: int = 16) -> float:
        """Milliseconds an engine step takes beyond what `cost` (engine.cost.CostModel) prices its
        forward at: the engine's own work (planning, sampling, accepting, emitting) and what the
        curve, measured over bare forwards, leaves out. Learned over a short plain generation, once
        per loaded model and curve: a step that drafts spreads it over more tokens, so the cost
        model starts from it (and keeps learning it). Uses the target's cache."""
        key = ("overhead", cost.rows, cost.ms, cost.key_ms)
        if key not in self._costs:
            engine = Engine(self.target, None, 1, steps + 2, None, cost.with_step(0.0, cost.key_ms))
            engine.add(Request([0], steps, eos=(), speculative=False))
            with torch.inference_mode():
                while engine.running:
                    engine.step()
            self._costs[key] = engine.cost.overhead_ms
        return self._costs[key]

    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int = 128, draft_len: int = 4,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_ids: Sequence[int] | None = None, stop: Sequence[Sequence[int]] | None = None,
                 speculative: bool = True, on_tokens: Callable[[list[int]], None] | None = None,
                 adaptive: bool | None = None, cost=None, prior=None, tree=None, lookup: int = 0) -> GenerationResult:
        """Generate up to `max_new_tokens` after `prompt_ids`: the batched engine with one sequence.

        `draft_len` is the longest draft; with `adaptive` the loop drafts fewer tokens while the
        target rejects them, and none for a while when even one keeps failing (see
        speculative.DraftLength); `adaptive=False` always drafts `draft_len`. None (the default)
        takes the drafter's policy: adaptive for n-gram, whose drafts are free and hit in runs;
        fixed for model drafters, whose every drafted token costs a forward and whose acceptance
        is steadier (measured on SmolLM2 with a distilled EAGLE-3 head: adaptive lowered the
        acceptance length from 1.38 to 1.12 on open chat).

        Greedy (temperature 0) output is token-identical with and without speculation; sampling
        keeps the target's distribution, and a seed gives the same tokens either way. `eos_ids`
        defaults to the target's; `stop` lists token-id sequences that end generation; `on_tokens`
        receives each step's new tokens. The result's tokens include a final EOS / stop sequence;
        see GenerationStats for the counters. With a `cost` model (engine.cost.CostModel, e.g. a
        profile's) the draft length of each step follows it and the acceptance record (from `prior`).
        `tree` (drafters.base.TreeShape: children per node, nodes in all) drafts trees `draft_len`
        deep where the drafter can branch, verified in one forward (lossless as chains are). With
        `lookup` N, a step where the context's last tokens occurred before drafts up to max(draft_len, N)
        tokens copied from what followed them instead of asking the drafter (free; see Request.lookup)."""
        prompt = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else [int(t) for t in prompt_ids]
        if adaptive is None:
            adaptive = bool(getattr(self.drafter, "adaptive_draft_len", False))
        req = Request(prompt, max_new_tokens, SamplingParams(float(temperature), int(top_k), float(top_p)), seed,
                      self.target.spec.eos_token_ids if eos_ids is None else tuple(eos_ids),
                      tuple(tuple(s) for s in stop or () if s), speculative, draft_len, adaptive, on_tokens,
                      tree=tree, lookup=lookup)
        if speculative and self.drafter is None:
            raise InputError("speculative decoding needs a drafter", hint="pass speculative=False or load one")
        size = min(self.context_length, len(prompt) + (max_new_tokens if isinstance(max_new_tokens, int) else 1))
        engine = Engine(self.target, self.drafter if speculative else None, 1, max(size, 1), None, cost,
                        **({"prior": prior} if prior else {}))
        with torch.inference_mode():
            result = engine.run([req])[0]
        return result
