"""What a run may ask for (devices, dtypes, weight formats, KV caches) and the optional dependencies
it may need: the runtime's floor, importable without torch, below the kernels and above nothing."""

from __future__ import annotations

from specpack.errors import InputError, MissingDependencyError

DTYPES = ("float32", "float16", "bfloat16")
WEIGHTS = ("fp32", "fp16", "bf16", "int8", "w8a8")  # kernels/linear.py FORMATS; here without importing torch
KV_CACHES = ("model", "fp16")  # the target's KV cache: the model's dtype, or fp16


def device(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but torch sees no CUDA device",
                         hint="run on a GPU machine with a CUDA build of torch, or use --device cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise InputError(f"unknown device '{name}'", hint="use cpu or cuda")
    return torch.device(name)


def check_weights(weights: str, backend: str = "torch", device: str = "cpu", dtype: str = "float32") -> None:
    """Refuse a weight precision this run cannot apply, naming every reason at once."""
    if weights not in WEIGHTS:
        raise InputError(f"unknown weight precision '{weights}'", hint="use one of " + ", ".join(WEIGHTS))
    if weights == "fp32":
        return
    problems = [p for p, bad in [(f"backend {backend} (the CPU kernels run on the torch backend)", backend != "torch"),
                                 (f"device {device}", device != "cpu"),
                                 (f"dtype {dtype} (activations stay float32)", dtype != "float32")] if bad]
    if problems:
        raise InputError(f"--weights {weights} needs the torch backend on the CPU in float32", problems=problems,
                         hint="drop --weights, or use --backend torch --device cpu --dtype float32")


def check_kv_cache(kv_cache: str, backend: str = "torch", dtype: str = "float32") -> None:
    """Refuse a KV cache type this run cannot apply, naming every reason at once."""
    if kv_cache not in KV_CACHES:
        raise InputError(f"unknown KV cache type '{kv_cache}'", hint="use one of " + ", ".join(KV_CACHES))
    if kv_cache == "model":
        return
    problems = [p for p, bad in [(f"backend {backend} (its graphs keep their caches in --dtype)", backend != "torch"),
                                 (f"dtype {dtype} (the cache is already 16-bit)", dtype != "float32")] if bad]
    if problems:
        raise InputError(f"--kv-cache {kv_cache} narrows a float32 model's cache on the torch backend",
                         problems=problems, hint="drop --kv-cache, or use --backend torch --dtype float32")


def dtype(name: str):
    import torch

    if name not in DTYPES:
        raise InputError(f"unknown dtype '{name}'", hint="use one of " + ", ".join(DTYPES))
    return getattr(torch, name)


def require(module: str, extra: str):
    """Import an optional dependency or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError.for_module(module, extra) from None
