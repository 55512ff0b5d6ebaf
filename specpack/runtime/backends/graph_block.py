"""A block drafter (DFlash, DSpark, LiLiCorr) over its exported graphs (converters/onnx_export/block.py),
for the graph backends, as `GraphEagle3` is the EAGLE-3 head over its graph.

`GraphBlock` drafts exactly as `BlockDrafter`: `draft` and each algorithm's `_draft_*` are the torch
drafter's own functions, and so are the heads they run on the host (DSpark's Markov correction and
confidence head, LiLiCorr's correlator: fp32 modules loaded from the artifact's drafter weights).
Only the two forwards differ: `_absorb` runs the context graph once per sequence with newly
committed positions, its new keys and values written straight into that sequence's slot cache, and
`_block` runs the step graph once per sequence over its cache. Subclasses implement `_run_context`
and `_run_step` (one graph call each).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from specpack.errors import InputError
from specpack.runtime.backends import SlotCache, new_slot_names, run_chunks
from specpack.runtime.drafters.block import BlockDrafter, BlockOut
from specpack.runtime.drafters.block_heads import ConfidenceHead, LiLiCorrHead, MarkovHead
from specpack.runtime.drafters.block_spec import BlockSpec

_DTYPES = {"float32": torch.float32, "int64": torch.int64}
HEAD_PREFIXES = ("markov_head.", "confidence_head.", "lilicorr.")  # the heads that run on the host


class GraphBlock:
    """The block drafter as two exported graphs (see the module docstring)."""

    kind = "block"
    draft, start, reset, propose = BlockDrafter.draft, BlockDrafter.start, BlockDrafter.reset, BlockDrafter.propose
    _fresh, _logit_rows, _scaled, _choose = (BlockDrafter._fresh, BlockDrafter._logit_rows, BlockDrafter._scaled,
                                             BlockDrafter._choose)
    _draft_dflash, _draft_dspark, _draft_lilicorr = (BlockDrafter._draft_dflash, BlockDrafter._draft_dspark,
                                                     BlockDrafter._draft_lilicorr)
    max_tokens_per_call: int | None = None  # context rows per graph call (None: all at once)

    def __init__(self, spec: BlockSpec, heads: dict[str, Tensor], context_graph, step_graph, device: torch.device,
                 dtype: torch.dtype):
        self.spec, self.device, self.dtype = spec, device, dtype  # dtype: the cache's
        self.capture_layers = spec.target_layer_ids
        self.context_graph, self.step_graph = context_graph, step_graph
        self.new_names = new_slot_names(context_graph)
        self.step_names = [i.name for i in step_graph.inputs]
        d2t = heads.get("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.draft_to_target = (torch.arange(spec.draft_vocab_size) + d2t).to(device)
        self.markov_head, self.confidence_head, self.lilicorr = host_heads(spec, heads, device)
        self.caches: list[SlotCache] = []
        self.lengths: list[int] = []  # committed context positions per slot
        self.anchor_ctx = torch.zeros(0, spec.hidden_size, device=device)

    def reserve(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of `max_len` positions; empties every slot."""
        if not self.caches or self.caches[0].max_len < max_len or len(self.caches) < slots:
            self.caches = []
            self.caches = [SlotCache.for_graph(self.step_graph, max_len, self.dtype, self.device) for _ in range(slots)]
            self.anchor_ctx = torch.zeros(slots, self.spec.hidden_size, device=self.device)
        self.lengths = [0] * len(self.caches)

    def _absorb(self, jobs) -> None:
        """As `BlockDrafter._absorb`: each job's new context rows into its slot, its last row kept."""
        for j, r in self._fresh(jobs):
            cache, start = self.caches[j.slot], self.lengths[j.slot]
            if start + r > cache.max_len:
                raise InputError(f"{start + r} positions do not fit the drafter's cache of {cache.max_len}",
                                 hint="reserve a larger max_len")
            cache.length = start
            feats = j.feats.to(self.device, torch.float32)
            pos = torch.arange(start, start + r, device=self.device)
            ctx = run_chunks(cache, r, self.max_tokens_per_call,
                             lambda a, b: self._run_context(cache, feats[a:b], pos[a:b]))
            self.anchor_ctx[j.slot] = ctx[-1][-1]
            self.lengths[j.slot] = cache.length

    def _block(self, jobs) -> BlockOut:
        """As `BlockDrafter._block`, one step-graph call per job on its slot's cache."""
        s, dev = self.spec, self.device
        a, B = s.first_prediction, s.block_len
        rows = torch.arange(a, a + self._logit_rows(jobs), device=dev)
        outs = []
        for j in jobs:
            cache = self.caches[j.slot]
            cache.length = self.lengths[j.slot]
            tokens = torch.full((B,), s.mask_token_id, dtype=torch.long, device=dev)
            tokens[0] = j.context[-1]
            positions = torch.arange(cache.length, cache.length + B, device=dev)
            outs.append(self._run_step(cache, tokens, positions, rows))
        hidden = torch.stack([o["hidden"][a : a + s.draft_slots] for o in outs])  # [J, N, H]
        if s.lilicorr is None:
            return BlockOut(hidden, torch.stack([o["logits"] for o in outs]))
        return BlockOut(hidden, None, *(torch.stack([o[n] for o in outs]) for n in
                                        ("candidates", "candidate_log_probs", "candidate_embeds")))

    def _step_outputs(self, K: int) -> dict[str, Tensor]:
        """Fresh buffers for the step graph's outputs, K logits rows."""
        return {o.name: torch.empty([K if d == "K" else d for d in o.shape], dtype=_DTYPES[o.dtype],
                                    device=self.device) for o in self.step_graph.outputs}

    def _run_context(self, cache: SlotCache, feats: Tensor, positions: Tensor) -> Tensor:
        """One context-graph call over T rows: writes `cache.new(T)`, returns context [T, H] fp32."""
        raise NotImplementedError

    def _run_step(self, cache: SlotCache, tokens: Tensor, positions: Tensor, rows: Tensor) -> dict[str, Tensor]:
        """One step-graph call reading `cache.past()`: `_step_outputs(len(rows))` filled."""
        raise NotImplementedError


def host_heads(spec: BlockSpec, heads: dict[str, Tensor], device) -> tuple:
    """(MarkovHead, ConfidenceHead, LiLiCorrHead), each None when the drafter has none, fp32 on `device`."""
    from specpack.runtime.models.weights import assign_weights

    made = []
    for prefix, cls, present in (("markov_head.", MarkovHead, spec.markov is not None),
                                 ("confidence_head.", ConfidenceHead, spec.confidence_with_markov is not None),
                                 ("lilicorr.", LiLiCorrHead, spec.lilicorr is not None)):
        if not present:
            made.append(None)
            continue
        with torch.device("meta"):
            head = cls(spec)
        state = {k.removeprefix(prefix): v for k, v in heads.items() if k.startswith(prefix)}
        made.append(assign_weights(head, state, device, torch.float32))
    return tuple(made)


def block_files(drafter_dir) -> tuple[BlockSpec, dict[str, Tensor]]:
    """(BlockSpec, the host heads' tensors and d2t) of a canonical block drafter dir (an artifact's
    `drafter/`), without reading the backbone's weights (the graphs hold them)."""
    from specpack.runtime.drafters.block_spec import block_spec_from_config
    from specpack.runtime.models.weights import checkpoint_files, read_tensors

    d = Path(drafter_dir)
    spec = block_spec_from_config(json.loads((d / "config.json").read_text()))
    files = checkpoint_files(d)
    names = [n for n in files if n.startswith(HEAD_PREFIXES) or n == "d2t"]
    return spec, read_tensors(files, names)
