"""Targets carrying MTP layers in each published layout (exact key names), and a reference MTP forward.

A tiny target with L layers and n MTP layers is cut from one transformers model with L + n layers:
the first L layers are the target, layer L + k is the decoder block of MTP layer k (so its tensors have
the published per-layer names, per-expert ones for MoE). The fusion tensors are added around it. The
reference runs the published forward with transformers' own decoder layers, no cache, every row
recomputed at every step (vLLM deepseek_mtp.py / mimo_mtp.py / qwen3_next_mtp.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import tiny

L = 3  # target layers
FUSION = {  # layout -> (embed norm, hidden norm, proj, final norm), "{p}" = the MTP layer's prefix
    "mtp-deepseek": ("{p}enorm.weight", "{p}hnorm.weight", "{p}eh_proj.weight", "{p}shared_head.norm.weight"),
    "mtp-mimo": ("{p}token_layernorm.weight", "{p}hidden_layernorm.weight", "{p}input_proj.weight",
                 "{p}final_layernorm.weight"),
    "mtp-qwen3-next": ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                       "mtp.norm.weight"),
}
PREFIX = {"mtp-deepseek": "model.layers.{i}.", "mtp-mimo": "model.mtp_layers.{i}.", "mtp-qwen3-next": "mtp.layers.{i}."}


def mtp_prefix(layout: str, k: int) -> str:
    return PREFIX[layout].format(i=L + k if layout == "mtp-deepseek" else k)


def deepseek_config(layers: int, **over):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**dict(
        vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
        topk_method="noaux_tc", scoring_func="sigmoid",  # as DeepSeek-V3's config states them (engines default otherwise)
        bos_token_id=1, eos_token_id=2, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}), **over})


def build_deepseek(layers: int, seed: int = 0, **over):
    """A tiny DeepseekV3ForCausalLM (fp32, eval) with non-trivial routing (random score-correction biases);
    `over` changes the config (`deepseek_config`)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_config(layers, **over)).eval()
    with torch.no_grad():
        for layer in model.model.layers[model.config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return model


# vLLM's CPU MLA decode kernel takes one latent width, DeepSeek-V3's: kv_lora_rank 512 + rope 64 = 576
DEEPSEEK_WIDE = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=2,
                     num_key_value_heads=2)


def _big_model(family: str, n: int, seed: int, **over):
    if family in ("deepseek", "deepseek-wide"):
        return build_deepseek(L + n, seed, **{**(DEEPSEEK_WIDE if family == "deepseek-wide" else {}), **over})
    return tiny.build_model(family, seed, num_hidden_layers=L + n, layer_types=["full_attention"] * (L + n), **over)


@dataclass
class MtpTarget:
    path: Path
    layout: str
    n: int
    big: nn.Module  # the transformers model with L + n layers the target and the MTP blocks were cut from
    fusion: dict  # published name -> tensor (fusion tensors and DeepSeek's duplicates)


def make_target(out: Path, layout: str, n: int = 1, seed: int = 0, train_steps: int = 0,
                wide: bool = False, **over) -> MtpTarget:
    """A target dir (config, tokenizer, model.safetensors) of `layout`'s family with n MTP layers,
    random, or trained for `train_steps` on the target's own greedy continuations; `wide`: of
    geometry an engine's CPU kernels take (tiny.WIDE; DeepSeek: DEEPSEEK_WIDE); `over`: config keys
    (DeepSeek with first_k_dense_replace=L + n: no MoE layer)."""
    family = ("deepseek" if layout == "mtp-deepseek" else "qwen2") + ("-wide" if wide else "")
    big = _big_model(family, n, seed, **over)
    fusion = random_fusion(layout, n, big.config.hidden_size, seed)
    if train_steps:
        train(big, layout, n, fusion, train_steps)
    big.save_pretrained(out / "big", safe_serialization=True)
    tensors = load_file(str(out / "big/model.safetensors"))
    config = json.loads((out / "big/config.json").read_text())
    target, mtp = _split(tensors, layout)
    if layout == "mtp-deepseek":
        for k in range(n):  # DeepSeek ships copies of the embedding and head in every MTP layer
            p = mtp_prefix(layout, k)
            fusion.setdefault(p + "embed_tokens.weight", target["model.embed_tokens.weight"].clone())
            fusion.setdefault(p + "shared_head.head.weight", target["lm_head.weight"].clone())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=n)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:L]
    if layout == "mtp-mimo":
        config.update(architectures=["MiMoForCausalLM"], model_type="mimo")
    write_dir(out / "target", config, {**target, **mtp, **fusion})
    tiny.make_tokenizer(out / "target")
    return MtpTarget(out / "target", layout, n, big, fusion)


def _split(tensors: dict, layout: str) -> tuple[dict, dict]:
    """(target tensors, MTP block tensors renamed to the layout's prefixes)."""
    target, mtp = {}, {}
    for name, value in tensors.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= L:
            rest = ".".join(parts[3:])
            mtp[mtp_prefix(layout, int(parts[2]) - L) + rest] = value
        else:
            target[name] = value
    return target, mtp


def random_fusion(layout: str, n: int, H: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed + 100)
    out = {}
    for k in range(n):
        e, h, proj, f = (t.format(p=mtp_prefix(layout, k)) for t in FUSION[layout])
        offset = 0.0 if layout == "mtp-qwen3-next" else 1.0  # zero-centred norms there
        out.update({e: offset + 0.1 * torch.randn(H, generator=g), h: offset + 0.1 * torch.randn(H, generator=g),
                    proj: torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H),
                    f: offset + 0.1 * torch.randn(H, generator=g)})
    return out


def write_dir(path: Path, config: dict, tensors: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def edit_weights(path: Path, drop=(), **replace) -> None:
    """Rewrite `path`/model.safetensors without the names in `drop` and with `replace` (name: tensor)."""
    tensors = load_file(str(path / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    tensors.update({k.replace("__", "."): v for k, v in replace.items()})
    save_file(tensors, str(path / "model.safetensors"))


def split_head(t: MtpTarget, out: Path) -> tuple[Path, Path]:
    """(the target without its MTP tensors, a separate head dir holding them under the same names)."""
    tensors = load_file(str(t.path / "model.safetensors"))
    config = json.loads((t.path / "config.json").read_text())
    head = {k: v for k, v in tensors.items() if _is_mtp(k, t.layout)}
    stripped = write_dir(out / "stripped", config, {k: v for k, v in tensors.items() if k not in head})
    for f in t.path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (stripped / f.name).write_bytes(f.read_bytes())
    return stripped, write_dir(out / "head", config, head)


def _is_mtp(name: str, layout: str) -> bool:
    if layout == "mtp-deepseek":
        return name.startswith("model.layers.") and int(name.split(".")[2]) >= L
    return name.startswith(("mtp.", "model.mtp_layers."))


def make_qwen3_next(out: Path, n: int = 1) -> Path:
    """A tiny Qwen3-Next target (hybrid linear/full attention, MoE) with `mtp.*` tensors: build only
    (specpack cannot run Qwen3-Next targets)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, num_hidden_layers=4 + n, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, max_position_embeddings=512,
                          layer_types=["linear_attention"] * 3 + ["full_attention"] * (1 + n))
    Qwen3NextForCausalLM(cfg).save_pretrained(out / "big", safe_serialization=True)
    tensors = load_file(str(out / "big/model.safetensors"))
    config = json.loads((out / "big/config.json").read_text())
    target = {}
    for name, value in tensors.items():
        i = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        target[f"mtp.layers.{i - 4}." + ".".join(name.split(".")[3:]) if i >= 4 else name] = value
    config.update(num_hidden_layers=4, layer_types=config["layer_types"][:4], mtp_num_hidden_layers=n)
    path = write_dir(out / "target", config, {**target, **random_fusion("mtp-qwen3-next", 1, 64)})
    tiny.make_tokenizer(path)
    return path


# ---- the published MTP forward, with transformers' decoder layers ----

class RefLayer(nn.Module):
    def __init__(self, layout: str, big, k: int, fusion: dict):
        super().__init__()
        self.layout, self.big = layout, big
        self.block = big.model.layers[L + k]
        e, h, proj, f = (fusion[t.format(p=mtp_prefix(layout, k))] for t in FUSION[layout])
        self.e, self.h, self.proj, self.f = e, h, proj, f
        self.eps = big.config.rms_norm_eps

    def norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, emb, h, positions):
        """rows [(B,) T, H] -> (hidden handed on, normed output for the lm_head)."""
        e, hn = self.norm(emb, self.e), self.norm(h, self.h)
        x = torch.cat([hn, e] if self.layout == "mtp-mimo" else [e, hn], -1) @ self.proj.T
        batched, T = x.dim() == 3, x.shape[-2]
        x = x if batched else x[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        pos = self.big.model.rotary_emb(x, positions[None])
        y = self.block(x, attention_mask=mask, position_ids=positions[None], position_embeddings=pos)
        y = y if batched else y[0]
        normed = self.norm(y, self.f)
        return (y if self.layout == "mtp-deepseek" else normed), normed


def target_hidden(hf_target, tokens: torch.Tensor, layout: str) -> torch.Tensor:
    """[T, H]: the target state feeding MTP layer 0 (DeepSeek: after the final norm; MiMo: before)."""
    seen = {}
    hook = hf_target.model.layers[-1].register_forward_hook(lambda m, a, out: seen.update(h=out[0]))
    with torch.no_grad():
        hf_target(tokens[None])
    hook.remove()
    h = seen["h"]
    return hf_target.model.norm(h) if layout == "mtp-deepseek" else h


def ref_draft(layers: list, hf_target, context: torch.Tensor, D: int, layout: str) -> list[int]:
    """Greedy drafts after `context` [n]: step k < n runs layer k over rows 0..P-1 (P = n - 1) with
    tokens x_{i+k+1} (drafts past the context); later steps chain layer j mod n on new rows."""
    P, embed, head = context.shape[0] - 1, hf_target.model.embed_tokens, hf_target.lm_head
    seq, drafts = list(context.tolist()), []
    rows = {}  # layer -> (embeddings, hidden inputs) of its rows
    with torch.no_grad():
        h = target_hidden(hf_target, context[:P], layout)
        for k, layer in enumerate(layers[:D] if D < len(layers) else layers):
            e = embed(torch.tensor(seq[k + 1 : P + k + 1]))
            rows[k] = (e, h)
            h, normed = layer(e, h, torch.arange(P))
            drafts.append(int(head(normed[-1]).argmax()))
            seq.append(drafts[-1])
        last = h[-1:]
        for j in range(len(layers), D):
            k = j % len(layers)
            e, hin = rows[k]
            rows[k] = (torch.cat([e, embed(torch.tensor(seq[-1:]))]), torch.cat([hin, last]))
            out, normed = layers[k](*rows[k], torch.arange(rows[k][0].shape[0]))
            last = out[-1:]
            drafts.append(int(head(normed[-1]).argmax()))
            seq.append(drafts[-1])
    return drafts[:D]


def train(big, layout: str, n: int, fusion: dict, steps: int) -> None:
    """Fit the MTP layers (fusion tensors and blocks, in place) to the target's greedy continuations
    of random prompts: layer k at row i sees x_{i+k+1} and predicts x_{i+k+2}."""
    import eagle_fixtures as ef
    import torch.nn.functional as F

    target = hf_target(MtpTarget(Path(), layout, n, big, fusion))
    seqs = ef.greedy_sequences(target, ef.training_prompts(), 40)  # [B, S]
    hook = target.model.layers[-1].register_forward_hook(lambda m, a, out: seen.update(h=out))
    seen = {}
    with torch.no_grad():
        target(seqs)
    hook.remove()
    with torch.no_grad():
        h0 = target.model.norm(seen["h"]) if layout == "mtp-deepseek" else seen["h"]
    for v in fusion.values():
        v.requires_grad_(True)
    blocks = [p for k in range(n) for p in big.model.layers[L + k].parameters()]
    opt = torch.optim.Adam(list(fusion.values()) + blocks, lr=3e-3)
    layers, S = [RefLayer(layout, big, k, fusion) for k in range(n)], seqs.shape[1]
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    for _ in range(steps):
        h, loss = h0, 0.0
        for k, layer in enumerate(layers):
            T = S - k - 1  # rows whose next token x_{i+k+1} is known
            h, normed = layer(embed[seqs[:, k + 1 :]], h[:, :T], torch.arange(T))
            loss = loss + F.cross_entropy((normed[:, :-1] @ head.T).flatten(0, 1), seqs[:, k + 2 :].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    for v in fusion.values():
        v.requires_grad_(False)


def hf_target(t: MtpTarget):
    """The target alone in transformers (the first L layers of `big`)."""
    import copy

    model = copy.deepcopy(t.big)
    model.model.layers = model.model.layers[:L]
    model.config.num_hidden_layers = L
    return model.eval()
