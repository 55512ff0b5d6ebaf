"""`specpack.load(ARTIFACT)`: verify first, then build one SpecModel from the artifact."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from specpack.errors import InputError

from specpack.runtime.options import (DTYPES, KV_CACHES, WEIGHTS, check_kv_cache, check_weights, device as _device,
                                      dtype as _dtype, require)

log = logging.getLogger(__name__)
__all__ = ["DTYPES", "KV_CACHES", "WEIGHTS", "check_kv_cache", "check_weights", "load", "load_tokenizer", "require"]


def load(path, public_key=None, require_signature: bool | None = None, device: str = "cpu",
         dtype: str = "float32", verify: bool = True, progress: bool = False, backend: str = "torch",
         weights: str = "fp32", kv_cache: str = "model", **backend_options):
    """Verify the artifact at `path` (signature when a key is given or required, every digest
    always), then load target and drafter, memory-mapped, into one `SpecModel`.

    `backend` is torch (CPU/CUDA, the reference), onnxruntime (CPU; needs `specpack export ART
    --to onnx`) or tensorrt (CUDA). The returned model carries `.manifest` (the parsed
    specpack.json), `.tokenizer` (from the artifact) and `.verification` (what was checked). A
    tampered artifact is never loaded.

    `weights` is the precision the CPU kernels keep the linear layers' weights in: fp32 (as
    loaded), fp16 or bf16 (half the bytes, rounded to nearest; exact for a checkpoint stored in that
    format) or int8 (per-block scales, like llama.cpp's Q8_0), with activations in fp32; or w8a8
    (those int8 weights, each row of activations rounded to int8 blocks too: llama.cpp's Q8_0
    arithmetic, several rows for about the price of one where the CPU has VNNI). Greedy output
    with speculation equals greedy output without it at every precision. Needs the torch backend on
    the CPU in float32.

    `kv_cache` is the target's KV cache: "model" (the model's dtype) or "fp16" (a float32 model's
    keys and values rounded to fp16 as they are written: half the bytes every step reads per cached
    position, which long contexts and many sequences are bound by). Torch backend, float32.
    """
    from specpack.packager import verify as verify_artifact
    from specpack.packager.artifact import read_manifest
    from specpack.packager.verify import check_paths
    from specpack.runtime import backends
    from specpack.runtime.models.weights import trim_heap
    from specpack.runtime.spec_model import SpecModel
    from specpack.schemas import MANIFEST_NAME

    path = Path(path)
    if require_signature is None:
        require_signature = os.environ.get("SPECPACK_REQUIRE_SIGNATURE", "") not in ("", "0")
    report = verify_artifact(path, public_key, require_signature, progress) if verify else None
    manifest = report.manifest if report else read_manifest(path)
    if not verify:
        check_paths(path, manifest)  # no links, and no file read from outside the artifact
    check_runnable(manifest)
    _device(device), _dtype(dtype)  # check both before any work
    check_weights(weights, backend, device, dtype)
    check_kv_cache(kv_cache, backend, dtype)
    if weights != "fp32":
        backend_options["weights"] = weights
    if kv_cache != "model":
        backend_options["kv_cache"] = kv_cache
    target, drafter = backends.load(backend, path, manifest, device, dtype, **backend_options)
    model = SpecModel(target, drafter).eval()
    model.manifest, model.verification, model.tokenizer = manifest, report, load_tokenizer(path)
    trim_heap()  # what packing and the tokenizer's loading freed, back to the system
    model.identity = {"artifact": _digest(path / MANIFEST_NAME), "backend": backend, "device": device, "dtype": dtype,
                      "weights": weights, "kv_cache": kv_cache,
                      "options": sorted((k, str(v)) for k, v in backend_options.items())}
    log.info("loaded %s (%s drafter) on %s %s/%s, %s weights, %s KV cache", path, manifest.drafter.kind, backend,
             device, dtype, weights, kv_cache)
    return model


def _digest(file: Path) -> str:
    """What names the artifact in measurements kept on this machine: its manifest's SHA-256 (the manifest
    holds every file's digest)."""
    import hashlib

    return hashlib.sha256(file.read_bytes()).hexdigest()


def check_runnable(manifest) -> None:
    """Refuse a target specpack's own runtime does not decode, naming the engines that serve it (a
    family its decoders do not implement, or a quantized checkpoint), before anything is loaded."""
    from specpack.errors import UnsupportedError

    quantized = getattr(manifest.drafter, "quantization", None)
    if quantized:
        raise UnsupportedError(f"this artifact's drafter cannot run on specpack's own runtime: its weights are "
                               f"quantized ({quantized.scheme}) and specpack runs float drafters",
                               hint="serve it with `specpack serve ART --engine vllm` (or sglang, trtllm), or export "
                                    "it: `specpack export ART --to vllm|sglang|trtllm -o DIR`")
    arch = manifest.target.arch
    if arch is None or arch.runs:
        return
    q, fused = arch.quantization, arch.experts is not None and arch.experts.layout == "fused"
    why = (f"its weights are quantized ({q.scheme}) and specpack decodes unquantized checkpoints" if q else
           "its experts are stored fused (`experts.gate_up_proj`, 3-D) and specpack reads one MLP per expert, "
           "as the release publishes them" if fused else
           f"specpack's runtime decodes dense Llama / Mistral (Mistral 3's text too) / Qwen2 / Qwen3 / MiMo, "
           f"Qwen3-MoE and DeepSeek-V3 / Kimi-K2 decoders, not {arch.family} ({manifest.target.architecture}: "
           f"{', '.join(sorted(set(arch.layer_kinds)))})")
    raise UnsupportedError(f"this artifact's target cannot run on specpack's own runtime: {why}",
                           hint="serve it with `specpack serve ART --engine vllm` (or sglang, trtllm), or export it: "
                                "`specpack export ART --to vllm|sglang|trtllm -o DIR`")


# tokenizer_config.json's names for transformers' generic tokenizer over tokenizer.json (one class in transformers 5)
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path):
    """The artifact's tokenizer. Code a model ships is never run, nor asked about (trust_remote_code=False).
    A tokenizer whose config names the generic class is made by that class itself, which is what AutoTokenizer
    would pick, without the ~55 MiB and 670 modules AutoTokenizer imports to resolve it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    generic = (Path(path) / "tokenizer.json").is_file() and _tokenizer_class(path) in GENERIC_TOKENIZERS
    try:
        if generic:
            return PreTrainedTokenizerFast.from_pretrained(path)
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        if "custom code" in str(exc):
            raise InputError(f"the tokenizer of '{path}' needs code of its own, which specpack never runs",
                             hint="use a target whose tokenizer transformers loads without custom code") from None
        raise InputError(f"cannot load the tokenizer of '{path}': {str(exc).splitlines()[0]}",
                         hint="the artifact's tokenizer files are missing or broken") from None


def _tokenizer_class(path: Path) -> str | None:
    import json

    try:
        return json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # AutoTokenizer reports what is wrong
