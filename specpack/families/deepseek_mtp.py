"""The MTP naming DeepSeek-V3 introduced and GLM-4.5 / GLM-5 reuse: module k is a decoder layer at
`model.layers.{L+k}.` with `enorm`, `hnorm`, `eh_proj [H, 2H]` (its input is cat(enorm(embedding),
hnorm(hidden)): embedding first) and `shared_head.norm`; `embed_tokens` and `shared_head.head` are
copies of the target's that GLM-4.6 and GLM-5 leave out (vLLM PR #27597), so they are optional.
Sources: vLLM models/deepseek_mtp.py :85-144, glm4_moe_mtp.py :106-128, :273-283."""

from __future__ import annotations

from specpack.families.base import Arch, Tensor

OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")


def prefix(arch: Arch, k: int) -> str:
    return f"model.layers.{arch.num_layers + k}."


def fusion(arch: Arch, k: int) -> dict[str, str]:
    """Module k's fusion tensors by role (see base.MTP_ROLES)."""
    p = prefix(arch, k)
    return {"embed_norm": p + "enorm.weight", "hidden_norm": p + "hnorm.weight", "proj": p + "eh_proj.weight",
            "final_norm": p + "shared_head.norm.weight"}


def optional_tensors(arch: Arch, p: str) -> dict[str, Tensor]:
    """The copies of the target's embedding and head a module may carry: checked where present."""
    shape = (arch.vocab_size, arch.hidden_size)
    return {p + name: Tensor(shape) for name in OPTIONAL}
