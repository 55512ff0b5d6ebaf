"""Quantized checkpoints as they are published, checked tensor by tensor from safetensors headers.

A scheme says how a quantized linear weight of logical shape [*lead, out, in] is stored: which tensors
(the packed weight and its scales), their dtypes and shapes. Every linear weight of a family is checked
against either its unquantized form (a float tensor of the logical shape, no scale beside it: the
modules a release leaves out, e.g. routers, lm_head) or the scheme's form; every other tensor against
its logical shape. Nothing is skipped.

| scheme | detected from | a quantized linear X |
|---|---|---|
| `fp8-block` | quant_method fp8 + weight_block_size [b0, b1] | X.weight F8_E4M3 [o, i]; X.weight_scale_inv [⌈o/b0⌉, ⌈i/b1⌉] |
| `fp8` | quant_method fp8, no block size | X.weight F8_E4M3 [o, i]; X.weight_scale [] or [1]; X.input_scale (static) |
| `ct-fp8` | compressed-tensors, 8-bit float weights | X.weight F8_E4M3 [o, i]; X.weight_scale [1] / [o, 1] / blocks |
| `ct-nvfp4` | compressed-tensors, 4-bit float, group 16 | X.weight_packed U8 [o, i/2]; X.weight_scale F8_E4M3 [o, i/16]; X.weight_global_scale [1] |
| `ct-int4` | compressed-tensors, 4-bit int, group g | X.weight_packed I32 [o, i/8]; X.weight_scale [o, i/g]; X.weight_shape [2] |
| `modelopt-nvfp4` | quant_method modelopt (or hf_quant_config.json) NVFP4 / W4A16_NVFP4 | X.weight U8 [o, i/2]; X.weight_scale F8_E4M3 [o, i/16]; X.weight_scale_2 [] |
| `modelopt-fp8` | modelopt FP8 | X.weight F8_E4M3 [o, i]; X.weight_scale []; X.input_scale [] |
| `modelopt-mixed` | modelopt MIXED_PRECISION + `quantized_layers` {module: {quant_algo}} | each listed module as its NVFP4 / W4A16_NVFP4 / FP8 entry says; every other module unquantized |
| `mxfp4` | quant_method mxfp4 (gpt-oss) | X_blocks U8 [*lead, o, i/32, 16]; X_scales U8 [*lead, o, i/32] |

Sources (read, not guessed): vLLM layers/quantization/{fp8,modelopt,mxfp4}.py and compressed_tensors/
schemes, transformers integrations/{finegrained_fp8,mxfp4}.py, DeepSeek-V3 README_WEIGHTS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from specpack.errors import InputError
from specpack.families.base import Tensor

FLOATS = ("F32", "F16", "BF16")
SCALES = ("F32", "F16", "BF16", "F8_E8M0")
E4M3 = ("F8_E4M3",)
SCALAR = ((), (1,))


@dataclass(frozen=True)
class Quant:
    """A checkpoint's quantization scheme (see the module table)."""

    scheme: str
    quant_method: str
    block: tuple[int, int] | None = None  # fp8-block, ct-fp8 block strategy
    group: int = 0  # FP4 / INT4 group size
    strategy: str = ""  # ct-fp8: tensor | channel | block
    kv_cache: str | None = None  # a quantized KV cache the config states (FP8)
    layers: tuple[tuple[str, str], ...] = ()  # modelopt-mixed: (module, quant_algo) as quantized_layers states

    @cached_property
    def layer_algos(self) -> dict[str, str]:
        return dict(self.layers)

    @property
    def description(self) -> str:
        extra = f" {self.block[0]}x{self.block[1]} blocks" if self.block else f" groups of {self.group}" if self.group else ""
        return f"{self.scheme} ({self.quant_method}{extra})"


def scheme(config: dict, hf_quant: dict | None = None) -> Quant | None:
    """The scheme config.json's `quantization_config` (or a ModelOpt `hf_quant_config.json`) states,
    None for an unquantized checkpoint; an UnsupportedScheme error for one specpack cannot check."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if qc is None and hf_quant:
        qc = {"quant_method": "modelopt", **(hf_quant.get("quantization") or {})}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise InputError("config.json quantization_config is not a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    reader = {"fp8": _fp8, "compressed-tensors": _compressed, "modelopt": _modelopt, "mxfp4": _mxfp4}.get(method)
    if reader is None:
        raise InputError(f"quantization_config.quant_method {method!r} is not a scheme specpack can check",
                         hint="supported: fp8 (block or per-tensor), compressed-tensors (FP8, NVFP4, INT4), "
                              "modelopt (NVFP4, FP8, MIXED_PRECISION), mxfp4; dequantize others to bf16 first")
    return reader(qc)


def _fp8(qc: dict) -> Quant:
    block = qc.get("weight_block_size")
    if block is None:
        return Quant("fp8", "fp8")
    return Quant("fp8-block", "fp8", block=_pair(block, "weight_block_size"))


def _compressed(qc: dict) -> Quant:
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [g.get("weights") or {} for g in groups]
    kinds = {(w.get("num_bits"), w.get("type")) for w in weights}
    if len(kinds) != 1:
        raise InputError("compressed-tensors quantization_config must state one weight scheme in config_groups",
                         problems=[f"config_groups weights: {sorted(map(str, kinds))}"])
    w = weights[0]
    kv = "fp8" if qc.get("kv_cache_scheme") else None
    if (w.get("num_bits"), w.get("type")) == (8, "float"):
        strategy = w.get("strategy", "tensor")
        block = _pair(w["block_structure"], "block_structure") if strategy == "block" else None
        return Quant("ct-fp8", "compressed-tensors", block=block, strategy=strategy, kv_cache=kv)
    if (w.get("num_bits"), w.get("type")) == (4, "float"):
        return Quant("ct-nvfp4", "compressed-tensors", group=int(w.get("group_size") or 16), kv_cache=kv)
    if (w.get("num_bits"), w.get("type")) == (4, "int"):
        return Quant("ct-int4", "compressed-tensors", group=int(w.get("group_size") or 128), kv_cache=kv)
    raise InputError(f"compressed-tensors weights of {w.get('num_bits')} bits, type {w.get('type')!r}, are not a "
                     "scheme specpack can check", hint="supported: 8-bit float, 4-bit float (NVFP4), 4-bit int")


def _modelopt(qc: dict) -> Quant:
    algo = str(qc.get("quant_algo", "")).upper()
    kv = (qc.get("kv_cache_quant_algo") or "").lower() or None
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return Quant("modelopt-nvfp4", "modelopt", group=int(qc.get("group_size") or 16), kv_cache=kv)
    if algo == "FP8":
        return Quant("modelopt-fp8", "modelopt", kv_cache=kv)
    if algo == "MIXED_PRECISION":
        return Quant("modelopt-mixed", "modelopt", group=int(qc.get("group_size") or 16), kv_cache=kv,
                     layers=_mixed_layers(qc.get("quantized_layers")))
    raise InputError(f"ModelOpt quant_algo {algo!r} is not a scheme specpack can check",
                     hint="supported: NVFP4, W4A16_NVFP4, FP8, MIXED_PRECISION")


MIXED_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8")


def _mixed_layers(layers) -> tuple[tuple[str, str], ...]:
    """ModelOpt MIXED_PRECISION's `quantized_layers` (vLLM modelopt.py ModelOptMixedPrecisionConfig:
    module name -> {quant_algo, group_size}): required, and every algorithm one specpack checks."""
    if not isinstance(layers, dict) or not layers:
        raise InputError("ModelOpt MIXED_PRECISION states no quantized_layers: which module holds which format is "
                         "unknown", hint="re-export with ModelOpt, whose export writes quantized_layers "
                         "(vLLM refuses the checkpoint without it too)")
    algos = {k: str(v.get("quant_algo", "")).upper() if isinstance(v, dict) else "" for k, v in layers.items()}
    bad = [f"{k}: quant_algo {layers[k].get('quant_algo') if isinstance(layers[k], dict) else layers[k]!r}"
           for k, a in algos.items() if a not in MIXED_ALGOS]
    if bad:
        raise InputError(f"ModelOpt MIXED_PRECISION lists {len(bad)} module(s) in a format specpack cannot check",
                         problems=bad[:10], hint="supported per module: " + ", ".join(MIXED_ALGOS))
    return tuple(sorted(algos.items()))


def _mxfp4(qc: dict) -> Quant:
    return Quant("mxfp4", "mxfp4", group=32)


def _pair(value, key: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise InputError(f"quantization_config.{key} must be two positive integers", problems=[f"{key} = {value!r}"])
    return value[0], value[1]


# ---- checking one tensor --------------------------------------------------------------------------

def check(name: str, t: Tensor, found: dict, q: Quant | None) -> tuple[list[str], bool]:
    """(problems, quantized) for tensor `name` of logical form `t` against the checkpoint's header
    entries `found` (name -> TensorMeta)."""
    if not t.linear or q is None:
        return _plain(name, t, found), False
    layouts = _layouts(name, t, q)
    mixed = q.scheme == "modelopt-mixed"  # what quantized_layers lists is quantized, the rest is not
    if mixed and not layouts:
        return _unlisted(name, t, found), False
    if not mixed and _is_plain(name, t, found, layouts):
        return [], False
    problems = min((_layout_problems(layout, found) for layout in layouts), key=len)
    if problems and name not in found and not any(n in found for layout in layouts for n in layout):
        return [f"missing tensor {name} (expected {list(_stored(t))} unquantized, or {q.scheme})"], False
    return problems, not problems


def _plain(name: str, t: Tensor, found: dict) -> list[str]:
    if name not in found:
        return [f"missing tensor {name} (expected shape {list(_stored(t))})"]
    got = tuple(found[name].shape)
    return [] if got == _stored(t) else [f"tensor {name} has shape {list(got)}, expected {list(_stored(t))}"]


def _unlisted(name: str, t: Tensor, found: dict) -> list[str]:
    """A linear weight MIXED_PRECISION's quantized_layers does not list: a float tensor of its logical
    shape with no scale beside it."""
    module = _module(name)
    problems = _plain(name, t, found)
    if not problems and found[name].dtype not in FLOATS:
        problems = [f"tensor {name} is {found[name].dtype}"]
    problems += [f"tensor {module}.{s} is present" for s in ("weight_scale", "weight_scale_2", "input_scale")
                 if f"{module}.{s}" in found]
    return [f"{p}, but {module} is not in quantized_layers, so it must be stored unquantized" for p in problems]


def _stored(t: Tensor) -> tuple[int, ...]:
    """The shape an unquantized checkpoint stores (fused experts of gpt-oss / Llama 4: [..., in, out])."""
    return t.shape


def _is_plain(name: str, t: Tensor, found: dict, layouts: list) -> bool:
    """`name` stored unquantized: a float of its logical shape with none of the scheme's other
    tensors (`layouts`, its stored forms) beside it."""
    meta = found.get(name)
    if meta is None or meta.dtype not in FLOATS or tuple(meta.shape) != t.shape:
        return False
    return not any(n in found for layout in layouts for n in layout if n != name)


def _dims(t: Tensor) -> tuple[tuple[int, ...], int, int]:
    """(lead dims, out, in) of a linear tensor's logical shape."""
    *lead, a, b = t.shape
    return (tuple(lead), b, a) if t.stored_in_out else (tuple(lead), a, b)


def _module(name: str) -> str:
    """The module a linear tensor belongs to: `X.weight` -> X; a fused parameter names itself."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _mixed_algo(name: str, q: Quant) -> str | None:
    """The format quantized_layers states for `name`'s module (a fused expert parameter: its
    module's entries, as vLLM resolves a RoutedExperts prefix)."""
    module = _module(name)
    if module in q.layer_algos:
        return q.layer_algos[module]
    parent = module.rsplit(".", 1)[0] + "."
    return next((a for k, a in q.layers if k.startswith(parent)), None) if not name.endswith(".weight") else None


def _names(name: str) -> tuple[str, str]:
    """(stem, "weight") for `X.weight` (stem "X."), (name, "") for a fused parameter."""
    return (name[: -len("weight")], "weight") if name.endswith(".weight") else (name, "")


def _layouts(name: str, t: Tensor, q: Quant) -> list[dict[str, tuple[tuple, tuple]]]:
    """The stored forms `q` allows: {tensor name: (allowed dtypes, allowed shapes)} each."""
    lead, o, i = _dims(t)
    stem, w = _names(name)

    def n(suffix: str) -> str:
        """`X.weight` -> `X.<suffix>`; a fused parameter P -> `P_scale_inv` (transformers' FP8 experts)
        or `P_<suffix>` (ModelOpt's Llama 4 experts: `gate_up_proj_weight_scale`)."""
        if w:
            return stem + suffix
        return f"{name}_{'scale_inv' if suffix == 'weight_scale_inv' else suffix}"

    weight = name
    if q.scheme == "fp8-block" or (q.scheme == "ct-fp8" and q.strategy == "block"):
        b0, b1 = q.block
        scale = (*lead, math.ceil(o / b0), math.ceil(i / b1))
        suffix = "weight_scale_inv" if q.scheme == "fp8-block" else "weight_scale"
        return [{weight: (E4M3, ((*lead, o, i),)), n(suffix): (SCALES, (scale,))}]
    if q.scheme in ("fp8", "modelopt-fp8", "ct-fp8"):
        scales = {"channel": ((*lead, o, 1), (*lead, o)), "tensor": ((*lead, 1), (*lead,)) if lead else SCALAR}
        shapes = scales.get(q.strategy, SCALAR + (((*lead, 1),) if lead else ()))
        return [{weight: (E4M3, ((*lead, o, i),)), n("weight_scale"): (SCALES, tuple(shapes))}]
    if q.scheme in ("ct-nvfp4",):
        return [{n("weight_packed"): (("U8",), ((*lead, o, i // 2),)), n("weight_scale"): (E4M3, ((*lead, o, i // q.group),)),
                 n("weight_global_scale"): (("F32",), ((*lead, 1),) + (SCALAR if not lead else ()))}]
    if q.scheme in ("modelopt-nvfp4", "modelopt-mixed"):
        nvfp4 = {weight: (("U8",), ((*lead, o, i // 2),)), n("weight_scale"): (E4M3, ((*lead, o, i // q.group),)),
                 n("weight_scale_2"): (("F32",), SCALAR + (((*lead,), (*lead, 1)) if lead else ()))}
        fp8 = {weight: (E4M3, ((*lead, o, i),)), n("weight_scale"): (("F32",), SCALAR + (((*lead,),) if lead else ()))}
        if q.scheme == "modelopt-nvfp4":
            return [nvfp4]
        return {"NVFP4": [nvfp4], "W4A16_NVFP4": [nvfp4], "FP8": [fp8]}.get(_mixed_algo(name, q), [])
    if q.scheme == "ct-int4":
        return [{n("weight_packed"): (("I32",), ((*lead, o, i // 8),)), n("weight_scale"): (FLOATS, ((*lead, o, i // q.group),)),
                 n("weight_shape"): (("I32", "I64"), ((2,),))}]
    if q.scheme == "mxfp4":
        return [{name + "_blocks": (("U8",), ((*lead, o, i // 32, 16),)), name + "_scales": (("U8", "F8_E8M0"), ((*lead, o, i // 32),))}]
    raise AssertionError(q.scheme)


def _layout_problems(layout: dict, found: dict) -> list[str]:
    problems = []
    for n, (dtypes, shapes) in layout.items():
        meta = found.get(n)
        if meta is None:
            problems.append(f"missing tensor {n} (expected {dtypes[0]} {list(shapes[0])})")
        elif meta.dtype not in dtypes or tuple(meta.shape) not in shapes:
            problems.append(f"tensor {n} is {meta.dtype} {list(meta.shape)}, expected {' or '.join(dtypes)} "
                            f"{' or '.join(str(list(s)) for s in shapes)}")
    return problems
