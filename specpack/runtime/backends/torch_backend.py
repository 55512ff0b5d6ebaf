"""The reference backend: our PyTorch decoder and drafters (CPU or CUDA, any dtype)."""

from __future__ import annotations

from pathlib import Path

NAME = "torch"


def load(artifact, manifest, device: str = "cpu", dtype: str = "float32", cpu_kernels: bool = True,
         weights: str = "fp32", kv_cache: str = "model"):
    """(Transformer, drafter module) of the verified `artifact`, memory-mapped, on `device`/`dtype`.
    On the CPU in fp32 the linear layers run on specpack's packed kernel (`cpu_kernels=False`, or
    SPECPACK_KERNELS=0, keeps torch's), their weights kept in `weights` (fp32, fp16, bf16, int8, w8a8).

    With `weights` other than fp32 and a checkpoint stored in 16 bits, the models load as stored
    (views of the mapped files, no fp32 copy of the whole model), the linear layers are packed from
    those, and only the rest (embeddings, norms) is widened to fp32: the peak memory of loading is
    about the stored size, not twice it.

    `kv_cache` fp16 keeps the target's KV cache in fp16 (a float32 dense target: half the bytes
    each step reads per cached position; the drafter's own cache stays in the model's dtype)."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels
    from specpack.runtime.options import device as _device, dtype as _dtype
    from specpack.runtime.spec_model import load_drafter, load_target

    as_stored = (weights != "fp32" and dtype == "float32" and device == "cpu"
                 and manifest.target.dtype in ("float16", "bfloat16"))
    packs = cpu_kernels or weights != "fp32"
    target = load_target(artifact, _device(device), _dtype(manifest.target.dtype if as_stored else dtype),
                         weights if packs else None)
    if kv_cache == "fp16":
        _narrow_cache(target)
    entry = manifest.drafter
    params = entry.model_dump(exclude={"kind"}) if entry.kind == "ngram" else None
    drafter_dir = Path(artifact) / "drafter" if entry.kind != "ngram" else None
    own = drafter_weights(manifest, weights)
    drafter = load_drafter(entry.kind, params, drafter_dir, target, own if packs else None)
    if packs:
        use_cpu_kernels(target, weights, widen=as_stored)
        use_cpu_kernels(drafter, own, widen=as_stored)
    return target, drafter


def drafter_weights(manifest, weights: str) -> str:
    """The precision the drafter's linear layers are packed in: `weights`; beside a target kept in GGUF blocks
    (which --weights does not change) the default fp32 becomes int8 blocks (w8a8 where the CPU has VNNI, else
    int8): an fp32 head streams about a third of what the 4-bit target does a token (the shipped EAGLE-3 head
    30 MB a draft step, SmolLM2 Q4_1 94 MB a token), so drafting at fp32 cost that target's speculation most of
    its gain. Lossless either way (the target checks every drafted token); the head's acceptance length on
    HumanEval is 2.05 at w8a8, 2.04 at fp32. Another --weights (fp16, bf16, int8, w8a8) is the drafter's as given.
    """
    from specpack.runtime.kernels import available
    from specpack.runtime.kernels._lib import _library

    q = manifest.target.arch.quantization if manifest.target.arch else None
    if weights != "fp32" or q is None or q.scheme != "gguf" or manifest.drafter.kind == "ngram" or not available():
        return weights
    return "w8a8" if _library()[0].sp_vnni() else "int8"


def _narrow_cache(target) -> None:
    """Keep `target`'s KV cache in fp16 (dense decoders only: the MLA latent cache stays)."""
    import torch

    from specpack.errors import InputError
    from specpack.runtime.models.dense import Transformer

    if not isinstance(target, Transformer):
        raise InputError(f"--kv-cache fp16 is for dense targets; this one is {type(target).__name__}",
                         hint="drop --kv-cache")
    target.kv_dtype = torch.float16
