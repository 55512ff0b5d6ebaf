"""Measured cost curves kept on this machine, so that `run` and `serve` measure an artifact's target once.

A curve (engine.cost.CostModel: step time per row count, cost per attended key) depends on the target's
weights, how they are loaded (backend, device, dtype, weight format, KV cache) and the machine (CPU model,
cores, torch threads, the kernels' source). All of that is the key; the file lives beside the kernels'
settings (`$SPECPACK_CACHE`, else ~/.cache/specpack) under `cost-curves/`. The engine keeps learning its
costs as it runs, so a stored curve is the starting point a fresh measurement would have been.
`SPECPACK_COST_CACHE=0` measures every time; a cache that cannot be written is said once and skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable

from specpack._version import __version__
from specpack.runtime.engine.cost import CostModel

log = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get("SPECPACK_COST_CACHE", "1").strip().lower() not in ("0", "off", "no", "false")


def store_dir() -> Path:
    from specpack.runtime.kernels import _lib

    return _lib._cache_root() / "cost-curves"


def machine() -> dict:
    import torch

    from specpack._machine import cpu_model
    from specpack.runtime.kernels import _lib

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "kernels": _lib.source_hash(), "specpack": __version__}


def path_for(identity: dict, rows: tuple[int, ...]) -> Path:
    key = json.dumps({**identity, "rows": list(rows), **machine()}, sort_keys=True)
    return store_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def recall(identity: dict | None, rows: tuple[int, ...], measure: Callable[[], CostModel]) -> CostModel:
    """The stored curve for `identity` (the artifact and how it was loaded) on this machine, else
    `measure()`d and stored. No identity (a model built in code) or the store off: measured."""
    if identity is None or not enabled():
        return measure()
    path = path_for(identity, rows)
    try:
        cost = CostModel.from_dict(json.loads(path.read_text()))
        if tuple(cost.rows) == rows and len(cost.ms) == len(rows) and all(map(_positive, cost.ms)) \
                and (cost.key_ms == 0 or _positive(cost.key_ms)):
            log.info("cost curve from %s (measured here before)", path)
            return cost
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cost = measure()
    _write(path, cost)
    return cost


def _positive(value) -> bool:
    """A stored time: a finite positive number (a file edited by hand or damaged is measured again)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def _write(path: Path, cost: CostModel) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cost.to_dict()))
        os.replace(tmp, path)  # atomic: a racing process writes its own whole file
    except OSError as exc:
        log.warning("cannot keep the measured cost curve in %s (%s): it is measured again next start", path, exc)
