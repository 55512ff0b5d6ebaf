"""The reference backend: our PyTorch decoder and drafters (CPU or CUDA, any dtype)."""

from __future__ import annotations

from pathlib import Path

NAME = "torch"


def load(artifact, manifest, device: str = "cpu", dtype: str = "float32"):
    """(Transformer, drafter module) of the verified `artifact`, memory-mapped, on `device`/`dtype`."""
    from specpack.runtime.api import _device, _dtype
    from specpack.runtime.spec_model import load_drafter, load_target

    target = load_target(artifact, _device(device), _dtype(dtype))
    entry = manifest.drafter
    params = entry.model_dump(exclude={"kind"}) if entry.kind == "ngram" else None
    drafter_dir = Path(artifact) / "drafter" if entry.kind != "ngram" else None
    return target, load_drafter(entry.kind, params, drafter_dir, target)
