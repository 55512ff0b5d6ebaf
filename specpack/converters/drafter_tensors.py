"""A drafter's tensors against the canonical names and shapes its converter expects, float or
quantized: what block drafters and EAGLE-3 heads share.

A drafter's quantization is read from its config.json (or a ModelOpt hf_quant_config.json beside it)
exactly as a target's is (families/quant.py); each linear weight is then its unquantized form or the
scheme's (the packed weight, its scales, a static activation scale), and every other tensor is float:
an 8-bit tensor no scheme gives it is refused, as is a tensor that is neither a canonical one nor one
of a quantized weight's scales. Quantized tensors are carried bit for bit under canonical names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specpack.converters.safetensors_header import TensorMeta, st_dtype
from specpack.converters.target_hf import HF_QUANT, read_json
from specpack.errors import InputError, UnsupportedError
from specpack.families import quant
from specpack.families.base import Tensor

FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Checked:
    problems: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {True: 0, False: 0})  # linear weights: quantized? -> count
    held: dict = field(default_factory=dict)  # canonical name -> (logical shape, names it is stored as)


def hf_quant(path: Path) -> dict | None:
    """A ModelOpt hf_quant_config.json beside the drafter's config, if there is one."""
    return read_json(path / HF_QUANT, "ModelOpt quantization config") if (path / HF_QUANT).is_file() else None


def scheme(path: Path, config: dict) -> tuple[quant.Quant | None, dict | None, list[str]]:
    """(the drafter's scheme or None, its quantization config as it states it (kept in the canonical
    config, for engines), problems: one for a scheme specpack cannot check)."""
    hf = hf_quant(path)
    try:
        return quant.scheme(config, hf), quant.stated_config(config, hf), []
    except (InputError, UnsupportedError) as exc:
        return None, None, [exc.message, *exc.problems]


def check(expected: dict, tensors: dict, q: quant.Quant | None, linear: Callable[[str], bool],
          optional=(), integer=(), source_name: Callable[[str], str] = str) -> Checked:
    """Every tensor of `expected` (canonical name -> shape, None where only presence is checked)
    in `tensors` (canonical names; a quantized weight's scales beside it), all problems at once.
    `linear`: the names a scheme may quantize; `optional` may be absent; `integer` are int / bool
    tables, never float."""
    found = {n: TensorMeta(st_dtype(t), tuple(t.shape), 0, 0) for n, t in tensors.items()}
    linears = {n: Tensor(tuple(s), linear=True) for n, s in expected.items() if q and s is not None and linear(n)}
    stored = {n: quant.stored_names(n, linears[n], q) if n in linears else {n} for n in expected}
    by = quant.ignored(q, {quant.module_of(n) for n in found})
    out = Checked()
    for name, shape in expected.items():
        if not stored[name] & found.keys():
            if name not in optional:
                out.problems.append(f"missing tensor '{source_name(name)}'" +
                                    (f" (expected shape {list(shape)})" if shape else ""))
            continue
        out.held[name] = (tuple(shape) if shape else None, stored[name] & found.keys())
        if name in linears:
            bad, quantized = quant.check(name, linears[name], found, q, by.get(quant.module_of(name)))
            out.problems += bad
            out.counts[quantized] += not bad
        elif shape is not None and found[name].shape != tuple(shape):
            out.problems.append(f"{source_name(name)}: shape {list(found[name].shape)}, expected {list(shape)}")
        elif name not in integer and found[name].dtype not in quant.FLOATS:
            out.problems.append(f"tensor '{source_name(name)}' is {found[name].dtype}: " + (
                f"{q.description} leaves it unquantized, so it must be float" if q else
                "stored quantized, but the drafter's config states no quantization_config (was it removed?)"))
    claimed = set().union(*stored.values())
    out.problems += [f"tensor '{source_name(n)}' maps to no canonical name of this drafter (an unused head would "
                     "be dropped silently by engines that skip unknown tensors)" for n in sorted(tensors)
                     if n not in claimed]
    modules = {quant.module_of(n) for n in linears}
    out.problems += [f"quantization_config.quantized_layers names {k}, a module the drafter does not have"
                     for k, _ in (q.layers if q else ()) if k not in modules]
    if not out.problems:
        out.problems = quant.none_quantized(q, out.counts)
    return out


def float_dtype(tensors: dict, names) -> str:
    """The drafter's float dtype, by bytes over `names` (its canonical tensors: scales are not among
    them, and an 8-bit float is a quantized weight, not its dtype)."""
    counts: dict[str, int] = {}
    for n in names:
        t = tensors.get(n)
        if t is not None and t.is_floating_point() and t.element_size() > 1:
            key = str(t.dtype).removeprefix("torch.")
            counts[key] = counts.get(key, 0) + t.numel() * t.element_size()
    return max(counts, key=counts.get) if counts else "unknown"


def parameters(held: dict, tensors: dict, skip=()) -> int:
    """Weights in logical count: a packed quantized weight as its unpacked shape; scales, `skip` and
    tables the drafter no longer stores (shared with the target) not at all."""
    return sum(math.prod(shape) if shape else tensors[n].numel() for n, (shape, names) in held.items()
               if n not in skip and names & tensors.keys() and (shape or n in tensors))
