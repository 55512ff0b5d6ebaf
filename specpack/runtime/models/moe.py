"""Routed experts, shared by our MoE decoders: each token runs its top-k experts (SwiGLU MLPs) and
sums their outputs weighted by the router. `dispatch` is the loop both use: experts in id order,
each on only the tokens routed to it, added back with index_add_ (as transformers' experts loop).
The Qwen3-MoE router is here (softmax over the experts, top-k, optionally renormalized:
transformers Qwen3MoeTopKRouter); DeepSeek's grouped sigmoid router lives with its decoder
(deepseek.py). Routers run in fp32 whatever the model's dtype: routing decides which experts run."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn



class Fp32Router(nn.Module):
    """A router (this module's and DeepSeek's grouped sigmoid one): kept in fp32 by `keep_routers_fp32`."""


def dispatch(x: Tensor, ids: Tensor, weights: Tensor, experts: nn.ModuleList) -> Tensor:
    """x [T, H]; ids, weights [T, k] -> the weighted sum of each token's experts [T, H]."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, (experts[e](x[tok]) * weights[tok, slot, None]).to(x.dtype))
    return out


class SoftmaxRouter(Fp32Router):
    """Softmax over the experts' logits, the top k kept (renormalized to sum 1 with `renormalize`)."""

    def __init__(self, experts: int, hidden: int, k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.k, self.renormalize = k, renormalize
        self.packed = None  # the logits' product on the packed kernel

    def pack_products(self) -> None:
        """Score on the packed kernel at the weight's own precision, row-exact as every other product."""
        from specpack.runtime.kernels.accelerate import pack_exact

        self.packed = pack_exact(self.weight)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        # x: [T, H] -> expert ids [T, k], weights [T, k] (fp32)
        x = x.float()
        logits = F.linear(x, self.weight.float()) if self.packed is None else self.packed(x)
        weights, ids = logits.softmax(-1).topk(self.k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights


class SparseMoE(nn.Module):
    """Qwen3-MoE's MLP: `gate` (the router) and `experts.{e}` (gate and up fused, as every MLP here)."""

    def __init__(self, hidden: int, inter: int, experts: int, k: int, renormalize: bool, expert: Callable):
        super().__init__()
        self.gate = SoftmaxRouter(experts, hidden, k, renormalize)
        self.experts = nn.ModuleList(expert(hidden, inter) for _ in range(experts))  # `expert`: dense.MLP

    def forward(self, x: Tensor) -> Tensor:
        return dispatch(x, *self.gate(x), self.experts)


def keep_routers_fp32(model: nn.Module) -> nn.Module:
    """Every router of `model` (either kind) in fp32, whatever the model's dtype (as transformers)."""
    for module in model.modules():
        if isinstance(module, Fp32Router):
            module.float()
    return model
