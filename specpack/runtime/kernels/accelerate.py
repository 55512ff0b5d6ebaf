"""Swap a CPU fp32 model's linear layers for the packed small-M kernel (runtime/kernels).

The kernel streams each weight once whatever the number of rows, so verifying D+1 drafted tokens
costs about what decoding one does, and its results do not depend on the number of rows: verify
and plain decoding see bit-identical projections. Measured here it also beats torch's GEMM on
prefill-sized inputs (256 rows: lm_head 178 vs 237 ms, gate/up 8.8 vs 24 ms), so it runs everything.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


class PackedLinearModule(nn.Module):
    """An nn.Linear replacement over `kernels.linear.PackedLinear`. `weight` holds the K-major
    panels [ceil(out/16), in, 16] (what the ONNX export reads through `linear_params`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from specpack.runtime.kernels import pack

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        self.register_buffer("weight", self.packed.weight, persistent=False)
        self.register_buffer("bias", self.packed.bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.packed(x)


def use_cpu_kernels(model: nn.Module) -> int:
    """Replace every fp32 CPU nn.Linear in `model` by the packed kernel; return how many.

    Does nothing (returns 0) when the kernel is unavailable (no compiler or AVX2, or
    SPECPACK_KERNELS=0) or the model is not fp32 on the CPU. Torch's own pool drops to one thread:
    the kernel's threads have the cores during the matmuls, and two pools spinning on two cores
    fight (PERF-NOTES).
    """
    from specpack.runtime.kernels import available, unavailable_reason

    if not available():
        log.info("CPU kernels off: %s", unavailable_reason())
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _eligible(child):
                setattr(parent, name, PackedLinearModule(child))
                swapped += 1
    if swapped:
        torch.set_num_threads(1)
        log.info("CPU kernels: %d linear layers packed; torch ops on 1 thread", swapped)
    return swapped


def _eligible(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
