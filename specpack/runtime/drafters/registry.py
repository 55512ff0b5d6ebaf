"""The drafters, one module per kind, and their registry (see base.py for what each implements)."""

from __future__ import annotations

from specpack.errors import UnsupportedError
from specpack.runtime.drafters.block import load_block
from specpack.runtime.drafters.draft_model import load_draft_model
from specpack.runtime.drafters.eagle3 import load_eagle3
from specpack.runtime.drafters.mtp import load_mtp
from specpack.runtime.drafters.ngram import load_ngram

# kind -> loader(params: dict | None, drafter_dir: path | None, target) -> drafter module
DRAFTERS = {"eagle3": load_eagle3, "ngram": load_ngram, "mtp": load_mtp, "draft_model": load_draft_model,
            "block": load_block}
# kinds whose loader packs linear layers as it reads them, given `weights=` (a whole model: the file and the
# packed copy would otherwise both be resident until use_cpu_kernels packs it; the heads are a layer or a few)
PACKED_AT_LOAD = {"draft_model"}


def load_drafter(kind: str, params: dict | None, drafter_dir, target, weights: str | None = None):
    """The drafter of `kind` for `target`, from a canonical drafter dir (None for n-gram defaults); `weights`, the
    format its linear layers are packed in as they are read, where its loader does that (PACKED_AT_LOAD)."""
    if kind not in DRAFTERS:
        raise UnsupportedError(f"drafter kind {kind!r} is not supported by the torch runtime",
                               hint="supported: " + ", ".join(DRAFTERS))
    if kind in PACKED_AT_LOAD and weights is not None:
        return DRAFTERS[kind](params, drafter_dir, target, weights=weights)
    return DRAFTERS[kind](params, drafter_dir, target)
