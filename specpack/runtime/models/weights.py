"""Load safetensors checkpoints (single file or sharded) by memory-mapping them, and check every tensor.

Only fused matrices (q/k/v, gate/up) and dtype or device changes make copies; everything else stays
a view of the mapped file until used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import Tensor

from specpack.errors import InputError
from specpack.families.dense import DEEPSEEK_ARCHITECTURES, load_target_spec, target_tensor_shapes
from specpack.families.checks import checked_tensor_shapes, shape_problems

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (from the index when sharded)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        weight_map = json.loads((model_dir / INDEX).read_text()).get("weight_map", {})
        files = _shard_paths(model_dir, weight_map)
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise InputError(f"{model_dir / INDEX} names shard files that are missing", problems=missing,
                             hint="download the complete checkpoint")
        return files
    if (model_dir / SINGLE).is_file():
        with safe_open(model_dir / SINGLE, framework="pt") as f:
            return {name: model_dir / SINGLE for name in f.keys()}
    hint = ("convert pytorch_model.bin to safetensors first" if (model_dir / "pytorch_model.bin").exists()
            else "expected model.safetensors or model.safetensors.index.json")
    raise InputError(f"no safetensors checkpoint in {model_dir}", hint=hint)


def _shard_paths(model_dir: Path, weight_map: dict) -> dict[str, Path]:
    """tensor name -> shard path; every shard inside `model_dir` (no `..`, absolute path or link
    out of it), or one InputError naming each that is not."""
    from specpack._paths import check_relpath

    inside, files, problems = model_dir.resolve(), {}, set()
    for name, rel in weight_map.items():
        try:
            path = model_dir / check_relpath(rel if isinstance(rel, str) else "", f"{model_dir / INDEX}")
        except InputError:
            problems.add(f"{rel!r} is not a path inside {model_dir}")
            continue
        if not path.resolve().is_relative_to(inside):
            problems.add(f"'{rel}' leads outside {model_dir} (through a link)")
        files[name] = path
    if problems:
        raise InputError(f"{model_dir / INDEX} names weight files outside the model", problems=sorted(problems),
                         hint="never load it: a checkpoint must only name files inside its own folder")
    return files


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Shapes from the safetensors headers, without reading any data."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if files.get(k) == path})
    return shapes


def check_shapes(found: dict[str, tuple], expected: dict[str, tuple], what: str) -> None:
    """Raise one InputError naming every missing tensor and every shape mismatch."""
    problems = shape_problems(found, expected)
    if problems:
        raise InputError(f"{what} does not match its config ({len(problems)} problems)", problems=problems,
                         hint="the checkpoint and config.json must come from the same model")


def read_tensors(files: dict[str, Path], names, blocks: dict[str, tuple[str, int]] | None = None) -> dict[str, Tensor]:
    """The named tensors, memory-mapped (safetensors maps the file; get_tensor does not copy); those in
    `blocks` (name -> (GGML type, columns)) as kernels.gguf.Blocks over their mapped bytes."""
    from safetensors import safe_open

    from specpack.runtime.kernels.gguf import Blocks

    out, by_file, blocks = {}, {}, blocks or {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for path, group in by_file.items():
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in group})
    return {n: Blocks.of(blocks[n][0], t, blocks[n][1]) if n in blocks else t for n, t in out.items()}


def gguf_types(model_dir) -> dict[str, str]:
    """tensor name -> GGML type of the tensors a checkpoint keeps as GGUF blocks (import-gguf), {} for none."""
    try:
        qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(qc, dict) or qc.get("quant_method") != "gguf":
        return {}
    from specpack.families.quant import scheme

    return dict(scheme({"quantization_config": qc}).layers)


def _block_shapes(found: dict[str, tuple], types: dict[str, str]) -> tuple[dict, dict]:
    """(the shapes with every GGUF block tensor's logical one, name -> (type, columns) of those tensors)."""
    from specpack.families.gguf_blocks import columns

    shapes, blocks = dict(found), {}
    for name, kind in types.items():
        if name in found and len(found[name]) == 2:
            cols = columns(kind, found[name][1])
            shapes[name], blocks[name] = (found[name][0], cols), (kind, cols)
    return shapes, blocks


def fuse_layer(t: dict[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
    """One decoder layer's tensors `src*` (transformers names) as our fused `dst*` parameters."""
    from specpack.runtime.kernels.gguf import cat

    out = {}
    for kind in ("weight", "bias"):
        qkv = [t.get(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv"]
        if qkv[0] is not None:
            out[f"{dst}self_attn.qkv_proj.{kind}"] = cat(qkv)
    if f"{src}mlp.gate.weight" in t:  # Qwen3-MoE: the router, and each expert's gate and up fused
        out[f"{dst}mlp.gate.weight"] = t[f"{src}mlp.gate.weight"]
        for e in range(t[f"{src}mlp.gate.weight"].shape[0]):
            p, q = f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.{e}."
            out[q + "gate_up_proj.weight"] = cat([t[p + "gate_proj.weight"], t[p + "up_proj.weight"]])
            out[q + "down_proj.weight"] = t[p + "down_proj.weight"]
    else:
        out[f"{dst}mlp.gate_up_proj.weight"] = cat([t[f"{src}mlp.gate_proj.weight"], t[f"{src}mlp.up_proj.weight"]])
    plain = ["self_attn.o_proj.weight", "self_attn.o_proj.bias", "self_attn.q_norm.weight",
             "self_attn.k_norm.weight", "mlp.down_proj.weight", "input_layernorm.weight",
             "post_attention_layernorm.weight", "hidden_norm.weight"]
    out.update({dst + name: t[src + name] for name in plain if src + name in t})
    return out


def assign_weights(model: torch.nn.Module, state: dict[str, Tensor], device, dtype) -> torch.nn.Module:
    """Move each tensor to device/dtype (no copy when they already match) and assign it in place of
    the module's meta parameters; integer/bool buffers keep their dtype."""
    moved = {}  # by id, so a tied embedding/lm_head stays one tensor on the device
    for v in state.values():
        if id(v) not in moved:
            moved[id(v)] = v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
    state = {k: moved[id(v)] for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def architecture(model_dir) -> str | None:
    """config.json's first `architectures` entry, or None when there is none (or no readable config)."""
    try:
        return (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError):
        return None  # load_target_spec reports what is wrong with the config


def target_spec(model_dir):
    """The spec `load_target` builds its model from (`DeepseekSpec` or `TargetSpec`), reading no weights."""
    if architecture(model_dir) in DEEPSEEK_ARCHITECTURES:
        from specpack.families.deepseek import load_deepseek_spec

        return load_deepseek_spec(model_dir)
    return load_target_spec(model_dir)


def load_target(model_dir, device="cpu", dtype=torch.float32):
    """Build our decoder from a transformers model directory (config.json + safetensors): a
    `DeepseekTransformer` for DeepSeek-V3-style architectures, else our `Transformer`."""
    from specpack.runtime.models.dense import Transformer
    from specpack.runtime.models.moe import keep_routers_fp32

    if architecture(model_dir) in DEEPSEEK_ARCHITECTURES:
        return load_deepseek(model_dir, device, dtype)
    spec = load_target_spec(model_dir)
    return keep_routers_fp32(build_decoder(model_dir, spec, target_tensor_shapes, fuse_layer, Transformer, device,
                                           dtype))


def load_deepseek(model_dir, device="cpu", dtype=torch.float32):
    """Build a `DeepseekTransformer` from a transformers model directory (config.json + safetensors)."""
    from specpack.families import deepseek as family
    from specpack.runtime.models.deepseek import DeepseekTransformer, layer_state
    from specpack.runtime.models.moe import keep_routers_fp32

    spec = family.load_deepseek_spec(model_dir)
    return keep_routers_fp32(build_decoder(model_dir, spec, family.target_tensor_shapes, layer_state,
                                           DeepseekTransformer, device, dtype))


# where a checkpoint keeps its decoder and head: causal LMs; multimodal wrappers as published
# (Mistral 3, Kimi-K2.5: `language_model.model.`), and as transformers v5 re-saves them
DECODER_NAMES = (("model.", "lm_head.weight"), ("language_model.model.", "language_model.lm_head.weight"),
                 ("model.language_model.", "lm_head.weight"))


def decoder_names(files) -> tuple[str, str]:
    """(decoder prefix, head tensor) of a checkpoint: the first of DECODER_NAMES whose embedding it
    holds (else a causal LM's, whose missing tensors the shape check then lists); a wrapper's head
    may also sit at the top (`lm_head.weight`, as transformers saves Mistral 3)."""
    prefix, head = next(((p, h) for p, h in DECODER_NAMES if p + "embed_tokens.weight" in files), DECODER_NAMES[0])
    return prefix, head if head in files or "lm_head.weight" not in files else "lm_head.weight"


def _named(shapes: dict, prefix: str, head: str) -> dict:
    """A causal LM's tensor names (`model.*`, `lm_head.weight`) at the checkpoint's own places."""
    return {(head if n == "lm_head.weight" else prefix + n[len("model."):] if n.startswith("model.") else n): v
            for n, v in shapes.items()}


def build_decoder(model_dir, spec, shapes, layer_state, decoder_cls, device, dtype) -> torch.nn.Module:
    """Check a checkpoint's tensors against `shapes(spec)`, map them into `decoder_cls(spec)`'s names
    (`layer_state` per layer) and assign them: the loading every target family shares."""
    files = checkpoint_files(Path(model_dir))
    prefix, head = decoder_names(files)
    found, blocks = _block_shapes(tensor_shapes(files), gguf_types(model_dir))
    expected = checked_tensor_shapes(spec, found, lambda s: _named(shapes(s), prefix, head),
                                     f"target checkpoint {model_dir}")
    unused = sorted(set(files) - set(expected) - {head})
    if unused:
        log.info("ignoring %d tensors not used by %s: %s", len(unused), decoder_cls.__name__, unused[:5])
    t = read_tensors(files, expected, blocks)
    state = {"embed_tokens.weight": t[prefix + "embed_tokens.weight"], "norm.weight": t[prefix + "norm.weight"],
             "lm_head.weight": t[prefix + "embed_tokens.weight" if spec.tie_word_embeddings else head]}
    for i in range(spec.num_layers):
        state.update(layer_state(t, f"{prefix}layers.{i}.", f"layers.{i}."))
    with torch.device("meta"):
        model = decoder_cls(spec)
    if blocks:
        state = _bind_blocks(model, state, device, dtype)
    return assign_weights(model, state, device, dtype)


def _bind_blocks(model: torch.nn.Module, state: dict, device, dtype) -> dict:
    """Each linear layer whose weight is GGUF blocks replaced by a packed layer over them (kernels/gguf.py),
    its weight and bias taken out of `state`; an embedding table of blocks by a BlockEmbedding (a lookup
    dequantizes its rows). The rest of `state`, for assign_weights."""
    from specpack.errors import InputError
    from specpack.runtime.kernels.accelerate import PackedLinearModule
    from specpack.runtime.kernels.gguf import NATIVE, BlockEmbedding, Blocks

    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise InputError(f"this target keeps GGUF blocks (import-gguf), which run on the CPU in float32, not "
                         f"{device} {str(dtype).removeprefix('torch.')}",
                         hint="use --device cpu --dtype float32, or import the GGUF with --dequantize")
    state, widened = dict(state), set()
    for name, value in list(state.items()):
        if not isinstance(value, Blocks):
            continue
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name)
        del state[name]
        if isinstance(module, torch.nn.Linear):
            bias = state.pop(module_name + ".bias", None)
            replacement = PackedLinearModule.of_blocks(value, bias)
            if value.format is None:
                widened.add(" + ".join(dict.fromkeys(value.kinds)))
        elif isinstance(module, torch.nn.Embedding) and len(value.parts) == 1:
            replacement = BlockEmbedding(value)
        else:
            raise InputError(f"{name} is stored as GGUF blocks, which {type(module).__name__} does not read",
                             hint="import the GGUF with --dequantize")
        parent, _, leaf = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, replacement)
    # the rest (norms) in memory of their own, so the checkpoint's mapping, every page of which packing read,
    # is released once loading ends
    state = {k: v.clone() for k, v in state.items()}
    if widened:
        log.warning("%s layers run widened to fp32 (kernels read %s blocks as they are, one kind of kernel a layer): "
                    "more memory and time than the file's size suggests", ", ".join(sorted(widened)), ", ".join(NATIVE))
    return state
