"""Quantized checkpoints as they are published, checked tensor by tensor from safetensors headers.

A scheme says how a quantized linear weight of logical shape [*lead, out, in] is stored: which tensors
(the packed weight and its scales), their dtypes and shapes. Every linear weight of a family is checked
against either its unquantized form (a float tensor of the logical shape, no scale beside it: the
modules a release leaves out, e.g. routers, lm_head) or the scheme's form; every other tensor against
its logical shape. Nothing is skipped.

| scheme | detected from | a quantized linear X |
|---|---|---|
| `fp8-block` | quant_method fp8 + weight_block_size [b0, b1] | X.weight F8_E4M3 [o, i]; X.weight_scale_inv (or X.scale) [⌈o/b0⌉, ⌈i/b1⌉]; `scale_fmt: ue8m0`: the scales E8M0 (or U8); `expert_dtype: fp4`: each routed expert's X.weight I8 [o, i/2] (two e2m1 per byte), X.scale [o, ⌈i/32⌉] |
| `fp8` | quant_method fp8, no block size | X.weight F8_E4M3 [o, i]; X.weight_scale [] or [1]; X.input_scale (static) |
| `ct-fp8` | compressed-tensors, 8-bit float weights | X.weight F8_E4M3 [o, i]; X.weight_scale [1] / [o, 1] / blocks |
| `ct-nvfp4` | compressed-tensors, 4-bit float, group 16 | X.weight_packed U8 [o, i/2]; X.weight_scale F8_E4M3 [o, i/16]; X.weight_global_scale [1] |
| `ct-int4` | compressed-tensors, 4-bit int, group g | X.weight_packed I32 [o, i/8]; X.weight_scale [o, i/g]; X.weight_shape [2] |
| `modelopt-nvfp4` | quant_method modelopt (or hf_quant_config.json) NVFP4 / W4A16_NVFP4 | X.weight U8 [o, i/2]; X.weight_scale F8_E4M3 [o, i/16]; X.weight_scale_2 [] |
| `modelopt-fp8` | modelopt FP8 | X.weight F8_E4M3 [o, i]; X.weight_scale []; X.input_scale [] |
| `modelopt-mixed` | modelopt MIXED_PRECISION + `quantized_layers` {module: {quant_algo}} | each listed module as its NVFP4 / W4A16_NVFP4 / FP8 entry says; every other module unquantized |
| `mxfp4` | quant_method mxfp4 (gpt-oss) | X_blocks U8 [*lead, o, i/32, 16]; X_scales U8 [*lead, o, i/32] |
| `mxfp8` | quant_method mxfp8 (MiniMax), or modelopt MXFP8 | X.weight F8_E4M3 [o, i]; X.weight_scale (or X.weight_scale_inv) E8M0 (U8) [o, i/32] |
| `gguf` | quant_method gguf (`import-gguf`), `tensor_types` {tensor: GGML type} | each listed tensor (a linear weight or the embedding) U8 [o, i/QK x block bytes]: llama.cpp's blocks as they are (families/gguf_blocks.py); every other tensor float |

Every field of a quantization config is type-checked as it is read (an error names it); a scheme that
quantizes none of the checkpoint's linear weights, an F8 weight under a config that states no scheme,
and a compressed-tensors `ignore` entry's module stored quantized are refused; `re:` patterns are
compiled once and matched within a time budget.

DeepSeek-V4's form of fp8-block (transformers 5.25 quantizers/quantizer_finegrained_fp8.py :185-190:
"Some FP8 checkpoints ship per-block scales under `.scale` (e.g. DeepSeek-V4-Flash)", renamed to
`weight_scale_inv` on load; utils/quantization_config.py FineGrainedFP8Config `scale_fmt` float | ue8m0,
`expert_dtype` fp8 | fp4; integrations/finegrained_fp8.py `_alloc_expert_proj`: fp4 experts store int8
weights with K halved and one scale per row per 32 inputs; models/deepseek_v4/configuration :243-251:
a top-level `expert_dtype` joins the quantization config).

Sources (read, not guessed): vLLM layers/quantization/{fp8,modelopt,mxfp4}.py and compressed_tensors/
schemes, transformers integrations/{finegrained_fp8,mxfp4}.py, DeepSeek-V3 README_WEIGHTS.md. MXFP8:
vLLM modelopt.py `ModelOptMxFp8Config.from_config` reads MiniMax-style `quant_method: "mxfp8"` (with
`ignored_layers`) as ModelOpt MXFP8, whose linear holds `weight` E4M3 [n, k] and `weight_scale`
E8M0 [n, k/32] (MXFP8_BLOCK_SIZE 32). MiniMax-M3's MXFP8 releases and MiniMax-M3.1's dspark/ name
the U8 scales `weight_scale_inv` (the published index); engines' loaders rename
`.weight_scale_inv` to `.weight_scale` before matching parameters (vLLM minimax_m3, SGLang llama.py
`load_weights`), so both names are read.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import cached_property

import regex

from specpack.errors import InputError
from specpack.families.base import Tensor
from specpack.families.fields import OBJECT, SIZE, STR, STRS, field

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
    ignore: tuple[str, ...] = ()  # compressed-tensors: modules stored unquantized (names, or `re:` regexes)
    scale_fmt: str = "float"  # fp8-block: "ue8m0" for one-byte power-of-two scales (DeepSeek-V4)
    expert_dtype: str = "fp8"  # fp8-block: "fp4" for routed experts packed two e2m1 values per byte

    @cached_property
    def layer_algos(self) -> dict[str, str]:
        return dict(self.layers)

    @property
    def description(self) -> str:
        extra = f" {self.block[0]}x{self.block[1]} blocks" if self.block else f" groups of {self.group}" if self.group else ""
        extra += ", ue8m0 scales" if self.scale_fmt == "ue8m0" else ""
        extra += ", fp4 experts" if self.expert_dtype == "fp4" else ""
        return f"{self.scheme} ({self.quant_method}{extra})"


log = logging.getLogger(__name__)
W = "quantization_config."  # where a field of the quantization config is named in errors
MATCH_BUDGET_S = 2.0  # every `ignore` pattern against every module name, all together
MAX_PATTERN = 1000


def scheme(config: dict, hf_quant: dict | None = None) -> Quant | None:
    """The scheme config.json's `quantization_config` (or a ModelOpt `hf_quant_config.json`) states,
    None for an unquantized checkpoint; an InputError naming the field for one specpack cannot check
    (each field read is type-checked: fields.field)."""
    qc = stated_config(config, hf_quant)
    if qc is None:
        return None
    if config.get("expert_dtype") is not None and isinstance(qc, dict) and "expert_dtype" not in qc:
        qc = {**qc, "expert_dtype": config["expert_dtype"]}  # DeepSeek-V4 states it beside (transformers folds it in)
    method = field(qc, "quant_method", STR, W, "").lower()
    if not method and "quant_algo" in qc:
        raise InputError(f"quantization_config states quant_algo {qc['quant_algo']!r} but no quant_method: which "
                         "scheme's reader applies is not stated", hint="ModelOpt checkpoints state quant_method "
                         "\"modelopt\" (vLLM modelopt.py detects ModelOpt by it), or ship hf_quant_config.json; add it")
    reader = {"fp8": _fp8, "compressed-tensors": _compressed, "modelopt": _modelopt, "mxfp4": _mxfp4,
              "mxfp8": _mxfp8, "gguf": _gguf}.get(method)
    if reader is None:
        raise InputError(f"quantization_config.quant_method {method!r} is not a scheme specpack can check",
                         hint="supported: fp8 (block or per-tensor), compressed-tensors (FP8, NVFP4, INT4), "
                              "modelopt (NVFP4, FP8, MXFP8, MIXED_PRECISION), mxfp4, mxfp8, gguf; dequantize others to "
                              "bf16 first")
    return reader(qc)


def stated_config(config: dict, hf_quant: dict | None = None) -> dict | None:
    """The quantization config as the checkpoint states it: config.json's `quantization_config` (or
    its text_config's), else a ModelOpt hf_quant_config.json's `quantization` with quant_method
    modelopt (the form transformers writes into config.json); None for an unquantized checkpoint."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    qc = config.get("quantization_config") or text.get("quantization_config")
    if qc is None and hf_quant:
        qc = {"quant_method": "modelopt", **field(hf_quant, "quantization", OBJECT, "hf_quant_config.json ", {})}
    return qc


FP8_SCALE_FORMATS = ("float", "ue8m0")
EXPERT_DTYPES = ("fp8", "fp4")


def _fp8(qc: dict) -> Quant:
    block = qc.get("weight_block_size")
    scale_fmt = field(qc, "scale_fmt", STR, W, "float")
    experts = field(qc, "expert_dtype", STR, W, "fp8")
    bad = [f"scale_fmt = {scale_fmt!r}: not one of {', '.join(FP8_SCALE_FORMATS)}"] * (scale_fmt not in FP8_SCALE_FORMATS)
    bad += [f"expert_dtype = {experts!r}: not one of {', '.join(EXPERT_DTYPES)}"] * (experts not in EXPERT_DTYPES)
    bad += ["scale_fmt ue8m0 or expert_dtype fp4 without weight_block_size: only the block-scaled form states "
            "them"] * (block is None and (scale_fmt, experts) != ("float", "fp8"))
    if bad:
        raise InputError("quantization_config: an fp8 form specpack cannot check", problems=bad,
                         hint="transformers' FineGrainedFP8Config reads scale_fmt float | ue8m0, expert_dtype fp8 | fp4")
    if block is None:
        return Quant("fp8", "fp8")
    return Quant("fp8-block", "fp8", block=_pair(block, "weight_block_size"), scale_fmt=scale_fmt, expert_dtype=experts)


def _kv_cache_scheme(qc: dict) -> str | None:
    """compressed-tensors `kv_cache_scheme`: an FP8 cache ({num_bits: 8, type: float}) or none; anything
    else is refused rather than stated as fp8 (vLLM's compressed_tensors.py reads the same fields)."""
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return None
    if not isinstance(kv, dict) or (kv.get("num_bits"), kv.get("type")) != (8, "float"):
        raise InputError(f"quantization_config.kv_cache_scheme = {str(kv)[:80]}: not an FP8 cache scheme "
                         "({num_bits: 8, type: float}), the one KV cache compressed-tensors engines run",
                         hint="drop kv_cache_scheme for a bf16 cache")
    return "fp8"


def _compressed(qc: dict) -> Quant:
    groups = field(qc, "config_groups", OBJECT, W, {})
    stated = [_ct_group(groups, name) for name in groups]  # (where, weights, num_bits, type) each
    kinds = {(bits, kind) for _, _, bits, kind in stated}
    if len(kinds) != 1:
        raise InputError("compressed-tensors quantization_config must state one weight scheme in config_groups",
                         problems=[f"config_groups weights: {sorted(map(str, kinds))}"])
    where, w, bits, kind = stated[0]
    kv = _kv_cache_scheme(qc)
    ignore = tuple(field(qc, "ignore", STRS, W, []))
    _patterns(ignore, "ignore")
    if (bits, kind) == (8, "float"):
        strategy = field(w, "strategy", STR, where, "tensor")
        block = None
        if strategy == "block":
            if w.get("block_structure") is None:
                raise InputError(f"{where}strategy is 'block', but block_structure is missing",
                                 hint="a block-quantized FP8 config states block_structure [rows, cols]")
            block = _pair(w["block_structure"], "block_structure")
        return Quant("ct-fp8", "compressed-tensors", block=block, strategy=strategy, kv_cache=kv, ignore=ignore)
    if (bits, kind) == (4, "float"):
        return Quant("ct-nvfp4", "compressed-tensors", group=field(w, "group_size", SIZE, where, 16), kv_cache=kv,
                     ignore=ignore)
    if (bits, kind) == (4, "int"):
        return Quant("ct-int4", "compressed-tensors", group=field(w, "group_size", SIZE, where, 128), kv_cache=kv,
                     ignore=ignore)
    raise InputError(f"compressed-tensors weights of {bits} bits, type {kind!r}, are not a "
                     "scheme specpack can check", hint="supported: 8-bit float, 4-bit float (NVFP4), 4-bit int")


def _ct_group(groups: dict, name: str) -> tuple[str, dict, int, str]:
    """One compressed-tensors config group: (where its weights are named, its weights, num_bits, type)."""
    where = f"{W}config_groups.{name}."
    group = field(groups, name, OBJECT, W + "config_groups.")
    _patterns(field(group, "targets", STRS, where, []), f"config_groups.{name}.targets")
    w = field(group, "weights", OBJECT, where, {})
    where += "weights."
    return where, w, field(w, "num_bits", SIZE, where), field(w, "type", STR, where)


def _modelopt(qc: dict) -> Quant:
    algo = field(qc, "quant_algo", STR, W, "").upper()
    kv = field(qc, "kv_cache_quant_algo", STR, W, "").lower() or None
    field(qc, "exclude_modules", STRS, W)
    group = field(qc, "group_size", SIZE, W, 16)
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return Quant("modelopt-nvfp4", "modelopt", group=group, kv_cache=kv)
    if algo == "FP8":
        return Quant("modelopt-fp8", "modelopt", kv_cache=kv)
    if algo == "MXFP8":
        return Quant("mxfp8", "modelopt", block=MX_BLOCK, kv_cache=kv)
    if algo == "MIXED_PRECISION":
        return Quant("modelopt-mixed", "modelopt", group=group, kv_cache=kv,
                     layers=_mixed_layers(qc.get("quantized_layers")))
    raise InputError(f"ModelOpt quant_algo {algo!r} is not a scheme specpack can check",
                     hint="supported: NVFP4, W4A16_NVFP4, FP8, MXFP8, MIXED_PRECISION")


MIXED_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8")


def _mixed_layers(layers) -> tuple[tuple[str, str], ...]:
    """ModelOpt MIXED_PRECISION's `quantized_layers` (vLLM modelopt.py ModelOptMixedPrecisionConfig:
    module name -> {quant_algo, group_size}): required, and every algorithm one specpack checks."""
    if not isinstance(layers, dict) or not layers:
        raise InputError("ModelOpt MIXED_PRECISION states no quantized_layers: which module holds which format is "
                         "unknown", hint="re-export with ModelOpt, whose export writes quantized_layers "
                         "(vLLM refuses the checkpoint without it too)")
    algos = {k: field(v, "quant_algo", STR, f"{W}quantized_layers.{k}.", "").upper() for k, v in layers.items()}
    bad = [f"{k}: quant_algo {layers[k].get('quant_algo')!r}" for k, a in algos.items() if a not in MIXED_ALGOS]
    if bad:
        raise InputError(f"ModelOpt MIXED_PRECISION lists {len(bad)} module(s) in a format specpack cannot check",
                         problems=bad[:10], hint="supported per module: " + ", ".join(MIXED_ALGOS))
    return tuple(sorted(algos.items()))


def _patterns(entries, what: str) -> list:
    """compressed-tensors module patterns: `re:` entries compiled (once; each refused if it does not
    compile), the rest exact names or class names such as `Linear`."""
    compiled, bad = [], []
    for entry in entries:
        if not entry.startswith("re:"):
            continue
        try:
            if len(entry) > MAX_PATTERN:
                raise regex.error(f"longer than {MAX_PATTERN} characters")
            compiled.append((entry, regex.compile(entry[3:])))
        except (regex.error, ValueError, OverflowError, RecursionError) as exc:
            bad.append(f"{W}{what}: {entry[:120]!r} does not compile: {exc}")
    if bad:
        raise InputError("quantization_config holds module patterns that are not regular expressions", problems=bad,
                         hint="compressed-tensors reads `re:` entries as Python regular expressions")
    return compiled


def ignored(q: Quant | None, modules: set[str]) -> dict[str, str]:
    """{module: the `ignore` entry naming it} for each of `modules` (the checkpoint's) that a
    compressed-tensors config leaves unquantized, `re:` entries matched as compressed-tensors does
    (re.match). All matching shares one time budget: a pattern that backtracks catastrophically is
    refused, not waited for. An entry that names no module is merely unusual: logged."""
    if q is None or not q.ignore:
        return {}
    names, regexes = set(q.ignore), _patterns(q.ignore, "ignore")
    budget = MATCH_BUDGET_S + 2e-5 * len(modules) * len(regexes)
    deadline, out = time.monotonic() + budget, {}
    for module in sorted(modules):
        if module in names:
            out[module] = module
            continue
        for entry, pattern in regexes:
            try:
                hit = pattern.match(module, timeout=max(1e-3, deadline - time.monotonic()))
            except TimeoutError:
                raise InputError(f"{W}ignore {entry[:120]!r} takes more than {budget:.0f} s to match the "
                                 f"checkpoint's {len(modules):,} module names", hint="write the pattern without "
                                 "nested repetition (such as (a|aa)+), which backtracks exponentially") from None
            if hit:
                out[module] = entry
                break
    unused = sorted(set(q.ignore) - set(out.values()))
    if unused:
        log.warning("quantization_config.ignore entries that name no module of the checkpoint: %s", ", ".join(unused))
    return out


def _gguf(qc: dict) -> Quant:
    """`import-gguf`'s blocks: `tensor_types` names every tensor kept quantized and its GGML type."""
    from specpack.families.gguf_blocks import TYPES

    types = field(qc, "tensor_types", OBJECT, W, None)
    if not types:
        raise InputError("quantization_config.tensor_types (tensor name -> GGML type) is missing or empty",
                         hint="import-gguf writes it; import the GGUF file again")
    bad = [f"{n}: {t!r}" for n, t in types.items() if not isinstance(n, str) or t not in TYPES]
    if bad:
        raise InputError("quantization_config.tensor_types states types specpack does not read", problems=bad[:20],
                         hint=f"types kept quantized: {', '.join(TYPES)}")
    return Quant("gguf", "gguf", layers=tuple(sorted(types.items())))


def _mxfp4(qc: dict) -> Quant:
    return Quant("mxfp4", "mxfp4", group=32)


MX_BLOCK = (1, 32)  # an MX scale covers 32 consecutive inputs of one row (vLLM MXFP8_BLOCK_SIZE)


def _mxfp8(qc: dict) -> Quant:
    """MiniMax-style MXFP8: `weight_block_size`, where stated, must be the MX block [1, 32]."""
    block = qc.get("weight_block_size")
    if block is not None and _pair(block, "weight_block_size") != MX_BLOCK:
        raise InputError("quantization_config.weight_block_size of an mxfp8 checkpoint must be [1, 32] (one E8M0 "
                         "scale per 32 inputs of a row)", problems=[f"weight_block_size = {block!r}"])
    field(qc, "ignored_layers", STRS, W)
    return Quant("mxfp8", "mxfp8", block=MX_BLOCK, kv_cache=field(qc, "kv_cache_quant_algo", STR, W, "").lower() or None)


def _pair(value, key: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise InputError(f"quantization_config.{key} must be two positive integers", problems=[f"{key} = {value!r}"])
    return value[0], value[1]


# ---- checking one tensor --------------------------------------------------------------------------

def check_all(expected: dict, found: dict, q: Quant | None) -> tuple[list[str], dict[bool, int]]:
    """Every tensor of `expected` (name -> Tensor) against `found` (name -> header entry): (problems,
    {True: linear weights stored quantized, False: stored unquantized})."""
    problems, counts = [], {True: 0, False: 0}
    by = ignored(q, {module_of(n) for n in found})
    for name, t in expected.items():
        bad, quantized = check(name, t, found, q, by.get(module_of(name)))
        problems += bad
        if t.linear and not bad:
            counts[quantized] += 1
    return problems, counts


def scale_format_problems(q: Quant | None, found: dict) -> list[str]:
    """fp8-block scales stored E8M0 / U8 under a config that states no `scale_fmt: ue8m0` (DeepSeek-V4's
    form with the key removed): engines would read them as float scales."""
    if q is None or q.scheme != "fp8-block" or q.scale_fmt == "ue8m0":
        return []
    one_byte = sorted(n for n, m in found.items() if n.endswith((".weight_scale_inv", ".scale"))
                      and m.dtype in ("F8_E8M0", "U8"))
    return [f"quantization_config states no scale_fmt (float scales), but {len(one_byte)} scales are one-byte "
            f"E8M0 (e.g. {one_byte[0]}): restore scale_fmt: ue8m0"] if one_byte else []


def none_quantized(q: Quant | None, counts: dict[bool, int]) -> list[str]:
    """A scheme under which none of the checkpoint's linear weights is stored quantized."""
    if q is None or counts[True]:
        return []
    return [f"quantization_config states {q.description}, but none of the {counts[False]} linear weights is "
            "stored quantized (is this the unquantized checkpoint under a quantized model's config?)"]


# a static activation scale beside a quantized weight (a scalar; vLLM fp8.py / modelopt.py `input_scale`,
# compressed-tensors NVFP4 `input_global_scale`)
ACTIVATION_SCALE = {"fp8": "input_scale", "modelopt-fp8": "input_scale", "ct-fp8": "input_scale",
                    "modelopt-nvfp4": "input_scale", "modelopt-mixed": "input_scale", "ct-nvfp4": "input_global_scale"}


def stored_names(name: str, t: Tensor, q: Quant | None) -> set[str]:
    """Every tensor name the linear weight `name` may be stored as under `q`: the weight, its scales
    and a static activation scale."""
    if t.row_block:
        return {name, _row_scale(name)}
    if q is None or not t.linear or q.scheme == "gguf":
        return {name}
    names = {name, *(n for layout in _layouts(name, t, q) for n in layout)}
    if q.scheme in ACTIVATION_SCALE and name.endswith(".weight"):
        names.add(f"{module_of(name)}.{ACTIVATION_SCALE[q.scheme]}")
    return names


def check(name: str, t: Tensor, found: dict, q: Quant | None, ignored_by: str | None = None
          ) -> tuple[list[str], bool]:
    """(problems, quantized) for tensor `name` of logical form `t` against the checkpoint's header
    entries `found` (name -> TensorMeta); `ignored_by`: the compressed-tensors `ignore` entry that
    leaves its module unquantized."""
    if t.integer:
        return _plain(name, t, found) or _int_problems(name, found), False
    if q is not None and q.scheme == "gguf":
        return _gguf_problems(name, t, found, q)
    if t.row_block:
        return _plain(name, t, found) or _row_scaled_problems(name, t, found), False
    if not t.linear or q is None:
        return _plain(name, t, found) or _float_problems(name, found, q), False
    if ignored_by is not None:
        problems = _plain(name, t, found) or _float_problems(name, found, q)
        return [f"{p}, but quantization_config.ignore {ignored_by!r} leaves {module_of(name)} unquantized"
                for p in problems], False
    layouts = _layouts(name, t, q)
    mixed = q.scheme == "modelopt-mixed"  # what quantized_layers lists is quantized, the rest is not
    if mixed and not layouts:
        return _unlisted(name, t, found), False
    if not mixed and _is_plain(name, t, found, layouts):
        return [], False
    # the stored form closest to what the checkpoint holds (of equals, the one whose tensors it names)
    problems = min((_layout_problems(layout, found) for layout in layouts),
                   key=lambda ps: (len(ps), sum(p.startswith("missing") for p in ps)))
    if problems and name not in found and not any(n in found for layout in layouts for n in layout):
        return [f"missing tensor {name} (expected {list(_stored(t))} unquantized, or {q.scheme})"], False
    return problems or _activation_problems(name, found, q), not problems


def _gguf_problems(name: str, t: Tensor, found: dict, q: Quant) -> tuple[list[str], bool]:
    """A tensor `tensor_types` lists: U8 [rows, row bytes] of its type's blocks; any other: float, as stored."""
    from specpack.families.gguf_blocks import row_bytes, shape_problems

    kind = q.layer_algos.get(name)
    if kind is None:
        return _plain(name, t, found) or _float_problems(name, found, q), False
    meta = found.get(name)
    rows = math.prod(t.shape[:-1])
    want = [rows, row_bytes(kind, t.shape[-1])]
    if meta is None:
        return [f"missing tensor {name} (expected {kind} blocks, U8 {want})"], False
    problems = shape_problems(name, kind, t.shape, math.prod(meta.shape) if meta.dtype == "U8" else -1)
    if meta.dtype != "U8" or list(meta.shape) != want:
        problems = problems or [f"tensor {name} is {meta.dtype} {list(meta.shape)}, expected {kind} blocks U8 {want}"]
    return problems, t.linear and not problems


def _activation_problems(name: str, found: dict, q: Quant) -> list[str]:
    """A static activation scale beside a quantized weight: one float number."""
    act = f"{module_of(name)}.{ACTIVATION_SCALE.get(q.scheme, '')}"
    meta = found.get(act) if q.scheme in ACTIVATION_SCALE and name.endswith(".weight") else None
    if meta is None or (meta.dtype in FLOATS and tuple(meta.shape) in SCALAR):
        return []
    return [f"tensor {act} is {meta.dtype} {list(meta.shape)}, expected one float (F32 [] or [1])"]


def _plain(name: str, t: Tensor, found: dict) -> list[str]:
    if name not in found:
        return [f"missing tensor {name} (expected shape {list(_stored(t))})"]
    got = tuple(found[name].shape)
    return [] if got == _stored(t) else [f"tensor {name} has shape {list(got)}, expected {list(_stored(t))}"]


def _float_problems(name: str, found: dict, q: Quant | None) -> list[str]:
    """A tensor stored unquantized must be a float one (an F8 weight under a config that states no
    quantization is a quantized checkpoint whose quantization_config was removed)."""
    dtype = found[name].dtype
    if dtype in FLOATS:
        return []
    if q is None:
        return [f"tensor {name} is {dtype}: stored quantized, but config.json states no quantization_config "
                "(was it removed?)"]
    return [f"tensor {name} is {dtype}, expected {' or '.join(FLOATS)}"]


def _int_problems(name: str, found: dict) -> list[str]:
    """A table of ids (DeepSeek-V4's hash router `tid2eid`) is stored as integers."""
    dtype = found[name].dtype
    return [] if dtype in ("I64", "I32") else [f"tensor {name} is {dtype}, expected an integer table (I64 or I32)"]


def _row_scale(name: str) -> str:
    return name.removesuffix("weight") + "scale"


def _row_scaled_problems(name: str, t: Tensor, found: dict) -> list[str]:
    """A lookup table stored as floats, or F8_E4M3 with `X.scale` [rows, cols / row_block] beside it
    (E8M0 / U8 exponents, or floats)."""
    dtype, scale = found[name].dtype, found.get(_row_scale(name))
    if dtype in FLOATS:
        return []
    if dtype not in E4M3:
        return [f"tensor {name} is {dtype}, expected F8_E4M3 (with its scale) or {' or '.join(FLOATS)}"]
    rows, cols = t.shape
    shape = [rows, math.ceil(cols / t.row_block)]
    if scale is None:
        return [f"missing tensor {_row_scale(name)} (expected F8_E8M0 {shape}: {name} is F8_E4M3)"]
    if scale.dtype not in ("F8_E8M0", "U8", *FLOATS) or list(scale.shape) != shape:
        return [f"tensor {_row_scale(name)} is {scale.dtype} {list(scale.shape)}, expected F8_E8M0 {shape}"]
    return []


def _unlisted(name: str, t: Tensor, found: dict) -> list[str]:
    """A linear weight MIXED_PRECISION's quantized_layers does not list: a float tensor of its logical
    shape with no scale beside it."""
    module = module_of(name)
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


def module_of(name: str) -> str:
    """The module a linear tensor belongs to: `X.weight` -> X; a fused parameter names itself."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _mixed_algo(name: str, q: Quant) -> str | None:
    """The format quantized_layers states for `name`'s module (a fused expert parameter: its
    module's entries, as vLLM resolves a RoutedExperts prefix)."""
    module = module_of(name)
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
    if q.scheme == "fp8-block":
        scales = ("F8_E8M0", "U8") if q.scale_fmt == "ue8m0" else SCALES
        if q.expert_dtype == "fp4" and w and _ROUTED.search(name):
            scale = (*lead, o, math.ceil(i / FP4_GROUP))
            return [{weight: (("I8",), ((*lead, o, i // 2),)), n(s): (scales, (scale,))} for s in FP8_SCALE_NAMES]
        scale = (*lead, math.ceil(o / q.block[0]), math.ceil(i / q.block[1]))
        return [{weight: (E4M3, ((*lead, o, i),)), n(s): (scales, (scale,))} for s in FP8_SCALE_NAMES]
    if q.scheme == "ct-fp8" and q.strategy == "block":
        b0, b1 = q.block
        scale = (*lead, math.ceil(o / b0), math.ceil(i / b1))
        return [{weight: (E4M3, ((*lead, o, i),)), n("weight_scale"): (SCALES, (scale,))}]
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
    if q.scheme == "mxfp8":
        scale = (*lead, o, math.ceil(i / MX_BLOCK[1]))
        return [{weight: (E4M3, ((*lead, o, i),)), n(s): (("F8_E8M0", "U8"), (scale,))} for s in MX_SCALE_NAMES]
    if q.scheme == "mxfp4":
        return [{name + "_blocks": (("U8",), ((*lead, o, i // 32, 16),)), name + "_scales": (("U8", "F8_E8M0"), ((*lead, o, i // 32),))}]
    raise AssertionError(q.scheme)


FP8_SCALE_NAMES = ("weight_scale_inv", "scale")  # transformers renames `.scale` to `weight_scale_inv` on load
MX_SCALE_NAMES = ("weight_scale", "weight_scale_inv")  # MiniMax's releases write the second
FP4_GROUP = 32  # an fp4 expert's scale covers 32 inputs of one row (transformers `sf_gran_k=32`)
_ROUTED = regex.compile(r"\.experts\.\d+\.")  # a routed expert's MLP (not the shared experts)


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
