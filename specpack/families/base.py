"""What every family module describes: a decoder's geometry, each layer's kind, its experts, its MTP
modules and the tensors a checkpoint of it holds, read from `config.json` alone (no torch).

A family module exposes the same few names:
- `MODEL_TYPES` (the `model_type` values it reads) and `ARCHITECTURES` (`architectures[0]` values),
- `describe(config, text) -> Arch` (text: the decoder's config, `text_config` for multimodal wrappers),
- `tensors(arch) -> dict[name, Tensor]` (every tensor a checkpoint of the decoder holds, logical shapes),
- where the family has MTP modules: `mtp_fusion(arch, k) -> {role: name}` (MTP_ROLES: the norms of the
  embedding and of the hidden state, the [H, 2H] projection over their concatenation, the final norm)
  and `mtp_block(arch, k, fused) -> (prefix, {name: Tensor})` (module k's decoder layer(s)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from specpack.errors import InputError

MTP_ROLES = ("embed_norm", "hidden_norm", "proj", "final_norm")
# csa / hca: DeepSeek-V4's compressed sparse and heavily compressed attention (a sliding window beside
# entries that each compress 4 or 128 tokens); block_sparse: MiniMax-M3's (an indexer picks key blocks)
# csa2: DeepSeek-V4.1's (a sliding window beside its group's shared compressed KV)
ATTENTION_KINDS = ("full", "sliding", "chunked", "mla", "mla_sparse", "csa", "hca", "csa2", "block_sparse", "linear",
                   "mamba", "none")
MLP_KINDS = ("dense", "moe", "hash_moe", "none")  # hash_moe: experts chosen by token id (DeepSeek-V4)
# attention kinds whose cache grows with the context (per token); linear attention and Mamba carry a
# fixed recurrent state per sequence instead
CACHED = ("full", "sliding", "chunked", "mla", "mla_sparse", "csa", "hca", "csa2", "block_sparse")
RECURRENT = ("linear", "mamba")


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its token mixer and its MLP (`window`: a sliding or chunked layer's span;
    `cache`: elements one token adds to this layer's cache where it is not the Arch's `kv_width`)."""

    attention: str
    mlp: str
    window: int | None = None
    cache: float | None = None


@dataclass(frozen=True)
class Experts:
    """A mixture of experts: `routed` experts of width `size`, `active` of them per token, plus
    `shared` always-on experts of width `shared_size` (together)."""

    routed: int
    active: int
    size: int
    shared: int = 0
    shared_size: int = 0


@dataclass(frozen=True)
class Mtp:
    """Multi-token-prediction modules inside the target's checkpoint."""

    layers: int  # MTP modules the checkpoint holds
    layout: str  # the manifest's source_layout: mtp-deepseek, mtp-qwen3-next, mtp-mimo, mtp-nemotron-h
    prefix: str  # where module k's tensors live: a format string of k (and L, the target's layer count)
    count_key: str  # the config key that states `layers`
    concat: str  # "embedding_first" or "hidden_first": the order of the fused input


@dataclass(frozen=True)
class Tensor:
    """A tensor a checkpoint must hold: its logical shape; `linear` marks a weight a quantization
    scheme may pack (out, in = its last two dims; `stored_in_out`: a fused expert tensor stored
    [..., in, out] unquantized, as gpt-oss and Llama 4 do)."""

    shape: tuple[int, ...]
    linear: bool = False
    stored_in_out: bool = False
    integer: bool = False  # a table of ids, not weights (DeepSeek-V4's hash router `tid2eid`)
    # a lookup table that may be stored F8_E4M3 with `<stem>.scale` beside it, one scale per row per
    # `row_block` columns (DeepSeek-V4.1's engram tables), or as floats
    row_block: int = 0


@dataclass(frozen=True)
class Arch:
    """A target's decoder as its config states it (family modules build it; nothing guessed)."""

    family: str
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    layers: tuple[Layer, ...]
    prefix: str = "model."  # the decoder's tensor prefix: layer i's tensors start `{prefix}layers.{i}.`
    embed: str = "model.embed_tokens.weight"
    norm: str = "model.norm.weight"  # the final norm
    lm_head: str | None = "lm_head.weight"  # None: tied to the embedding
    text_config: bool = False  # the decoder's config is config.json's `text_config`
    experts: Experts | None = None
    mtp: Mtp | None = None
    kv_width: int = 0  # elements one token caches in one attention layer (K and V, or MLA's latent)
    # recurrent state one sequence holds in one linear-attention / Mamba layer: the convolution's last
    # K-1 inputs and the SSM state (vLLM's MambaStateShapeCalculator: conv in the model dtype, the SSM
    # state in float32 where the config's mamba_ssm_dtype says so, as Qwen3.5's and Nemotron-H's do)
    conv_state: int = 0
    ssm_state: int = 0
    ssm_bytes: int = 0  # 0: the model dtype
    runs: bool = False  # specpack's own runtime decodes it
    details: dict = field(default_factory=dict, compare=False)  # family-specific sizes the shapes need

    def count(self, attention: Iterable[str] = (), mlp: Iterable[str] = ()) -> int:
        """Layers whose attention is one of `attention` or whose MLP is one of `mlp`."""
        a, m = set(attention), set(mlp)
        return sum(1 for layer in self.layers if layer.attention in a or layer.mlp in m)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Cache bytes one token adds: attention layers only (a sliding layer's cache stops growing at
        its window, but counts here, as engines allocate it per token up to the window)."""
        elements = sum(self.kv_width if layer.cache is None else layer.cache
                       for layer in self.layers if layer.attention in CACHED)
        return math.ceil(elements * dtype_bytes)

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        """Recurrent state one sequence holds whatever its length (linear attention, Mamba)."""
        ssm = self.ssm_bytes or dtype_bytes
        return self.count(attention=RECURRENT) * (self.conv_state * dtype_bytes + self.ssm_state * ssm)

    @property
    def draft_len_start(self) -> int:
        """NVIDIA's co-design starting point D = 128 / G - 1, G query heads per cached KV head (MLA: all
        heads read one latent), at least 1: a hypothesis to measure on a GPU, not a rule."""
        mla = any(layer.attention.startswith("mla") for layer in self.layers)
        group = self.num_heads if mla else max(1, self.num_heads // max(1, self.num_kv_heads))
        return max(1, 128 // group - 1)

    @property
    def layer_kinds(self) -> list[str]:
        """Each layer as `attention+mlp` (e.g. `linear+moe`)."""
        return [f"{layer.attention}+{layer.mlp}" for layer in self.layers]


def text_config(config: dict) -> tuple[dict, bool]:
    """(the decoder's config, whether it is nested): a multimodal wrapper's `text_config`, else the
    config itself."""
    text = config.get("text_config")
    if text is None:
        return config, False
    if not isinstance(text, dict):
        raise InputError("config.json: text_config is not a JSON object")
    return text, True


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def size_problems(cfg: dict, required: Iterable[str] = (), optional: Iterable[str] = ()) -> list[str]:
    """Every `required` size that is missing and every size set to anything but a positive integer."""
    problems = [f"{k}: missing" for k in required if cfg.get(k) is None]
    return problems + [f"{k} = {cfg[k]!r}: not a positive integer" for k in dict.fromkeys((*required, *optional))
                       if cfg.get(k) is not None and not positive_int(cfg[k])]


def check_sizes(cfg: dict, required: Iterable[str], optional: Iterable[str] = (), what: str = "target") -> None:
    """Raise one InputError listing every size `size_problems` finds."""
    problems = size_problems(cfg, required, optional)
    if problems:
        raise InputError(f"{what} config.json lacks required fields or has sizes that are not positive integers",
                         problems=problems, hint="is this the model's own config.json?")


def layer_types(cfg: dict, n: int, default, known: tuple[str, ...] = ("full_attention", "sliding_attention")
                ) -> list[str]:
    """`layer_types` as stated (its length checked against the layer count, each type one of the
    family's `known`), else `default(i)` per layer."""
    stated = cfg.get("layer_types")
    if stated is None:
        return [default(i) for i in range(n)]
    if not (isinstance(stated, list) and len(stated) == n and all(isinstance(t, str) for t in stated)):
        raise InputError(f"config.json layer_types must list one type per layer ({n})",
                         problems=[f"layer_types = {str(stated)[:200]}"])
    unknown = sorted({t for t in stated if t not in known})
    if unknown:
        raise InputError("config.json layer_types names layer types this family does not have",
                         problems=[f"layer_types[{stated.index(t)}] = {t!r}: not one of {', '.join(known)}"
                                   for t in unknown])
    return stated


def linear(out: int, inp: int, *lead: int) -> Tensor:
    """A linear weight stored [*lead, out, in]."""
    return Tensor((*lead, out, inp), linear=True)


def vector(n: int, *lead: int) -> Tensor:
    return Tensor((*lead, n))


# ---- the tensors most families share (published names; `p` ends with a dot) ----

def attention_tensors(p: str, H: int, heads: int, kv: int, hd: int, q_rows: int | None = None,
                      bias: bool = False, o_bias: bool = False, qk_norm: str | None = None) -> dict[str, Tensor]:
    """q/k/v/o projections (`q_rows`: a gated attention's doubled q_proj), biases, q/k norms per head
    (`qk_norm="head"`) or over the whole projection (`"full"`, MiniMax-M2)."""
    q = q_rows or heads * hd
    out = {p + "q_proj.weight": linear(q, H), p + "k_proj.weight": linear(kv * hd, H),
           p + "v_proj.weight": linear(kv * hd, H), p + "o_proj.weight": linear(H, heads * hd)}
    if bias:
        out.update({p + "q_proj.bias": vector(q), p + "k_proj.bias": vector(kv * hd), p + "v_proj.bias": vector(kv * hd)})
    if o_bias:
        out[p + "o_proj.bias"] = vector(H)
    if qk_norm == "head":
        out.update({p + "q_norm.weight": vector(hd), p + "k_norm.weight": vector(hd)})
    elif qk_norm == "full":
        out.update({p + "q_norm.weight": vector(heads * hd), p + "k_norm.weight": vector(kv * hd)})
    return out


def mlp_tensors(p: str, H: int, width: int, names=("gate_proj", "up_proj", "down_proj"), *lead: int) -> dict[str, Tensor]:
    """A gated MLP (gate, up, down; `names[0]` None: a non-gated one, up and down only)."""
    gate, up, down = names
    out = {p + f"{up}.weight": linear(width, H, *lead), p + f"{down}.weight": linear(H, width, *lead)}
    if gate:
        out[p + f"{gate}.weight"] = linear(width, H, *lead)
    return out


def sigmoid_moe_tensors(m: str, H: int, experts: Experts) -> dict[str, Tensor]:
    """A DeepSeek-V3-style MoE MLP under `m` (`...mlp.`): the router with its score-correction bias,
    one gated MLP per routed expert, and the shared experts fused into one MLP (DeepSeek, GLM-4.5)."""
    out = {m + "gate.weight": Tensor((experts.routed, H)), m + "gate.e_score_correction_bias": vector(experts.routed)}
    out.update(expert_tensors(m + "experts.", H, experts, fused=False))
    return {**out, **(mlp_tensors(m + "shared_experts.", H, experts.shared_size) if experts.shared else {})}


def expert_tensors(p: str, H: int, experts: Experts, fused: bool, names=("gate_proj", "up_proj", "down_proj"),
                   transposed: bool = False) -> dict[str, Tensor]:
    """Routed experts under `p` (`...mlp.experts.`): one MLP per expert (`{e}.gate_proj.weight`), or
    fused 3-D tensors (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`; `transposed`: stored
    [E, H, 2I] / [E, I, H], as Llama 4 and gpt-oss do)."""
    E, width = experts.routed, experts.size
    if not fused:
        out = {}
        for e in range(E):
            out.update(mlp_tensors(f"{p}{e}.", H, width, names))
        return out
    gated = names[0] is not None
    up = 2 * width if gated else width
    name = "gate_up_proj" if gated else "up_proj"
    if transposed:
        return {p + name: Tensor((E, H, up), linear=True, stored_in_out=True),
                p + "down_proj": Tensor((E, width, H), linear=True, stored_in_out=True)}
    return {p + name: linear(up, H, E), p + "down_proj": linear(H, width, E)}


def embedding_tensors(arch: "Arch") -> dict[str, Tensor]:
    """The embedding, the final norm and the lm_head (unless tied)."""
    out = {arch.embed: Tensor((arch.vocab_size, arch.hidden_size)), arch.norm: vector(arch.hidden_size)}
    if arch.lm_head:
        out[arch.lm_head] = linear(arch.vocab_size, arch.hidden_size)
    return out


GEOMETRY = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")


def geometry(text: dict, required: Iterable[str] = (), optional: Iterable[str] = ()) -> dict:
    """The sizes every decoder states (checked positive integers, every problem at once): hidden, layers,
    heads, kv (GQA, default heads), head_dim (default hidden / heads), inter (0 when unstated), vocab,
    max_pos (default 4096)."""
    check_sizes(text, (*GEOMETRY, *required), (*OPTIONAL_SIZES, *optional))
    H, heads = text["hidden_size"], text["num_attention_heads"]
    return dict(hidden_size=H, num_layers=text["num_hidden_layers"], num_heads=heads,
                num_kv_heads=text.get("num_key_value_heads") or heads, head_dim=text.get("head_dim") or H // heads,
                intermediate_size=text.get("intermediate_size") or 0, vocab_size=text["vocab_size"],
                max_position_embeddings=text.get("max_position_embeddings") or 4096)


def architecture_of(config: dict) -> str:
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else "unknown"


def is_moe(text: dict, i: int, experts: int) -> bool:
    """Whether Qwen-family MoE layer i routes experts (dense.py and qwen3_moe.py read it): transformers' and
    vLLM's rule: not in mlp_only_layers, and (i + 1) % decoder_sparse_step == 0."""
    step = text.get("decoder_sparse_step") or 1
    return experts > 0 and i not in (text.get("mlp_only_layers") or []) and (i + 1) % step == 0
