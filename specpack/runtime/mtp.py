"""MTP drafter: the target's own multi-token-prediction layers (converters/mtp.py gives their canonical form).

Layer k at row i reads the hidden state h^{k-1}_i (h^{-1} = the target's) and the embedding of token
x_{i+k+1}, and predicts x_{i+k+2} through the target's lm_head (DeepSeek-V3 §2.2). Each layer keeps its
own KV cache over its rows, so draft step k runs layer k over the rows it has not seen: the committed
ones (their tokens are known) plus k rows whose tokens are the drafts d_1..d_k. Draft rows are dropped
before `propose` returns. With `allow_layer_reuse`, steps past the last layer reuse layer k mod n,
each appending one row fed by the previous step's output (how vLLM and SGLang chain a single MTP layer).

The target hidden state is read with a forward hook on the target's last decoder layer: our decoders
return logits and captured layer inputs, and the state leaving the last layer is neither.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specpack.errors import InputError
from specpack.runtime.model import Block, KVCache, RMSNorm
from specpack.runtime.rows import Rows, Segment
from specpack.runtime.speculative import Draft

FUSION = ("embed_norm.weight", "hidden_norm.weight", "proj.weight", "final_norm.weight")


@dataclass(frozen=True)
class MtpSpec:
    num_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    norm_offset: float  # 1.0: zero-centred norms (Qwen3-Next), the weight + 1 scales
    concat_order: str  # "embedding_first" | "hidden_first"
    target_hidden_state: str  # "final_norm_output" | "last_layer_output"
    chain_hidden_state: str  # "pre_norm" | "post_norm"
    allow_layer_reuse: bool

    def check_draft_len(self, draft_len: int) -> None:
        if draft_len > self.num_layers and not self.allow_layer_reuse:
            raise InputError(f"{draft_len} draft tokens asked for, but the MTP drafter has {self.num_layers} "
                             "layer(s) and layer reuse is not allowed",
                             hint=f"use a draft length <= {self.num_layers}, or allow reuse (step k then uses "
                                  "layer k mod n): build with --mtp-allow-reuse, or load with "
                                  "params {'allow_layer_reuse': True}")


_CHOICES = {"concat_order": ("embedding_first", "hidden_first"),
            "target_hidden_state": ("final_norm_output", "last_layer_output"),
            "chain_hidden_state": ("pre_norm", "post_norm"), "weights": ("target", "drafter")}


def mtp_spec_from_config(cfg: dict) -> MtpSpec:
    problems = [f"missing field {k}" for k in ("num_layers", "hidden_size", "vocab_size", *_CHOICES) if k not in cfg]
    problems += [f"{k} {cfg[k]!r} (expected one of {', '.join(v)})" for k, v in _CHOICES.items()
                 if k in cfg and cfg[k] not in v]
    if cfg.get("kind", "mtp") != "mtp":
        problems.append(f"kind is {cfg.get('kind')!r}, expected 'mtp'")
    if problems:
        raise InputError("the MTP drafter config is not usable", problems=problems,
                         hint="re-run the build on the target")
    return MtpSpec(num_layers=int(cfg["num_layers"]), hidden_size=int(cfg["hidden_size"]),
                   vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   norm_offset=float(cfg.get("norm_offset", 0.0)), concat_order=cfg["concat_order"],
                   target_hidden_state=cfg["target_hidden_state"], chain_hidden_state=cfg["chain_hidden_state"],
                   allow_layer_reuse=bool(cfg.get("allow_layer_reuse", False)))


class _DenseKit:
    """Blocks, caches and weight names of our Llama/Qwen2-style `Transformer`."""

    def __init__(self, target):
        self.target, self.spec = target, target.spec

    def block(self, k: int) -> nn.Module:
        return Block(self.spec)

    def shapes(self, prefix: str, k: int) -> dict:
        from specpack.runtime.weights import target_tensor_shapes

        return {prefix + n[len("model.layers.0."):]: shape for n, shape in target_tensor_shapes(self.spec).items()
                if n.startswith("model.layers.0.")}

    def state(self, t: dict, prefix: str) -> dict:
        from specpack.runtime.weights import fuse_layer

        return fuse_layer(t, prefix, prefix)

    def cache(self, max_len: int) -> KVCache:
        s, w = self.spec, self.target.embed_tokens.weight
        return KVCache(1, s.num_kv_heads, s.head_dim, max_len, w.dtype, w.device)


class _DeepseekKit(_DenseKit):
    """The same for `DeepseekTransformer` (MLA + MoE blocks, latent caches)."""

    def block(self, k: int) -> nn.Module:
        from specpack.runtime.deepseek import DeepseekBlock

        return DeepseekBlock(self.spec, self.spec.is_moe(self.spec.num_layers + k))

    def shapes(self, prefix: str, k: int) -> dict:
        from specpack.runtime.deepseek import layer_tensor_shapes

        return layer_tensor_shapes(self.spec, prefix, self.spec.is_moe(self.spec.num_layers + k))

    def state(self, t: dict, prefix: str) -> dict:
        from specpack.runtime.deepseek import layer_state

        return layer_state(t, prefix, prefix)

    def cache(self, max_len: int):
        return self.target.new_cache(1, max_len)


def _kit(target) -> _DenseKit:
    from specpack.runtime.deepseek import DeepseekTransformer

    return _DeepseekKit(target) if isinstance(target, DeepseekTransformer) else _DenseKit(target)


class MtpLayer(nn.Module):
    """proj(cat(norm(embedding), norm(h))) (order per config) → a target-style decoder block → final norm."""

    def __init__(self, s: MtpSpec, block: nn.Module):
        super().__init__()
        H = s.hidden_size
        self.embedding_first = s.concat_order == "embedding_first"
        self.chain_pre_norm = s.chain_hidden_state == "pre_norm"
        self.embed_norm, self.hidden_norm = RMSNorm(H, s.rms_norm_eps), RMSNorm(H, s.rms_norm_eps)
        self.proj = nn.Linear(2 * H, H, bias=False)
        self.block = block
        self.final_norm = RMSNorm(H, s.rms_norm_eps)

    def forward(self, emb: Tensor, h: Tensor, cos: Tensor, sin: Tensor, cache, start: int) -> tuple[Tensor, Tensor]:
        # emb, h: [T, H] -> (hidden handed to the next step [T, H], normed output for the lm_head [T, H])
        e, hn = self.embed_norm(emb), self.hidden_norm(h)
        x = self.proj(torch.cat([e, hn] if self.embedding_first else [hn, e], dim=-1))
        cache.length = start
        T = x.shape[0]
        rows = Rows.of([Segment(0, start, T)], x.device)
        y = self.block(x, cos, sin, cache.k[0], None if cache.v is None else cache.v[0], rows)
        cache.length = start + T
        normed = self.final_norm(y)
        return (y if self.chain_pre_norm else normed), normed


class MtpDrafter(nn.Module):
    """Proposes D tokens per call; greedy, or sampled from its distribution over the target vocab."""

    kind = "mtp"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, spec: MtpSpec, target, kit: _DenseKit):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(MtpLayer(spec, kit.block(k)) for k in range(spec.num_layers))
        object.__setattr__(self, "target", target)  # shared, not a submodule: no second copy in state_dict
        object.__setattr__(self, "kit", kit)
        self.caches: list = []
        self.done: list[int] = []  # rows of each layer computed with committed tokens
        self._seen: tuple[int, Tensor] | None = None  # (first row, last-layer output) of the latest target forward
        self._hook = target.layers[-1].register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        self._seen = (self.target.cache.length, output)  # the target sets its length after its layers ran

    def check_draft_len(self, draft_len: int) -> None:
        self.spec.check_draft_len(draft_len)

    @torch.inference_mode()
    def reset(self, max_len: int) -> None:
        """Room for `max_len` rows per layer; empties the caches."""
        w = self.layers[0].proj.weight
        if not self.caches or self.caches[0].max_len < max_len:
            self.caches = [self.kit.cache(max_len) for _ in self.layers]
            self.outs = w.new_zeros(self.spec.num_layers + 1, max_len, self.spec.hidden_size)  # [0]: the target's
        for c in self.caches:
            c.length = 0
        self.done = [0] * self.spec.num_layers

    def _absorb_target(self, rows: int) -> None:
        """Copy the target hidden states of the newly committed rows done[0]..rows-1 into outs[0]."""
        if self._seen is None:
            raise RuntimeError("MTP drafter: propose() before any target forward (the target's prefill feeds it)")
        start, out = self._seen
        lo = self.done[0]
        if not start <= lo <= rows <= start + out.shape[0]:
            raise RuntimeError(f"MTP drafter: target rows {lo}..{rows} are not in the last forward "
                               f"({start}..{start + out.shape[0]}); was reset() skipped?")
        self.outs[0, lo:rows] = self._target_state(out[lo - start : rows - start])

    def _target_state(self, h: Tensor) -> Tensor:
        """The state layer 0 reads, from what left the target's last layer."""
        return self.target.norm(h) if self.spec.target_hidden_state == "final_norm_output" else h

    def _run_layer(self, k: int, h: Tensor, tokens: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Layer k over rows start.. (inputs h [T, H], tokens [T]) -> (chain hidden [T, H], logits [1, V]
        of the last row, fp32)."""
        pos = torch.arange(start, start + tokens.shape[0], device=tokens.device)
        cos, sin = self.target.cos[pos, None], self.target.sin[pos, None]
        chain, normed = self.layers[k](self.target.embed_tokens(tokens), h, cos, sin, self.caches[k], start)
        return chain, self.target.lm_head(normed[-1:]).float()

    def _step(self, k: int, h: Tensor, tokens: Tensor, start: int, sampler):
        """Layer k over rows start.. -> (chain hidden [T, H], token [1], q)."""
        chain, logits = self._run_layer(k, h, tokens, start)
        if sampler is None:
            return chain, logits.argmax(-1), None
        q = sampler.probs(logits)
        return chain, sampler.sample(q), q

    @torch.inference_mode()
    def propose(self, context: Tensor, feats, draft_len: int, sampler=None) -> Draft:
        """context: [n] all tokens so far (the target has committed rows 0..n-2; their hidden states
        come from the hook, so `feats` is unused). Every layer runs on every call, so all stay in step
        whatever the draft length."""
        self.check_draft_len(draft_len)
        n_layers, P = self.spec.num_layers, context.shape[0] - 1
        self._absorb_target(P)
        seq, probs = context, []
        for k in range(n_layers):  # step k: layer k over its new committed rows + k draft rows
            s = self.done[k]
            chain, tok, q = self._step(k, self.outs[k, s:P], seq[s + k + 1 : P + k + 1], s, sampler)
            self.outs[k + 1, s:P] = chain
            seq, probs = torch.cat([seq, tok]), probs + [q]
        h = self.outs[n_layers, P - 1 : P]
        for j in range(n_layers, draft_len):  # reuse: layer j mod n appends one row, fed by the last step
            k = j % n_layers
            h, tok, q = self._step(k, h, seq[-1:], self.caches[k].length, sampler)
            seq, probs = torch.cat([seq, tok]), probs + [q]
        self.done = [max(P - k, 0) for k in range(n_layers)]
        for cache, done in zip(self.caches, self.done):
            cache.length = done  # drop the draft rows
        drafts = seq[P + 1 : P + 1 + draft_len]
        return Draft(drafts, torch.cat(probs[: len(drafts)]) if sampler is not None and len(drafts) else None)


def mtp_tensor_names(spec: MtpSpec, kit: _DenseKit) -> dict[str, tuple]:
    """Every canonical tensor with its shape."""
    H, shapes = spec.hidden_size, {}
    for k in range(spec.num_layers):
        shapes.update({f"layers.{k}.{n}": ((H, 2 * H) if n == "proj.weight" else (H,)) for n in FUSION})
        shapes.update(kit.shapes(f"layers.{k}.block.", k))
    return shapes


def load_mtp(params: dict | None, drafter_dir, target) -> MtpDrafter:
    """Load a canonical MTP drafter for `target`. Its tensors live in the artifact's target files
    (config `weights: target`, with a name map) or in drafter/model.safetensors. `params` override
    config fields (e.g. {'allow_layer_reuse': True})."""
    from specpack.runtime.weights import assign_weights, check_shapes, checkpoint_files, read_tensors, tensor_shapes

    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / "config.json").is_file():
        raise InputError(f"no config.json in drafter dir {drafter_dir}")
    cfg = {**json.loads((drafter_dir / "config.json").read_text()), **(params or {})}
    spec, kit = mtp_spec_from_config(cfg), _kit(target)
    problems = [f"{name} is {mine}, the target's is {theirs}" for name, mine, theirs in [
        ("hidden_size", spec.hidden_size, target.spec.hidden_size),
        ("vocab_size", spec.vocab_size, target.spec.vocab_size)] if mine != theirs]
    if problems:
        raise InputError(f"drafter {drafter_dir} does not fit this target", problems=problems)
    expected = mtp_tensor_names(spec, kit)
    in_target = cfg["weights"] == "target"  # canonical name -> tensor name in the target's files
    names = (cfg.get("tensors") or {}) if in_target else {n: n for n in expected}
    files = checkpoint_files(drafter_dir.parent if in_target else drafter_dir)
    files = {names[c]: files[names[c]] for c in names if names[c] in files}
    shapes = tensor_shapes(files)
    check_shapes({c: shapes[s] for c, s in names.items() if s in shapes}, expected, f"MTP drafter {drafter_dir}")
    raw = read_tensors(files, {names[c] for c in expected})
    t = {c: raw[names[c]] for c in expected}
    state = {}
    for k in range(spec.num_layers):
        p = f"layers.{k}."
        state.update({p + n: t[p + n] + spec.norm_offset if "norm" in n and spec.norm_offset else t[p + n]
                      for n in FUSION})
        state.update(kit.state(t, p + "block."))
    with torch.device("meta"):
        drafter = MtpDrafter(spec, target, kit)
    drafter = assign_weights(drafter, state, target.device, target.dtype)
    from specpack.runtime.deepseek import keep_router_fp32

    return keep_router_fp32(drafter)
