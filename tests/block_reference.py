"""An independent reference of the block drafters, in plain tensor ops: one sequence, no cache,
everything recomputed from the target features at every call.

Written from the published model code, not from specpack's:
- backbone: z-lab/dflash dflash/model.py @ 44947fb (DFlashDraftModel.forward, Qwen3DFlashAttention:
  k/v of the context = k_proj/v_proj(hidden_norm(fc(features))), concatenated before the block's,
  k_norm over both, RoPE over context positions then the block's, no mask) and deepseek-ai/DeepSpec
  deepspec/modeling/dspark/qwen3/modeling.py @ afdfa7c (the same layer);
- DSpark: DeepSpec deepspec/modeling/dspark/markov_head.py (sample_block_tokens of VanillaMarkov,
  GatedMarkovHead, RNNHead) and eval/dspark/draft_ops.py (_predict_confidence_logits);
- LiLiCorr: vllm-project/vllm vllm/model_executor/models/lilicorr.py @ 08f95fe5 (LiLiCorrHead.score
  with the concatenated factor input ModelOpt trains) and dflash2/speculator.py @ 030da624 (walk).
Tokens are chosen with the engine's rule: argmax, or Sampler.race on the drafter's distribution.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def lin(x, w, name):
    out = x @ w[name + ".weight"].T
    return out + w[name + ".bias"] if name + ".bias" in w else out


def rope(x, positions, theta, style):
    """x [..., T, hd] rotated at `positions` [T]: neox rotates (i, i + hd/2), interleaved (2i, 2i+1)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = positions.float()[:, None] * inv  # [T, hd/2]
    cos, sin = ang.cos(), ang.sin()
    if style == "neox":
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


def layer(w, cfg, i, x, ctx):
    """One draft layer: block x [..., T, H] attends the context ctx [..., P, H] (positions 0..P-1) and
    itself (leading dims: independent sequences, as a trainer batches them)."""
    p, eps = f"layers.{i}.", cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    P, T = ctx.shape[-2], x.shape[-2]
    h = rms(x, w[p + "input_layernorm.weight"], eps)
    q = rms(lin(h, w, p + "self_attn.q_proj").unflatten(-1, (nh, hd)), w[p + "self_attn.q_norm.weight"], eps)
    seen_rows = torch.cat([ctx, h], -2)  # keys and values: the context's, then the block's
    k = rms(lin(seen_rows, w, p + "self_attn.k_proj").unflatten(-1, (nkv, hd)), w[p + "self_attn.k_norm.weight"], eps)
    v = lin(seen_rows, w, p + "self_attn.v_proj").unflatten(-1, (nkv, hd))
    q = rope(q.transpose(-3, -2), torch.arange(P, P + T), cfg["rope_theta"], cfg["rope_style"])  # [..., nh, T, hd]
    k = rope(k.transpose(-3, -2), torch.arange(P + T), cfg["rope_theta"], cfg["rope_style"])
    k, v = k.repeat_interleave(nh // nkv, -3), v.transpose(-3, -2).repeat_interleave(nh // nkv, -3)
    block = torch.ones(T, T, dtype=torch.bool)
    if cfg["layer_causal"][i]:
        block = block.tril()
    seen = torch.cat([torch.ones(T, P, dtype=torch.bool), block], 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~seen, float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(-3, -2).flatten(-2)
    x = x + lin(attn, w, p + "self_attn.o_proj")
    m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
    return x + lin(F.silu(lin(m, w, p + "mlp.gate_proj")) * lin(m, w, p + "mlp.up_proj"), w, p + "mlp.down_proj")


def backbone(w, cfg, embed, feats, anchor):
    """The final-norm hidden states [..., N, H] of the block rows that predict draft tokens 1..N, and
    the projected context [..., P, H]. feats [..., P, F]; anchor: a token id, or a tensor of them [...]."""
    eps, N = cfg["rms_norm_eps"], cfg["draft_slots"]
    fill_in = cfg["query_layout"] == "fill_in"
    ctx = rms(feats.float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    anchor = torch.as_tensor(anchor)
    masks = torch.full((*anchor.shape, N if fill_in else N - 1), cfg["mask_token_id"])
    ids = torch.cat([anchor[..., None], masks], -1)
    x = embed[ids]
    if cfg["mask_embedding"]:
        x[ids == cfg["mask_token_id"]] = w["mask_embedding"]
    for i in range(cfg["num_layers"]):
        x = layer(w, cfg, i, x, ctx)
    out = rms(x, w["norm.weight"], eps)
    return (out[..., 1:, :] if fill_in else out), ctx


def pick(logits, ids, sampler, position):
    if sampler is None:
        return int(ids[logits.argmax()])
    return sampler.race(sampler.probs(logits[None])[0], position, ids)


def ref_draft(w, cfg, target_embed, target_lm_head, feats, context, k, sampler=None):
    """(tokens, confidences or None) drafted after `context` [n] (anchor = its last token) from the
    target features of positions 0..n-2, feats [n-1, F]."""
    embed = w["embed_tokens.weight"] if cfg["embedding"] == "drafter" else target_embed
    head = w["lm_head.weight"] if cfg["lm_head"] == "drafter" else target_lm_head
    hidden, ctx = backbone(w, cfg, embed, feats, int(context[-1]))
    n = len(context)
    if cfg["algorithm"] == "lilicorr":  # the lattice scores every slot of the block
        return lilicorr(w, cfg, target_embed, head, hidden, ctx[-1], n, sampler)[:k], None
    hidden = hidden[:k]
    ids = torch.arange(cfg["draft_vocab_size"]) + w.get("d2t", 0)
    scale = cfg["logit_scale"] or 1.0
    if cfg["algorithm"] == "dspark":
        return dspark(w, cfg, hidden @ head.T, hidden, int(context[-1]), ids, scale, n, sampler)
    logits = hidden @ head.T * scale
    return [pick(logits[q], ids, sampler, n + q) for q in range(len(hidden))], None


def dspark(w, cfg, base, hidden, anchor, ids, scale, n, sampler):
    """DeepSpec sample_block_tokens: prev = the anchor, then each sample; the confidence of
    position q from [hidden_q, markov_w1[prev_q]]."""
    markov, conf = cfg["markov"], cfg["confidence"]
    prev, state, tokens, confidences = anchor, None, [], []
    for q in range(len(hidden)):
        e = w["markov_head.markov_w1.weight"][prev] if markov else None
        bias = 0
        if markov and markov["type"] == "vanilla":
            bias = e @ w["markov_head.markov_w2.weight"].T
        elif markov and markov["type"] == "gated":
            gate = torch.sigmoid(lin(torch.cat([hidden[q], e]), w, "markov_head.gate_proj"))
            bias = (gate * e) @ w["markov_head.markov_w2.weight"].T
        elif markov:
            state = torch.zeros_like(e) if state is None else state
            g, c, o = lin(torch.cat([state, e, hidden[q]]), w, "markov_head.joint_proj").chunk(3)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            bias = torch.tanh(o) @ w["markov_head.markov_w2.weight"].T
        if conf:
            x = torch.cat([hidden[q], e]) if conf["with_markov"] else hidden[q]
            confidences.append(float(torch.sigmoid(lin(x, w, "confidence_head.proj"))[0]))
        prev = pick((base[q] + bias) * scale, ids, sampler, n + q)
        tokens.append(prev)
    return tokens, (confidences if conf else None)


def lilicorr_factors(w, cfg, target_embed, head, hidden, anchor_hidden):
    """vLLM LiLiCorrHead.score over the block's slots: each slot's top-k candidates [S, k] and the
    factors the walk scores transitions with (into [S, k, F], out [S, k, F], the anchor's [F])."""
    c, eps, B = cfg["lilicorr"], cfg["rms_norm_eps"], cfg["block_size"]
    L = {k[len("lilicorr."):]: v for k, v in w.items() if k.startswith("lilicorr.")}
    topk, heads, ve = c["candidate_topk"], c["num_heads"], c["vector_eps"]
    log_probs, cand = (hidden @ head.T).log_softmax(-1).topk(topk, -1)  # [n_slots, k]
    S = hidden.shape[0]
    x = target_embed[cand]  # [S, k, H]
    x = lin(x, L, "token_proj") if "token_proj.weight" in L else x
    x = x + lin(hidden, L, "pass_hidden_proj")[:, None]
    rank = torch.arange(topk) / max(topk - 1, 1)
    feats = torch.stack([log_probs, log_probs.exp(), log_probs - log_probs.max(-1, keepdim=True).values,
                         rank.expand(S, topk), (torch.arange(topk) == 0).float().expand(S, topk)], -1)
    feats = F.layer_norm(feats, (5,), L["feature_norm.weight"], L["feature_norm.bias"], 1e-5)
    x = x + lin(F.silu(lin(feats, L, "feature_mlp.up_proj")), L, "feature_mlp.down_proj")
    x = (x + L["slot_embedding"][0, 0, :S] + L["rank_embedding"][0, 0]).reshape(S * topk, -1)
    slot = torch.arange(S).repeat_interleave(topk)
    rel = slot[:, None] - slot[None]
    bias = L["relative_slot_bias"][:, rel + B - 1] + (rel == 0).float() * L["same_slot_bias"][:, None, None]
    for i in range(c["num_layers"]):
        p = f"layers.{i}."
        a = rms(x, L[p + "attn_norm.weight"], eps)
        q, k, v = (a @ L[p + "attn.in_proj_weight"].T + L[p + "attn.in_proj_bias"]).chunk(3, -1)
        q, k, v = (t.view(S * topk, heads, -1).transpose(0, 1) for t in (q, k, v))
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias).softmax(-1) @ v
        x = x + lin(att.transpose(0, 1).reshape(S * topk, -1), L, p + "attn.out_proj")
        m = rms(x, L[p + "mlp_norm.weight"], eps)
        x = x + lin(F.silu(lin(m, L, p + "mlp.up_proj")), L, p + "mlp.down_proj")
    x = rms(x, L["output_norm.weight"], eps).view(S, topk, -1)
    anchor = rms(lin(anchor_hidden, L, "context_proj"), L["anchor_norm.weight"], eps)
    phi = F.silu(lin(torch.cat([x, anchor.expand_as(x), x * anchor], -1), L, "factor_input_proj"))
    out = F.normalize(lin(phi, L, "out_head"), dim=-1, eps=ve)
    into = F.normalize(lin(phi, L, "in_head"), dim=-1, eps=ve)
    a_out = F.normalize(lin(anchor, L, "anchor_out_head"), dim=-1, eps=ve)
    return cand, into, out, a_out


def lilicorr(w, cfg, target_embed, head, hidden, anchor_hidden, n, sampler):
    """vLLM LiLiCorrHead.forward over the block's slots, then the walk through all of them."""
    cand, into, out, a_out = lilicorr_factors(w, cfg, target_embed, head, hidden, anchor_hidden)
    prev, tokens = None, []
    for s in range(len(cand)):
        row = (into[0] @ a_out if s == 0 else into[s] @ out[s - 1, prev]) * cfg["lilicorr"]["logit_scale"]
        tokens.append(pick(row, cand[s], sampler, n + s))
        prev = int((cand[s] == tokens[-1]).nonzero()[0])
    return tokens
