"""The floor of architecture knowledge every room shares: from a target's config.json (or its
`text_config`), its decoder's geometry, each layer's kind, its experts, its MTP modules, the tensors
its checkpoint holds and how they are quantized. Converters, the runtime and the exports read targets
through it; it reads configs and safetensors headers, never weights, and imports nothing above it.

    check_config(config, tensors, weights)        # every field's type; counts bounded by the checkpoint
    arch = describe(config)                       # Arch: geometry, layers, experts, MTP
    checked = check(arch, header_entries, quant)  # every tensor (quantized or not), or one InputError

One module per family (base.py lists the verbs each exposes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from specpack.errors import InputError, UnsupportedError
from specpack.families import (deepseek, deepseek_v4, deepseek_v41, dense, gemma3, glm4_moe, gpt_oss, llama4, minimax_m2, minimax_m3, nemotron_h, qwen3_moe,
                               qwen3_next, quant)
from specpack.families.base import Arch, Tensor, architecture_of, text_config
from specpack.families.fields import check_config

FAMILIES = {m.__name__.rsplit(".", 1)[1]: m for m in (dense, deepseek, deepseek_v4, deepseek_v41, glm4_moe, qwen3_moe, qwen3_next, minimax_m2, minimax_m3,
                                                       gpt_oss, nemotron_h, llama4, gemma3)}
_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.")


def family_of(config: dict):
    """The family module that reads `config` (by model_type, then architectures[0])."""
    model_type, arch = config.get("model_type"), architecture_of(config)
    for module in FAMILIES.values():
        if model_type in module.MODEL_TYPES:
            return module
    for module in FAMILIES.values():
        if arch in module.ARCHITECTURES:
            return module
    raise UnsupportedError(f"target architecture {arch!r} (model_type {model_type!r}) is not a family specpack knows",
                           hint="known: " + ", ".join(t for m in FAMILIES.values() for t in m.MODEL_TYPES))


def describe(config: dict) -> Arch:
    """The target's decoder as `config` states it (InputError / UnsupportedError listing what is wrong)."""
    text, _ = text_config(config)
    arch = family_of(config).describe(config, text)
    e = arch.experts
    if e and e.routed and e.active > e.routed:
        raise InputError(f"config.json: {e.active} experts per token (num_experts_per_tok) but {e.routed} routed "
                         "experts: no router can pick them", hint="is this the release's own config.json?")
    return arch


@dataclass(frozen=True)
class Checked:
    """A checkpoint checked against its Arch: the Arch with the tensor prefix and expert layout the
    checkpoint uses, its quantization, and what the check counted."""

    arch: Arch
    quant: quant.Quant | None
    fused_experts: bool
    expected: dict  # every tensor the decoder needs, name -> Tensor (MTP modules not included)
    quantized: int  # linear weights stored quantized
    unquantized: int  # linear weights stored unquantized (a scheme's excluded modules)
    mtp_held: int  # MTP modules whose tensors the checkpoint holds


def check(arch: Arch, found: dict, q: quant.Quant | None) -> Checked:
    """Every tensor of `arch` in `found` (name -> safetensors header entry), quantized per `q` or not,
    and the layer and expert counts first (so a config claiming a million layers costs only the
    checkpoint's own tensor list). Raises one InputError listing every problem."""
    arch = _located(arch, found)
    module = FAMILIES[arch.family]
    if hasattr(module, "locate"):  # a family whose release names a tensor more than one way
        arch = module.locate(arch, found)
    problems = _count_problems(arch, found)
    if problems:
        raise InputError(f"the checkpoint does not match its config ({len(problems)} problems)", problems=problems,
                         hint="the checkpoint and config.json must come from the same model")
    fused = _fused(found)
    expected = module.tensors(arch, fused)
    problems, counts = quant.check_all(expected, found, q)
    problems += _scheme_problems(arch, expected, found, q, counts) + quant.scale_format_problems(q, found)
    if problems:
        raise InputError(f"the checkpoint does not match its config ({len(problems)} problems)", problems=problems,
                         hint="the checkpoint and config.json must come from the same model" +
                              (f"; quantized as {q.description}" if q else ""))
    return Checked(arch, q, fused, expected, counts[True], counts[False], mtp_held(arch, found))


def mtp_tensors(arch: Arch, k: int, fused: bool = False) -> dict:
    """MTP module k's tensors (its fusion tensors and its decoder layers), name -> Tensor."""
    module, H = FAMILIES[arch.family], arch.hidden_size
    fusion = {name: Tensor((H, 2 * H) if role == "proj" else (H,)) for role, name in module.mtp_fusion(arch, k).items()}
    return {**fusion, **module.mtp_block(arch, k, fused)[1]}


def mtp_held(arch: Arch, found: dict) -> int:
    """MTP modules whose tensors the checkpoint holds, counted from module 0 (0 where a quantized
    re-upload dropped them; Qwen3-Next's config states no count: the checkpoint's is taken)."""
    if arch.mtp is None or not hasattr(FAMILIES[arch.family], "mtp_block"):
        return 0
    held, most = 0, arch.mtp.layers or 64
    while held < most and any(n in found for n in FAMILIES[arch.family].mtp_block(arch, held)[1]):
        held += 1
    return held


def _located(arch: Arch, found: dict) -> Arch:
    """`arch` with the tensor prefix the checkpoint uses, where its family allows several (a
    multimodal wrapper's published `language_model.model.` or v5's `model.language_model.`)."""
    for p in arch.details.get("prefixes", ()):
        if p + "embed_tokens.weight" in found and p != arch.prefix:
            head = arch.lm_head
            if head and head not in found and "lm_head.weight" in found:
                head = "lm_head.weight"
            return replace(arch, prefix=p, embed=p + "embed_tokens.weight", norm=p + "norm.weight", lm_head=head)
    if arch.lm_head and arch.lm_head not in found and arch.lm_head != "lm_head.weight" and "lm_head.weight" in found:
        return replace(arch, lm_head="lm_head.weight")
    return arch


def _fused(found: dict) -> bool:
    """Experts stored as 3-D tensors (`experts.gate_up_proj`) rather than one MLP each."""
    return any(".experts.gate_up_proj" in n or n.endswith(".experts.down_proj") for n in found)


def _count_problems(arch: Arch, found: dict) -> list[str]:
    held = {int(m.group(1)) for n in found if n.startswith(arch.prefix) and (m := _LAYER.match(n[len(arch.prefix):]))}
    problems = []
    if not set(range(arch.num_layers)) <= held:
        problems.append(f"the config claims {arch.num_layers} decoder layers, but the weights hold "
                        f"{len(held & set(range(arch.num_layers)))} of them under {arch.prefix}layers.")
    if arch.experts and arch.count(mlp=("moe", "hash_moe")) and not _fused(found):
        most = max((max(e) + 1 for e in _experts(found, arch.prefix).values()), default=0)
        if arch.experts.routed > most:
            problems.append(f"the config claims {arch.experts.routed} experts, but the weights hold {most}")
    return problems


def _experts(found: dict, prefix: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for n in found:
        if n.startswith(prefix) and (m := _EXPERT.match(n)):
            out.setdefault(m.group(1), set()).add(int(m.group(2)))
    return out


def _scheme_problems(arch: Arch, expected: dict, found: dict, q, counts: dict[bool, int]) -> list[str]:
    """A scheme that quantizes nothing the checkpoint holds, and MIXED_PRECISION's quantized_layers
    naming a module the model does not have (neither a decoder or MTP linear nor any tensor's module)."""
    if q is None or not counts[True] or not q.layers:
        return quant.none_quantized(q, counts)
    mtp = {n: t for k in range(mtp_held(arch, found)) for n, t in mtp_tensors(arch, k).items()}
    if q.scheme == "gguf":
        return [f"quantization_config.tensor_types names {k}, not a tensor of the model"
                for k, _ in q.layers if k not in expected and k not in mtp]
    linear = {quant.module_of(n) for n, t in {**expected, **mtp}.items() if t.linear}
    fused = {n.rsplit(".", 1)[0] + "." for n in linear if not n.endswith(".weight") and n in expected}
    held = {n.rsplit(".", 1)[0] for n in found}
    return [f"quantization_config.quantized_layers names {k}, a module the model does not have"
            for k, _ in q.layers if k not in linear and k not in held and not _under(k, fused)]


def _under(module: str, prefixes: set[str]) -> bool:
    """`module` inside one of `prefixes` (a fused expert parameter's module, `...experts.`)."""
    return any(module[: i + 1] in prefixes for i, c in enumerate(module) if c == ".")
