"""CPU kernels, built at install time or compiled on first use. `linear`: the small-M linear layer
(fp32, fp16, bf16, int8 or w8a8 weights), see its docstring."""

from specpack.runtime.kernels.linear import FORMATS, PackedLinear, available, unavailable_reason
from specpack.runtime.kernels.tuning import pack

__all__ = ["FORMATS", "PackedLinear", "available", "pack", "unavailable_reason"]
