"""Swap a CPU fp32 model's linear layers for the packed small-M kernel (runtime/kernels).

The kernel streams each weight once whatever the number of rows, so verifying D+1 drafted tokens
costs about what decoding one does, and its results do not depend on the number of rows: verify
and plain decoding see bit-identical projections. Measured here it also beats torch's GEMM on
prefill-sized inputs (256 rows: lm_head 178 vs 237 ms, gate/up 8.8 vs 24 ms), so it runs everything.

The weights can be kept in fp32 (as loaded), fp16, bf16 or int8 (`weights=`; see kernels/linear.py):
activations and sums stay fp32 (bf16 on a CPU with AMX tiles: each activation split in two bf16
parts, 16 significant bits, bf16_tiles.c; the vocabulary head keeps the vector kernel); or in w8a8
(int8 weights and int8-rounded activations, int8 dot products). Each precision keeps the
row-exactness above. At fp32, a layer whose
every weight is exactly an fp16 (or bf16) value, as a checkpoint stored in 16 bits and widened at load
is (the shipped drafter heads), is packed in that format: the kernel widens it back to the same fp32
values, so the bits are the same, and it streams half the bytes (an EAGLE-3 head's draft step: ~2x).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from specpack.runtime.kernels.linear import BF16_TILES, available, bf16_tiles
from specpack.runtime.options import WEIGHTS

HEAD = "lm_head"  # the vocabulary head's name in every model here (screened for greedy rows)

log = logging.getLogger(__name__)


class PackedLinearModule(nn.Module):
    """An nn.Linear replacement over `kernels.linear.PackedLinear`. `weight` holds the packed
    panels (fp32/fp16/bf16 [ceil(out/16), in, 16], int8 blocks [ceil(out/16), ceil(in/32), 576]
    bytes); `dense_weight()` gives the fp32 [out, in] weight it computes with (what the ONNX export
    reads through `linear_params`)."""

    def __init__(self, linear: nn.Linear | None, weights: str = "fp32", packed=None):
        super().__init__()
        if packed is None:
            packed = _pack(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(), weights)
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.register_buffer("weight", self.packed.weight, persistent=False)
        self.register_buffer("bias", self.packed.bias, persistent=False)

    @classmethod
    def of_blocks(cls, blocks, bias: Tensor | None = None) -> "PackedLinearModule":
        """A layer over GGUF blocks (kernels/gguf.py), packed as they are."""
        from specpack.runtime.kernels.gguf import packed

        return cls(None, packed=packed(blocks, bias))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        return self.packed(x, residual=residual)

    def dense_weight(self) -> Tensor:
        return self.packed.dense()


def use_cpu_kernels(model: nn.Module, weights: str = "fp32", widen: bool = False) -> int:
    """Replace every fp32 CPU nn.Linear in `model` by the packed kernel, its weight kept in
    `weights` (fp32, fp16, bf16, int8, w8a8); return how many. With `widen` (a model loaded in 16 bits
    as stored, `weights` not fp32) its 16-bit linear layers are packed too, straight from the
    stored values, and every other floating-point tensor is then widened to fp32.

    With fp32 weights this does nothing (returns 0) when the kernel is unavailable (no compiler or
    AVX2, or SPECPACK_KERNELS=0) or the model is not fp32 on the CPU. With other weights and no
    kernel, the layers run torch's `F.linear` on fp32 copies of the rounded weights: the same
    numbers up to summation order, without the memory or speed gain (a warning says so). Torch's
    own pool drops to one thread: the kernel's threads have the cores during the matmuls, and two
    pools spinning on two cores fight.
    """
    from specpack.runtime.kernels import unavailable_reason
    from specpack.runtime.kernels._lib import _library

    if weights not in WEIGHTS:
        raise ValueError(f"unknown weight format {weights!r}: use one of {', '.join(WEIGHTS)}")
    if not available():
        _say_why(unavailable_reason())
        if weights == "fp32":
            return 0
        log.warning("%s weights run in torch (the kernel's values: %s), without its memory or speed gain", weights,
                    "its integer arithmetic" if weights == "w8a8" else "F.linear on fp32 copies of the rounded weights")
    elif weights == "w8a8" and not _library()[0].sp_vnni():
        log.warning("this CPU has no AVX-512 VNNI: w8a8 runs AVX2 integer tiles (the same results), about as fast as "
                    "int8 and twice as far from fp32; --weights int8 is the better int8 precision here")
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _eligible(child, widen and weights != "fp32"):
                packed = packed_linear(child.weight, child.bias, weights, head=name == HEAD)
                setattr(parent, name, packed)
                swapped.append(packed)
    say_narrowed(swapped, weights)
    if widen and weights != "fp32":
        _widen(model)
    held = sum(isinstance(m, PackedLinearModule) for m in model.modules())  # packed at load too
    if held and available():
        torch.set_num_threads(1)
        for m in model.modules():  # products outside nn.Linear (DeepSeek's router and MLA's absorbed ones)
            if hasattr(m, "pack_products"):
                m.pack_products()
        fused = sum(m.fuse_layers() for m in model.modules() if hasattr(m, "fuse_layers"))
        screened = hasattr(model, "screen_head") and model.screen_head()  # the target's head, or a draft model's
        log.info("CPU kernels: %d linear layers packed (%s), %d decoders fused%s; torch ops on 1 thread",
                 held, f"{weights} weights" if len(swapped) == held else f"{held - len(swapped)} at load",
                 fused, ", greedy head screened" if screened else "")
    return len(swapped)


def packed_linear(weight: Tensor, bias: Tensor | None, weights: str = "fp32", head: bool = False,
                  release=None) -> PackedLinearModule:
    """A linear layer's weight (and bias) on the packed kernel in `weights`: at fp32 in the narrowest format that
    holds its values exactly (`exact_format`); bf16 on AMX tiles where they run, except for the vocabulary `head`
    (the greedy screen recomputes its columns in linear.c's bf16 arithmetic). What `use_cpu_kernels` puts in place
    of each nn.Linear, and the loader (models/weights.py) as it reads each layer. With `release` (called on each
    stretch of rows once it is read: the loader hands their pages of the mapped file back), a weight over
    CHUNK_BYTES is read and packed a stretch at a time, never resident whole beside its panels."""
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    chunked = release is not None and available() and weight.numel() * 4 > CHUNK_BYTES
    fmt = weights if weights != "fp32" or not available() else exact_format(weight, release if chunked else None)
    if fmt == "bf16" and weights == "bf16" and not head and bf16_tiles():
        fmt = BF16_TILES
    packed = _pack_in_chunks(weight, bias, fmt, release) if chunked else _pack(weight, bias, fmt)
    module = PackedLinearModule(None, fmt, packed=packed)
    module.narrowed = fmt != weights and fmt != BF16_TILES
    return module


CHUNK_BYTES = 32 << 20  # fp32 bytes of a large weight read and packed at a time (packed_linear with `release`)


def _row_chunks(weight: Tensor):
    """`weight`'s rows in stretches of whole panels, about CHUNK_BYTES of fp32 each."""
    from specpack.runtime.kernels.linear import NR

    rows = max(NR, CHUNK_BYTES // (4 * weight.shape[1]) // NR * NR)
    return (weight[a:a + rows] for a in range(0, len(weight), rows))


def _pack_in_chunks(weight: Tensor, bias: Tensor | None, fmt: str, release):
    """`_pack`'s layer, its panels filled a stretch of rows at a time (a panel holds 16 rows only: the same bytes),
    `release(rows)` after each stretch."""
    from specpack.runtime.kernels.linear import packed_panels, panel_layout
    from specpack.runtime.kernels.tuning import of_panels

    shape, dtype = panel_layout(fmt, *weight.shape)
    panels, at = torch.empty(shape, dtype=dtype), 0
    for rows in _row_chunks(weight):
        part = packed_panels(rows.float(), fmt)
        panels[at: at + len(part)] = part
        at += len(part)
        release(rows)
    return of_panels(panels, fmt, tuple(weight.shape), bias)


def say_narrowed(modules, weights: str) -> None:
    """Log how many fp32 layers `packed_linear` kept in 16 bits (their values are 16-bit ones)."""
    narrowed = sum(getattr(m, "narrowed", False) for m in modules)
    if narrowed and weights == "fp32":
        log.info("%d fp32 linear layers hold only 16-bit values: packed in 16 bits (the same bits, half the bytes)",
                 narrowed)


def _pack(weight: Tensor, bias: Tensor | None, fmt: str):
    from specpack.runtime.kernels import pack

    return pack(weight, bias, weights=fmt)


def exact_format(weight: Tensor, release=None) -> str:
    """"fp16" or "bf16" when every value of `weight` is exactly one of that format's (a checkpoint
    stored in 16 bits, widened to fp32 at load), else "fp32". A probe of the first values rules out
    most fp32 weights before the whole one is compared, a stretch of rows at a time (`release(rows)` after each,
    as packed_linear)."""
    w = weight.detach()
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        probe = w.reshape(-1)[:4096]
        if torch.equal(probe.to(dtype).float(), probe) and all(_exact(rows, dtype, release) for rows in _row_chunks(w)):
            return name
    return "fp32"


def _exact(rows: Tensor, dtype, release) -> bool:
    same = torch.equal(rows.to(dtype).float(), rows)
    if release is not None:
        release(rows)
    return same


def pack_exact(weight: Tensor):
    """`weight` on the packed kernel at its own precision (`exact_format`: the same values, never a
    narrower format), for products outside an nn.Linear that must stay row-exact."""
    from specpack.runtime.kernels import pack

    w = weight.detach().float().contiguous()
    return pack(w, weights=exact_format(w))


def _say_why(reason: str) -> None:
    """Log which path runs instead of the kernels, and how fast it is here (a warning, unless the
    user turned the kernels off)."""
    from specpack.runtime.kernels import tuning

    if reason.startswith("disabled by"):
        log.info("CPU kernels off: %s", reason)
    else:
        log.warning("%s", tuning.fallback_message(reason))


def _eligible(m: nn.Module, any_float: bool = False) -> bool:
    return (isinstance(m, nn.Linear) and m.weight.device.type == "cpu"
            and (m.weight.dtype == torch.float32 or any_float and m.weight.is_floating_point()))


def _widen(model: nn.Module) -> None:
    """Every floating-point parameter and buffer outside the packed layers to fp32, in place (the
    same module objects, so a drafter holding the target's embedding sees the widened table)."""
    for m in model.modules():
        if isinstance(m, PackedLinearModule):
            continue
        for name, p in m._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                m._parameters[name] = nn.Parameter(p.detach().float(), requires_grad=False)
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                m._buffers[name] = b.float()
