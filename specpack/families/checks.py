"""Checking a checkpoint's tensors against what its config says, in time and memory bounded by the
checkpoint's own tensor list, and reading a model directory's configs."""

from __future__ import annotations

import re
from typing import Callable, Iterable

from specpack.errors import InputError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def shape_problems(found: dict[str, tuple], expected: dict[str, tuple]) -> list[str]:
    """Every expected tensor that is missing from `found` or has another shape there."""
    problems = [f"missing tensor {name} (expected shape {list(shape)})"
                for name, shape in expected.items() if name not in found]
    return problems + [f"tensor {name} has shape {list(found[name])}, expected {list(shape)}"
                       for name, shape in expected.items()
                       if name in found and tuple(found[name]) != tuple(shape)]


def count_problems(names: Iterable[str], num_layers: int, num_experts: int = 0) -> list[str]:
    """Decoder layers and experts a config claims but the checkpoint does not hold (fewer distinct
    `layers.{i}.` / `experts.{e}.` indices in its tensor names)."""
    names = list(names)
    problems = []
    for what, pattern, claimed in (("decoder layers", _LAYER, num_layers), ("experts", _EXPERT, num_experts)):
        held = len({m[1] for n in names if (m := pattern.search(n))})
        if claimed > held:
            problems.append(f"the config claims {claimed} {what}, but the weights hold {held}")
    return problems


def checked_tensor_shapes(spec, found: dict[str, tuple], shapes_of: Callable, what: str) -> dict[str, tuple]:
    """`shapes_of(spec)` (every tensor `spec` needs), once `found` (a checkpoint's header shapes) is
    seen to hold them all. The layer and expert counts are compared first, so a config that claims
    10^6 layers costs no more than the checkpoint's own tensor list. Raises one InputError."""
    problems = count_problems(found, spec.num_layers, getattr(spec, "experts_held", 0))
    expected = {} if problems else shapes_of(spec)
    problems = problems or shape_problems(found, expected)
    if problems:
        raise InputError(f"{what} does not match its config ({len(problems)} problems)", problems=problems,
                         hint="the checkpoint and config.json must come from the same model")
    return expected


def read_config(model_dir) -> tuple[dict, dict | None]:
    """(config.json, generation_config.json or None) of a model directory, as dicts."""
    import json
    from pathlib import Path

    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise InputError(f"no config.json in {model_dir}", hint="point at a Hugging Face model directory")
    gen_path = model_dir / "generation_config.json"
    try:
        cfg = json.loads(path.read_text())
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"cannot parse JSON in {model_dir}: {str(e)[:200]}") from None
    if not isinstance(cfg, dict) or not isinstance(gen, (dict, type(None))):
        raise InputError(f"config.json or generation_config.json in {model_dir} is not a JSON object")
    return cfg, gen
