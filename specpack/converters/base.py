"""What every drafter converter returns, and the options they share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from specpack.errors import InputError

CONVENTIONS = {"input": "input_of_layer", "output": "output_of_layer"}


@dataclass(frozen=True)
class AuxOverride:
    """Aux layer ids given by the user, with the convention they count in."""

    ids: tuple[int, ...]
    convention: str  # "input_of_layer" | "output_of_layer"

    @classmethod
    def parse(cls, ids: Optional[str], convention: Optional[str]) -> Optional["AuxOverride"]:
        if ids is None:
            return None
        if convention not in CONVENTIONS:
            raise InputError("--aux-layer-ids needs --aux-convention input|output",
                             hint="'input': id i is the hidden state entering layer i (EAGLE, vLLM); "
                                  "'output': the state leaving layer i (TensorRT-LLM, ModelOpt)")
        try:
            parsed = tuple(int(x) for x in ids.split(","))
        except ValueError:
            raise InputError(f"--aux-layer-ids '{ids}' is not a comma-separated list of integers") \
                from None
        return cls(parsed, CONVENTIONS[convention])


BLOCK_LAYOUT_FLAG = "--block-layout fill_in|anchor_first"
BLOCK_ALGORITHM_FLAG = "--block-algorithm dflash|dspark|lilicorr"
MASK_TOKEN_FLAG = "--mask-token-id ID"
TARGET_LAYERS_FLAG = "--target-layer-ids I,J,... --aux-convention input|output"


@dataclass(frozen=True)
class BlockOverrides:
    """What `specpack build` flags settle for a block drafter (DFlash, DSpark, LiLiCorr) whose checkpoint
    leaves it ambiguous. A flag never overrides what the checkpoint states unambiguously: it may only
    supply a missing binding or pick one of two values the checkpoint states."""

    layout: Optional[str] = None  # "fill_in" | "anchor_first"
    algorithm: Optional[str] = None  # "dflash" | "dspark" | "lilicorr"
    mask_token_id: Optional[int] = None

    def given(self) -> list[str]:
        names = {"layout": "--block-layout", "algorithm": "--block-algorithm", "mask_token_id": "--mask-token-id"}
        return [flag for key, flag in names.items() if getattr(self, key) is not None]


@dataclass(frozen=True)
class ConvertedDrafter:
    """A drafter in canonical form: its manifest entry, config and weights (none for n-gram)."""

    entry: Any
    config: Optional[dict] = None
    tensors: dict = field(default_factory=dict)
    kv_bytes_per_token: int = 0
    files: dict = field(default_factory=dict)  # path under drafter/ -> source file, carried byte for byte
    extra_weight_bytes: int = 0  # weights not in `tensors`: in-target MTP tensors, a draft model's files

    @property
    def weight_bytes(self) -> int:
        return self.extra_weight_bytes + sum(t.numel() * t.element_size() for t in self.tensors.values())


ALLOW_MISMATCH_FLAG = "--allow-target-mismatch"


def mismatch_problems(made_for: list, allowed: bool) -> list[str]:
    """The statements of a drafter about its target (schemas.MadeFor) that this target contradicts:
    problems, unless the build allows the mismatch."""
    if allowed:
        return []
    return [f"the drafter was made for another target: {m.stated_in} = {m.value!r}, this target's is {m.target!r} "
            f"(a drafter trained on another revision can collapse acceptance; {ALLOW_MISMATCH_FLAG} builds it "
            "anyway, stated in the manifest)" for m in made_for if m.matches is False]
