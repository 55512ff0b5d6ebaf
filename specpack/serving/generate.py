"""One call from text to text for `specpack run`: load (verified), encode, stream, report."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    chat: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    draft_len: int | None = None
    speculative: bool = True
    stop: list[str] = field(default_factory=list)
    profile: str | None = None  # validated profile name or id; None: the best runnable one, else defaults
    draft_tree: tuple | None = None  # drafters.base.TreeShape (top-k 1: chains); None: the profile's
    lookup: int | None = None  # prompt-lookup drafts of up to this many tokens where the context repeats
    # (engine Request.lookup); 0: off; None: the profile's


def engine_settings(model, selection, slots: int = 1, measure: bool = False) -> dict:
    """The engine's cost curve (the profile's, else with `measure` one measured on this machine,
    once per loaded model) and acceptance prior, for a model that drafts: draft lengths then follow
    the cost model, so speculation stops where it does not pay."""
    from specpack.runtime.engine.cost import CostModel

    out = {}
    prior = getattr(selection, "position_acceptance", None)
    if prior:
        out["prior"] = tuple(prior)
    curve = getattr(selection, "cost_curve", None)
    if curve:
        out["cost"] = CostModel.from_dict(curve)
    elif measure and selection.speculative and model.drafter is not None:
        out["cost"] = model.measure_cost(tuple(r for r in (1, 2, 4, 8, 16, 32, 64) if r <= 8 * slots))
        log.info("cost curve measured: %s", out["cost"].to_dict())
    if "cost" in out:
        out["cost"] = with_draft_prior(model, out["cost"])
    return out


def with_draft_prior(model, cost):
    """`cost` (engine.cost.CostModel) with the drafter's starting draft ratio: a head's forward costs
    about its share of the weights (the engine learns the real ratio as it drafts, and drifts back
    to this one while nobody drafts); n-gram drafts are free."""
    if getattr(model.drafter, "free_drafts", False):
        return cost
    mem = model.manifest.memory
    return cost.with_draft_ratio(max(0.02, mem.drafter_weight_bytes / max(mem.target_weight_bytes, 1)))


def generate_text(artifact, req: GenerateRequest, public_key=None, device: str = "cpu",
                  dtype: str = "float32", write: Callable[[str], None] | None = None,
                  progress: bool = False, model=None, backend: str = "torch", weights: str = "fp32",
                  kv_cache: str = "model") -> dict:
    """Generate for `req` from the artifact (or an already loaded `model`) and return the text,
    token ids and figures as plain data (the `--json` shape of `specpack run`)."""
    from specpack.errors import InputError
    from specpack.runtime.api import load
    from specpack.runtime.text import TextStream, encode_prompt, stop_sequences
    from specpack.schemas.manifest import check_draft_len
    from specpack.tuning.profiles import select_profile

    if req.temperature < 0:
        raise InputError(f"temperature {req.temperature} is negative", hint="use 0 (greedy) or more")
    model = model or load(artifact, public_key=public_key, device=device, dtype=dtype, progress=progress,
                          backend=backend, weights=weights, kv_cache=kv_cache)
    tok = model.tokenizer
    ids = encode_prompt(tok, req.prompt, req.chat)
    stream = TextStream(tok, write or (lambda s: None), stops=list(req.stop))
    chosen = select_profile(model.manifest, device, dtype, wanted=req.profile, backend=backend, weights=weights,
                            kv_cache=kv_cache)
    if req.draft_len is not None:  # a block's slots, MTP's layers: refused, not clipped
        check_draft_len(model.manifest, req.draft_len)
    draft_len = req.draft_len if req.draft_len is not None else chosen.draft_len
    speculative = req.speculative and (chosen.speculative or req.draft_len is not None or req.draft_tree is not None)
    tree = req.draft_tree if req.draft_tree is not None else chosen.tree
    tree = tree if tree is not None and tree.topk > 1 else None
    lookup = req.lookup if req.lookup is not None else chosen.lookup
    # no profile curve: measure one, unless the draft length is given (then it is drafted as given)
    settings = engine_settings(model, chosen, measure=speculative and req.draft_len is None)
    result = model.generate(ids, max_new_tokens=req.max_new_tokens, draft_len=draft_len,
                            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                            seed=req.seed, stop=stop_sequences(tok, req.stop),
                            speculative=speculative, on_tokens=stream, tree=tree, lookup=lookup, **settings)
    s = result.stats
    return {"text": stream.flush(), "token_ids": result.tokens, "prompt_tokens": len(ids),
            "finish_reason": result.finish_reason, "speculative": speculative,
            "profile": chosen.profile.name if chosen.profile else None,
            "profile_id": chosen.profile.id if chosen.profile else None, "profile_message": chosen.message,
            "drafter": model.manifest.drafter.kind, "weights": weights, "kv_cache": kv_cache, "draft_len": draft_len,
            "draft_tree": list(tree) if tree and speculative else None, "lookup": lookup if speculative else 0,
            "lookup_steps": s.lookup_steps, "lookup_accepted": s.lookup_accepted,
            "cost_curve": settings["cost"].to_dict() if "cost" in settings else None, "steps": s.steps,
            "accepted": s.accepted, "acceptance_length": s.acceptance_length,
            "accepted_depth_steps": s.depth_steps,
            "per_position_acceptance": s.position_acceptance, "tokens_per_s": s.tokens_per_s,
            "decode_tokens_per_s": s.decode_tokens_per_s, "seconds": s.total_s,
            "draft_s": s.draft_s, "verify_s": s.verify_s, "prefill_s": s.prefill_s}
