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


def engine_settings(model, selection, slots: int = 1, measure: bool = False, draft_len: int | None = None) -> dict:
    """The engine's cost curve (the profile's, else with `measure` one measured on this machine,
    once per loaded model) priced for the model's drafter (SpecModel.price), and the acceptance prior, for
    a model that drafts: draft lengths then follow the cost model, so speculation stops where it
    does not pay."""
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
        log.info("cost curve (measured here, now or at an earlier start): %s", out["cost"].to_dict())
    if "cost" in out:
        out["cost"] = model.price(out["cost"], draft_len or selection.draft_len)
    return out


def generate_text(artifact, req: GenerateRequest, public_key=None, device: str = "cpu",
                  dtype: str = "float32", write: Callable[[str], None] | None = None,
                  progress: bool = False, model=None, backend: str = "torch", weights: str = "fp32",
                  kv_cache: str = "model", phase: Callable[[str], None] | None = None) -> dict:
    """Generate for `req` from the artifact (or an already loaded `model`) and return the text,
    token ids and figures as plain data (the `--json` shape of `specpack run`); `phase(words)` is told
    each step before the first token (loading, measuring) as it starts."""
    from specpack.errors import InputError
    from specpack.runtime.api import load
    from specpack.runtime.text import TextStream, encode_prompt, stop_sequences
    from specpack.schemas.manifest import check_draft_len
    from specpack.tuning.profiles import select_profile

    if req.temperature < 0:
        raise InputError(f"temperature {req.temperature} is negative", hint="use 0 (greedy) or more")
    say = phase or (lambda words: None)
    if model is None:
        say(f"verifying and loading {artifact} ({backend}, {weights} weights)")
        model = load(artifact, public_key=public_key, device=device, dtype=dtype, progress=progress,
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
    fixed = req.draft_len is not None  # drafted as given: no cost model (not a profile's either), no adaptation
    if speculative and not fixed:
        say("pricing drafts with this machine's cost curve (measured on the first start, then kept)")
    settings = {} if fixed else engine_settings(model, chosen, measure=speculative)
    say("generating")
    result = model.generate(ids, max_new_tokens=req.max_new_tokens, draft_len=draft_len,
                            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                            seed=req.seed, stop=stop_sequences(tok, req.stop), speculative=speculative,
                            on_tokens=stream, tree=tree, lookup=lookup, adaptive=False if fixed else None, **settings)
    s = result.stats
    return {"text": stream.flush(), "token_ids": result.tokens, "prompt_tokens": len(ids),
            "finish_reason": result.finish_reason, "speculative": speculative,
            "profile": chosen.profile.name if chosen.profile else None,
            "profile_id": chosen.profile.id if chosen.profile else None, "profile_message": chosen.message,
            "drafter": model.manifest.drafter.kind, "weights": weights, "kv_cache": kv_cache, "draft_len": draft_len,
            "draft_tree": list(tree) if tree and speculative else None, "lookup": lookup if speculative else 0,
            "speculation": speculation_report(s, speculative, fixed, settings.get("cost"), draft_len, req.speculative),
            "lookup_steps": s.lookup_steps, "lookup_accepted": s.lookup_accepted,
            "cost_curve": settings["cost"].to_dict() if "cost" in settings else None, "steps": s.steps,
            "drafted_steps": s.drafted_steps, "undrafted_steps": s.undrafted_steps, "probe_steps": s.probe_steps,
            "accepted": s.accepted, "acceptance_length": s.acceptance_length, "tokens_per_step": s.tokens_per_step,
            "mean_draft_len": s.mean_draft_len, "draft_len_steps": s.draft_len_steps,
            "accepted_depth_steps": s.depth_steps,
            "per_position_acceptance": s.position_acceptance, "tokens_per_s": s.tokens_per_s,
            "decode_tokens_per_s": s.decode_tokens_per_s, "seconds": s.total_s,
            "draft_s": s.draft_s, "verify_s": s.verify_s, "prefill_s": s.prefill_s}


def speculation_report(s, speculative: bool, fixed: bool, cost, draft_len: int, asked: bool = True) -> dict:
    """What decided each step's draft, in words and figures (`run --json`'s "speculation"): `mode`
    is off, fixed (--draft-len: drafted as given) or cost model (each step's length from the cost
    model measured on this machine, or the profile's); `decision` says how many steps drafted and, when
    the cost model drafted on few or none, why, with the costs it priced drafts at. The acceptance
    length beside it is the drafter's, over the steps that verified its drafts."""
    if not speculative:
        why = "--no-spec" if not asked else "the chosen profile turns speculation off"
        return {"mode": "off", "decision": f"no speculation ({why})"}
    depth = f"{s.mean_draft_len:.1f} tokens deep on average"
    if fixed or cost is None:
        return {"mode": "fixed", "decision": f"drafted on {s.drafted_steps} of {s.steps} steps, {depth} "
                                             f"(up to {draft_len} a step: --draft-len; the last token has none)"}
    step = cost.step_ms(1) + cost.overhead_ms
    out = {"mode": "cost model", "target_step_ms": round(step, 4),
           "draft_ms": round(cost.time(1, draft_len, 1) - cost.step_ms(1), 4),
           "verify_ms": round(cost.step_ms(1 + draft_len) - cost.step_ms(1), 4)}
    probes = f" ({s.probe_steps} of them probes the cost model had not asked for)" if s.probe_steps else ""
    if s.drafted_steps - s.probe_steps < s.steps / 2:
        why = (f"the cost model measured on this machine priced drafting {draft_len} tokens at "
               f"{out['draft_ms']:.2f} ms and verifying them at {out['verify_ms']:.2f} ms on top of a "
               f"{step:.2f} ms step, more than the drafter's acceptance gains here; --draft-len {draft_len} "
               "drafts every step")
        out["decision"] = f"drafted on {s.drafted_steps} of {s.steps} steps{probes}: {why}"
    else:
        out["decision"] = f"drafted on {s.drafted_steps} of {s.steps} steps{probes}, {depth} (cost model)"
    return out
