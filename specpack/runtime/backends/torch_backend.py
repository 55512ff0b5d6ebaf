"""The reference backend: our PyTorch decoder and drafters (CPU or CUDA, any dtype)."""

from __future__ import annotations

from pathlib import Path

NAME = "torch"


def load(artifact, manifest, device: str = "cpu", dtype: str = "float32", cpu_kernels: bool = True,
         weights: str = "fp32"):
    """(Transformer, drafter module) of the verified `artifact`, memory-mapped, on `device`/`dtype`.
    On the CPU in fp32 the linear layers run on specpack's packed kernel (`cpu_kernels=False`, or
    SPECPACK_KERNELS=0, keeps torch's), their weights kept in `weights` (fp32, fp16, bf16, int8)."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels
    from specpack.runtime.api import _device, _dtype
    from specpack.runtime.spec_model import load_drafter, load_target

    target = load_target(artifact, _device(device), _dtype(dtype))
    entry = manifest.drafter
    params = entry.model_dump(exclude={"kind"}) if entry.kind == "ngram" else None
    drafter_dir = Path(artifact) / "drafter" if entry.kind != "ngram" else None
    drafter = load_drafter(entry.kind, params, drafter_dir, target)
    if cpu_kernels or weights != "fp32":
        use_cpu_kernels(target, weights)
        use_cpu_kernels(drafter, weights)
    return target, drafter
