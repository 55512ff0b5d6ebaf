"""CPU kernels compiled on first use. `linear`: fp32 small-M linear layer, see its docstring."""

from specpack.runtime.kernels.linear import PackedLinear, available, pack, unavailable_reason

__all__ = ["PackedLinear", "available", "pack", "unavailable_reason"]
