"""Canonical EAGLE-3 drafter dirs for tiny targets, and an independent reference forward of the head.

The reference follows the published description (EAGLE `cnets.py`) with plain tensor
ops and no KV cache: every draft step recomputes the whole sequence.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import tiny

H, HEADS, KV, HD, INTER = 64, 4, 2, 16, 128
AUX = (1, 3, 4)  # input of layers 1, 3, 4 of the 6-layer tiny targets


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and two busy pools on two shared cores thrash."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def session_dir(prefix: str) -> Path:
    """A temp dir removed when the test session's process exits (for lru_cached fixtures)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.lru_cache(maxsize=None)
def target_dir(family: str = "llama", shards: int = 1) -> Path:
    """A tiny target model dir of `family` (seed 0, the weights of tiny.build_model), made once per session."""
    return tiny.make_target(session_dir(f"target-{family}-"), family, shards=shards)


def head_config(target_cfg: dict, draft_vocab: int, aux=AUX, embedding="target", **over) -> dict:
    """A head of the target's own geometry (the tiny targets': H, HEADS, KV, HD, INTER)."""
    hd = target_cfg.get("head_dim") or target_cfg["hidden_size"] // target_cfg["num_attention_heads"]
    cfg = {"kind": "eagle3", "hidden_size": target_cfg["hidden_size"], "intermediate_size": target_cfg["intermediate_size"],
           "num_attention_heads": target_cfg["num_attention_heads"],
           "num_key_value_heads": target_cfg["num_key_value_heads"], "head_dim": hd, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0,
           "rope_scaling": None, "max_position_embeddings": 512, "hidden_act": "silu",
           "target_hidden_size": target_cfg["hidden_size"], "aux_layer_ids": list(aux),
           "draft_vocab_size": draft_vocab, "target_vocab_size": target_cfg["vocab_size"],
           "embedding": embedding, "norm_before_residual": False}
    return {**cfg, **over}


def random_weights(cfg: dict, draft_ids: torch.Tensor, seed: int = 0, scale: float = 1.0) -> dict:
    """Weights with O(1) activations (std 1/sqrt(fan_in)); draft_ids [Vd] sorted target ids."""
    g = torch.Generator().manual_seed(seed)
    n_aux, Ht, Vt = len(cfg["aux_layer_ids"]), cfg["target_hidden_size"], cfg["target_vocab_size"]

    def lin(out, inp):
        return torch.randn(out, inp, generator=g) * scale / math.sqrt(inp)

    p, H, I = "layers.0.", cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    w = {"fc.weight": lin(H, n_aux * Ht), p + "self_attn.q_proj.weight": lin(q, 2 * H),
         p + "self_attn.k_proj.weight": lin(kv, 2 * H), p + "self_attn.v_proj.weight": lin(kv, 2 * H),
         p + "self_attn.o_proj.weight": lin(H, q), p + "mlp.gate_proj.weight": lin(I, H),
         p + "mlp.up_proj.weight": lin(I, H), p + "mlp.down_proj.weight": lin(H, I),
         "lm_head.weight": lin(len(draft_ids), H) * 4}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[p + name + ".weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    w["norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    w["d2t"] = draft_ids - torch.arange(len(draft_ids))
    if cfg["embedding"] == "drafter":
        w["embed_tokens.weight"] = torch.randn(Vt, H, generator=g)
    return w


def write_head(out: Path, cfg: dict, weights: dict) -> Path:
    """Write a canonical drafter dir: config.json + model.safetensors (t2d derived from d2t)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    Vd = cfg["draft_vocab_size"]
    t2d = torch.zeros(cfg["target_vocab_size"], dtype=torch.bool)
    t2d[torch.arange(Vd) + weights["d2t"]] = True
    tensors = {k: v.detach().float().contiguous() if v.is_floating_point() else v for k, v in weights.items()}
    save_file({**tensors, "t2d": t2d}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def random_head(out: Path, target_dir: Path, draft_vocab: int = 200, seed: int = 0, **over) -> Path:
    """A random (low acceptance) head whose draft vocab is a random subset of the target's."""
    cfg = head_config(tiny.read_json(Path(target_dir) / "config.json"), draft_vocab, **over)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randperm(cfg["target_vocab_size"], generator=g)[:draft_vocab].sort().values
    return write_head(out, cfg, random_weights(cfg, ids, seed))


# ---- reference forward (plain ops, no cache) ----

def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_layer(w: dict, cfg: dict, emb, h, positions):
    """One causal pass of the head's layer. emb, h: [..., T, H]; returns out [..., T, H] (pre-norm)."""
    p, nh, nkv, hd = "layers.0.", cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    T = emb.shape[-2]
    x = torch.cat([_rms(emb, w[p + "input_layernorm.weight"]), _rms(h, w[p + "hidden_norm.weight"])], -1)

    def heads(name, n):
        return (x @ w[p + f"self_attn.{name}_proj.weight"].T).unflatten(-1, (n, hd)).transpose(-2, -3)

    q, k, v = heads("q", nh), heads("k", nkv), heads("v", nkv)  # [..., n, T, hd]
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    ang = positions.float()[:, None] * inv  # [T, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)

    def rope(t):
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // nkv, -3), v.repeat_interleave(nh // nkv, -3)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(-2, -3).flatten(-2) @ w[p + "self_attn.o_proj.weight"].T
    residual = _rms(h, w[p + "hidden_norm.weight"]) if cfg["norm_before_residual"] else h
    h = residual + attn
    m = _rms(h, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    mlp = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return h + mlp


def ref_logits(w, out):
    return _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


def ref_draft(w: dict, cfg: dict, embed, aux: torch.Tensor, next_tokens: torch.Tensor, D: int) -> list[int]:
    """Greedy draft of D tokens (target ids). aux [P, n_aux·Ht]: target features of positions 0..P-1;
    next_tokens [P]: x_1..x_P. Recomputes the whole sequence at every step."""
    d2t_ids = torch.arange(cfg["draft_vocab_size"]) + w["d2t"]
    hs, toks, drafts = list(aux.float() @ w["fc.weight"].T), list(next_tokens), []
    for _ in range(D):
        out = ref_layer(w, cfg, embed[torch.stack(toks)], torch.stack(hs), torch.arange(len(toks)))
        d = int(d2t_ids[ref_logits(w, out[-1]).argmax()])
        drafts.append(d)
        hs.append(out[-1])
        toks.append(torch.tensor(d))
    return drafts


def load_weights(head_dir: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(Path(head_dir) / "model.safetensors")), tiny.read_json(Path(head_dir) / "config.json")


# ---- a trained, high-acceptance head ----

def greedy_sequences(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """prompts [B, m] -> [B, m + new]: the target's greedy continuations (transformers, cached)."""
    with torch.no_grad():
        out, seqs = model(prompts, use_cache=True), prompts
        for _ in range(new):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seqs = torch.cat([seqs, nxt], 1)
            out = model(nxt, cache=out.cache, use_cache=True)
    return seqs


def training_prompts(n: int = 24, length: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, tiny.VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def trained_head(family: str = "llama", steps: int = 150, draft_vocab: int = 256, seed: int = 0) -> Path:
    """A head trained on the tiny target's own greedy continuations of `training_prompts()` (40
    tokens each): step 1 from target features, step 2 from its own hidden state. Acceptance is high
    on those continuations (use their prefixes as prompts). Cached per session in a temp dir."""
    model = tiny.build_model(family)
    return train_head(model, greedy_sequences(model, training_prompts(), 40), steps, draft_vocab, seed)


def train_head(model, seqs: torch.Tensor, steps: int = 150, draft_vocab: int = 256, seed: int = 0) -> Path:
    """An EAGLE-3 head (canonical dir) trained on `seqs` [B, S], the target `model`'s own greedy
    sequences, with EAGLE-3's two unrolled steps, through the reference forward."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        out = model(seqs, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in AUX], -1)  # [B, S, 3H]
    pred = out.logits.argmax(-1)  # pred[:, p]: the target's token at p + 1
    embed = model.get_input_embeddings().weight.detach()
    # draft vocab: the tokens the target predicts most often (as EAGLE-3 builds it)
    counts = torch.bincount(pred.flatten(), minlength=vocab).float() + torch.arange(vocab) * 1e-6
    ids = counts.topk(draft_vocab).indices.sort().values
    to_draft = torch.full((vocab,), -100, dtype=torch.long)
    to_draft[ids] = torch.arange(draft_vocab)
    cfg = head_config(model.config.to_dict(), draft_vocab)
    w = {k: v.requires_grad_(v.is_floating_point()) for k, v in random_weights(cfg, ids, seed, 0.5).items()}
    opt = torch.optim.Adam([v for v in w.values() if v.requires_grad], lr=5e-3)
    pos = torch.arange(seqs.shape[1] - 1)
    # head position p: feature of p and token x_{p+1}; label: the target's token at p + 2
    feats, toks, labels = aux[:, :-1], seqs[:, 1:], to_draft[pred[:, 1:]]
    for _ in range(steps):
        h1 = ref_layer(w, cfg, embed[toks], feats @ w["fc.weight"].T, pos)
        loss = F.cross_entropy(ref_logits(w, h1).flatten(0, 1), labels.flatten())
        # step 2, approximately (its queries see step-2 states, not step-1 keys): own hidden
        # state at p with token x_{p+2} predicts x_{p+3}
        h2 = ref_layer(w, cfg, embed[toks[:, 1:]], h1[:, :-1], pos[1:])
        loss = loss + F.cross_entropy(ref_logits(w, h2).flatten(0, 1), labels[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return write_head(session_dir("eagle3-trained-"), cfg, {k: v.detach() for k, v in w.items()})
