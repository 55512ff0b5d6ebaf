"""A block drafter (DFlash, DSpark, LiLiCorr) over its exported graphs (exports/onnx/block.py),
for the graph backends, as `GraphEagle3` is the EAGLE-3 head over its graph.

`GraphBlock` drafts exactly as `BlockDrafter`: `draft` and each algorithm's `_draft_*` are the torch
drafter's own functions, and so are the heads they run on the host (DSpark's Markov correction and
confidence head, LiLiCorr's correlator: fp32 modules loaded from the artifact's drafter weights).
Only the two forwards differ: `_absorb` runs the context graph once over every sequence's newly
committed positions (in chunks of `max_tokens_per_call` rows), their new keys and values written
into each sequence's slots, and `_block` runs the step graph once over every sequence's query block,
reading the whole cache buffer of all slots (`SharedCaches`). Subclasses implement `_run_context`
and `_run_step` (one graph call each).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from specpack.errors import InputError
from specpack.runtime.backends import SharedCaches, SlotCache, cache_layout, chunks, new_slot_names
from specpack.runtime.drafters.block import BlockDrafter, BlockOut
from specpack.runtime.drafters.block_heads import ConfidenceHead, LiLiCorrHead, MarkovHead
from specpack.runtime.drafters.block_spec import BlockSpec

_DTYPES = {"float32": torch.float32, "int64": torch.int64}
HEAD_PREFIXES = ("markov_head.", "confidence_head.", "lilicorr.")  # the heads that run on the host


class GraphBlock:
    """The block drafter as two exported graphs (see the module docstring)."""

    kind, parallel_drafts = "block", True
    draft, start, reset, propose = BlockDrafter.draft, BlockDrafter.start, BlockDrafter.reset, BlockDrafter.propose
    _fresh, _logit_rows, _scaled, _choose = (BlockDrafter._fresh, BlockDrafter._logit_rows, BlockDrafter._scaled,
                                             BlockDrafter._choose)
    _draft_dflash, _draft_dspark, _draft_lilicorr = (BlockDrafter._draft_dflash, BlockDrafter._draft_dspark,
                                                     BlockDrafter._draft_lilicorr)
    tree_drafts, _tree, _slot_logits = BlockDrafter.tree_drafts, BlockDrafter._tree, BlockDrafter._slot_logits
    estimates_acceptance = BlockDrafter.estimates_acceptance
    max_tokens_per_call: int | None = None  # context rows per graph call (None: all at once)

    def __init__(self, spec: BlockSpec, heads: dict[str, Tensor], context_graph, step_graph, device: torch.device,
                 dtype: torch.dtype):
        self.spec, self.device, self.dtype = spec, device, dtype  # dtype: the cache's
        self.capture_layers = spec.target_layer_ids
        self.context_graph, self.step_graph = context_graph, step_graph
        self.new_names = new_slot_names(context_graph)
        if "seq_rows" not in [i.name for i in step_graph.inputs]:
            raise InputError("this ONNX export's block step graph runs one sequence a call (made by an older "
                             "specpack)", hint="re-export with `specpack export ARTIFACT --to onnx --force`")
        d2t = heads.get("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.draft_to_target = (torch.arange(spec.draft_vocab_size) + d2t).to(device)
        self.markov_head, self.confidence_head, self.lilicorr = host_heads(spec, heads, device)
        self.shared: SharedCaches | None = None
        self.caches: list[SlotCache] = []
        self.lengths: list[int] = []  # committed context positions per slot
        self.anchor_ctx = torch.zeros(0, spec.hidden_size, device=device)

    def reserve(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of `max_len` positions; empties every slot."""
        if self.shared is None or self.shared.max_len < max_len or len(self.shared.slots) < slots:
            self.shared = None
            self.shared = SharedCaches(cache_layout(self.step_graph), slots, max_len, self.dtype, self.device)
            self.anchor_ctx = torch.zeros(slots, self.spec.hidden_size, device=self.device)
        self.caches = self.shared.slots
        self.lengths = [0] * len(self.caches)

    def _absorb(self, jobs) -> None:
        """As `BlockDrafter._absorb`: every job's new context rows into its slot, its last row kept."""
        fresh = self._fresh(jobs)
        if not fresh:
            return
        dev, L = self.device, self.shared.max_len
        for j, r in fresh:
            if self.lengths[j.slot] + r > L:
                raise InputError(f"{self.lengths[j.slot] + r} positions do not fit the drafter's cache of {L}",
                                 hint="reserve a larger max_len")
        feats = torch.cat([j.feats for j, _ in fresh]).to(dev, torch.float32)
        pos = torch.cat([torch.arange(self.lengths[j.slot], self.lengths[j.slot] + r) for j, r in fresh])
        dest = torch.cat([torch.full((r,), j.slot * L) for j, r in fresh]) + pos  # rows of the cache buffer
        pos, dest = pos.to(dev), dest.to(dev)
        ctx = torch.cat([self._run_context(feats[a:b], pos[a:b], dest[a:b])
                         for a, b in chunks(len(feats), self.max_tokens_per_call)])
        last = torch.tensor([r for _, r in fresh]).cumsum(0) - 1
        self.anchor_ctx[[j.slot for j, _ in fresh]] = ctx[last.to(dev)]
        for j, r in fresh:
            self.lengths[j.slot] += r

    def _block(self, jobs) -> BlockOut:
        """As `BlockDrafter._block`: one step-graph call over every job's query block."""
        s, dev = self.spec, self.device
        a, L, J = s.first_prediction, s.block_len, len(jobs)
        n = self._logit_rows(jobs)
        tokens = torch.full((J, L), s.mask_token_id, dtype=torch.long)
        tokens[:, 0] = torch.stack([j.context[-1].cpu() for j in jobs])
        starts = torch.tensor([self.lengths[j.slot] for j in jobs])
        P = int(starts.max())
        past = torch.arange(P)
        seen = past[None, :] < starts[:, None]  # [J, P]
        cache_rows = torch.where(seen, torch.tensor([j.slot for j in jobs])[:, None] * self.shared.max_len + past, 0)
        inputs = {"tokens": tokens.flatten(), "positions": (starts[:, None] + torch.arange(L)).flatten(),
                  "logits_index": (torch.arange(J)[:, None] * L + torch.arange(a, a + n)).flatten(),
                  "seq_rows": torch.arange(J * L).view(J, L), "cache_rows": cache_rows, "seen": seen}
        out = self._run_step({k: v.to(dev) for k, v in inputs.items()}, J * n)
        hidden = out["hidden"].view(J, L, -1)[:, a : a + s.draft_slots]  # [J, N, H]
        if s.lilicorr is None:
            return BlockOut(hidden, out["logits"].view(J, n, -1))
        return BlockOut(hidden, None, *(out[name].view(J, n, *out[name].shape[1:]) for name in
                                        ("candidates", "candidate_log_probs", "candidate_embeds")))

    def _step_outputs(self, T: int, K: int) -> dict[str, Tensor]:
        """Fresh buffers for the step graph's outputs: T block rows, K logits rows."""
        return {o.name: torch.empty([{"T": T, "K": K}.get(d, d) for d in o.shape], dtype=_DTYPES[o.dtype],
                                    device=self.device) for o in self.step_graph.outputs}

    def _step_inputs(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """`inputs` and the whole cache buffer (the step graph's `past_*`)."""
        return {**inputs, **dict(zip((i.name for i in self.step_graph.inputs if i.name.startswith("past_")),
                                     self.shared.past()))}

    def _run_context(self, feats: Tensor, positions: Tensor, dest: Tensor) -> Tensor:
        """One context-graph call over T rows: their new slots written at buffer rows `dest` [T];
        returns context [T, H] fp32."""
        raise NotImplementedError

    def _run_step(self, inputs: dict[str, Tensor], K: int) -> dict[str, Tensor]:
        """One step-graph call over `inputs` (the cache buffer added by `_step_inputs`), K logits rows."""
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
