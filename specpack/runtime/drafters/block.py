"""Block drafters (kind "block": DFlash, DSpark, LiLiCorr; docs/format.md), run single-model.

Per sequence (cache slot) the drafter keeps, for each of its layers, the keys and values of the
target context it has seen: ctx = hidden_norm(fc(target features)) of every committed position,
through that layer's own k_proj / k_norm / RoPE (at the position) and v_proj. A draft is one
forward of a query block at positions p.. (p = the anchor's, the latest token): the anchor, then
mask tokens; each layer attends [context < p | the whole block] (within the block non-causal, or
causal where `layer_causal` says so). The block's keys are scratch: the next job overwrites them.
Then per algorithm: DFlash samples every slot independently; DSpark corrects slot i's logits
with a Markov bias from the token drafted before it and estimates its acceptance; LiLiCorr
rescores each slot's top-k candidates jointly and walks the lattice (block_heads.py). A job that
asks for a tree (DraftJob.tree; DFlash and DSpark) gets the likeliest paths of the drafter's own
joint distribution over the block's slots instead of one chain (`_tree`), from the same forward.

Every block runs the trained slots in full (N = draft_slots) and a job asking for k < N tokens
gets the first k, so a draft never depends on its length (DeepSpec and z-lab always run the whole
block; vLLM runs num_speculative_tokens slots, N for a checkpoint served as published).

Resolved from the published code (deepseek-ai/DeepSpec @ afdfa7c9382a3341a3e6f17756dd816da79f132c,
z-lab/dflash @ 44947fbf71114e241c96de194f4b382b5dd330d0, vllm-project/vllm as cited):
- input_layernorm does NOT touch the context: k_ctx = k_proj(hidden_norm(fc(h))) while the block
  rows go through input_layernorm first (z-lab dflash/model.py Qwen3DFlashAttention.forward and
  DFlashDraftModel.forward; DeepSpec deepspec/modeling/dspark/qwen3/modeling.py
  Qwen3DSparkAttention.forward; vLLM qwen3_dflash.py @ 036a00d1 precompute_and_store_context_kv:
  RMSNorm with the hidden_norm weight, then the KV GEMM). k_norm does apply to context keys (the
  same k_norm over cat(k_ctx, k_block)); values get no norm.
- RoPE: context keys at their absolute positions, the block at p, p+1, ... in both layouts
  (z-lab dflash_generate: position_ids[cache_len : start + block_size] with the anchor at start;
  DeepSpec common.py create_position_ids = anchor + arange(B)); the draft's own rope config.
- Attention: no mask over the committed context, none within the block (attention_mask=None,
  is_causal=False in dflash_generate and DeepSpec eval/dspark/draft_ops.py); training sees
  kv < anchor position (common.py create_dspark_attention_mask). The draft cache keeps only the
  committed context (dflash_generate crops it to `start` after every block).
- Which rows predict: fill_in rows 1..N, slot q predicting the token at q (z-lab logits of
  `[:, 1 - block_size:]`); anchor_first rows 0..N-1 predicting q + 1 (DeepSpec label_offsets
  1..B, evaluator samples all B slots).
- DSpark: prev_0 = the anchor, then each sampled draft (target ids); logits = lm_head(h) + W2·f(e)
  (vLLM dspark/speculator.py @ 02957b5a _sample_sequential; DeepSpec markov_head.py); confidence
  σ(proj([h, W1[prev]])) per position (vLLM qwen3_dspark.py @ 0302ff40 compute_confidence).
- LiLiCorr: candidates = top-k of log_softmax(lm_head(h)) without logit_scale, embedded with the
  target's table; anchor_hidden = hidden_norm(fc(features)) of the last committed row (vLLM
  lilicorr/speculator.py @ 34546298 prepare_context_anchor, _score_candidates); the walk starts at
  candidate 0's row and follows the chosen index (vLLM dflash2/speculator.py @ 030da624
  _selector_walk_kernel).
Sampling is the engine's keyed rule: position q of a job races the drafter's own distribution
(softmax of its logits / of the walk row) with the target's noise (engine/sampling.py).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from specpack.errors import InputError, UnsupportedError
from specpack.runtime.drafters.base import Draft, DraftJob
from specpack.runtime.drafters.block_heads import ConfidenceHead, LiLiCorrHead, MarkovHead
from specpack.runtime.drafters.block_spec import HINT, BlockSpec, block_spec_from_config, block_tensor_shapes
from specpack.runtime.drafters.tree import Tree, branch, branching
from specpack.runtime.kernels.argmax import argmax_rows
from specpack.runtime.models.dense import Block, KVCache, RMSNorm, apply_rope, embedding, rope_inv_freq, rope_tables
from specpack.runtime.models.rows import Rows, Segment


class BlockOut(NamedTuple):
    """What one query block hands the algorithm, per job: `hidden` [J, N, H] (final norm) of the
    rows predicting draft positions 0..N-1; `logits` [J, n, Vd] (lm_head, before logit_scale) of
    the first n of them (`_logit_rows`); for LiLiCorr instead each slot's top-k `candidates`
    [J, N, k] (target ids), their draft `log_probs` [J, N, k] fp32 and target `embeds` [J, N, k, H]."""

    hidden: Tensor
    logits: Tensor | None
    candidates: Tensor | None = None
    log_probs: Tensor | None = None
    embeds: Tensor | None = None


class BlockDrafter(nn.Module):
    """Drafts for many sequences at once: one batched pass absorbs every job's new context, one
    forward runs every job's query block, then the algorithm's heads choose the tokens."""

    kind = "block"
    parallel_drafts = True  # one forward drafts every slot: the engine prices a draft as one head step

    def __init__(self, spec: BlockSpec, target):
        super().__init__()
        self.spec = spec
        self.capture_layers = spec.target_layer_ids
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.fc = nn.Linear(len(spec.target_layer_ids) * spec.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(H, eps)
        # the target's tables are held outside the module tree: not a second copy in state_dict
        if spec.embedding == "drafter":
            self.embed_tokens = embedding(spec.vocab_size, H)
        else:
            object.__setattr__(self, "embed_tokens", target.embed_tokens)
        if spec.lm_head == "drafter":
            self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False)
        else:
            object.__setattr__(self, "lm_head", target.lm_head)
        object.__setattr__(self, "target_embed", target.embed_tokens)  # LiLiCorr embeds candidates with it
        self.mask_embedding = nn.Parameter(torch.empty(H)) if spec.mask_embedding else None
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.markov_head = MarkovHead(spec) if spec.markov is not None else None
        self.confidence_head = ConfidenceHead(spec) if spec.confidence_with_markov is not None else None
        self.lilicorr = LiLiCorrHead(spec) if spec.lilicorr is not None else None
        self.cache: KVCache | None = None
        self.fused = None  # kernels.layers.FusedLayers when the layers run as C calls (see fuse_layers)
        self.fused_block = None  # kernels.layers.FusedBlock: then the whole draft forward runs as two C calls
        self.lengths: list[int] = []  # committed context positions per slot
        for name in ("cos", "sin", "draft_to_target", "anchor_ctx"):  # with the cache (reserve)
            self.register_buffer(name, None, persistent=False)

    # ---- slots -----------------------------------------------------------------------------

    @torch.inference_mode()
    def reserve(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of `max_len` positions (plus one query block); empties every slot."""
        s, w = self.spec, self.norm.weight
        size = max_len + s.block_len
        if self.cache is None or self.cache.max_len < size or self.cache.slots < slots:
            self.cache = None
            self.cache = KVCache(s.num_layers, s.num_kv_heads, s.head_dim, size, w.dtype, w.device, slots)
            self.cos, self.sin = rope_tables(rope_inv_freq(s.head_dim, s.rope_theta, s.rope_scaling), size,
                                             w.dtype, w.device)
            self.draft_to_target = torch.arange(s.draft_vocab_size, device=w.device) + self.d2t
            self.anchor_ctx = w.new_zeros(slots, s.hidden_size)
            if self.fused_block is not None:
                self.fused_block.set_tables(self.cos, self.sin)
        self.lengths = [0] * self.cache.slots

    def fuse_layers(self) -> bool:
        """Run the layers as C calls (kernels/layers.py) when their linear layers run on the packed
        CPU kernel, and with fc and lm_head there too the whole draft forward (FusedBlock); True
        when the layers now run fused."""
        from specpack.runtime.kernels.layers import FusedBlock, FusedLayers

        self.fused = FusedLayers.of(self.spec, self.layers)
        self.fused_block = FusedBlock.of(self)
        if self.fused_block is not None and self.cos is not None:
            self.fused_block.set_tables(self.cos, self.sin)
        return self.fused is not None

    def start(self, slot: int) -> None:
        """A new sequence takes `slot`."""
        self.lengths[slot] = 0

    def reset(self, max_len: int) -> None:
        """One sequence (slot 0), for `propose`."""
        self.reserve(1, max_len)

    def propose(self, context: Tensor, feats: Tensor | None, draft_len: int, sampler=None) -> Draft:
        """One sequence's draft (slot 0; see `draft`): context [n] every token so far, feats [r, F]
        the features of the r positions committed since the last call."""
        return self.draft([DraftJob(0, context, feats, draft_len, sampler)])[0]

    # ---- drafting --------------------------------------------------------------------------

    @property
    def estimates_acceptance(self) -> bool:
        """DSpark's confidence head rates each drafted position (Draft.confidence)."""
        return self.confidence_head is not None

    @property
    def max_draft_len(self) -> int:
        """The longest draft (a tree: its depth): the block's draft slots; a longer one asked for is
        the same draft (what `tune` sweeps up to)."""
        return self.spec.draft_slots

    @property
    def tree_drafts(self) -> bool:
        """DFlash and DSpark grow trees over their slots' distributions (DraftJob.tree, `_tree`);
        LiLiCorr's walk through its scored lattice drafts chains only."""
        return self.spec.lilicorr is None

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[Draft]:
        """absorb the new context -> the query block -> the algorithm's tokens (at most
        draft_slots per job) and, for DSpark with a confidence head, their confidences; jobs that
        ask for a tree get one (`_tree`)."""
        self._absorb(jobs)
        out = self._block(jobs)
        chain = getattr(self, f"_draft_{self.spec.algorithm}")
        trees = {i for i, j in enumerate(jobs) if branching(j)} if self.tree_drafts else set()
        if not trees:
            return chain(out, jobs)
        rest = [i for i in range(len(jobs)) if i not in trees]
        made = iter(chain(BlockOut(out.hidden[rest], out.logits[rest]), [jobs[i] for i in rest]) if rest else [])
        return [self._tree(out, i, j) if i in trees else next(made) for i, j in enumerate(jobs)]

    def _fresh(self, jobs: list[DraftJob]) -> list[tuple[DraftJob, int]]:
        """(job, r) for each job with r > 0 new committed positions; checks none was skipped."""
        counts = [0 if j.feats is None else len(j.feats) for j in jobs]
        off = [j.slot for j, r in zip(jobs, counts) if self.lengths[j.slot] + r != len(j.context) - 1]
        if off:  # an engine bug, not a user error: the context would silently shift
            raise RuntimeError(f"block drafter: slots {off} were not handed the features of every committed position")
        return [(j, r) for j, r in zip(jobs, counts) if r]

    def _logit_rows(self, jobs: list[DraftJob]) -> int:
        """How many prediction rows the algorithm reads the logits of: every slot for LiLiCorr's
        lattice, else the longest draft asked for (a shorter job reads the first of them)."""
        N = self.spec.draft_slots
        return N if self.spec.lilicorr is not None else max(min(j.k, N) for j in jobs)

    def _absorb(self, jobs: list[DraftJob]) -> None:
        """Each job's new context rows: K/V into its slot for good; LiLiCorr keeps the last row (its anchor)."""
        fresh = self._fresh(jobs)
        if not fresh:
            return
        w = self.norm.weight
        feats = fresh[0][0].feats if len(fresh) == 1 else torch.cat([j.feats for j, _ in fresh])
        segments = [(j.slot, self.lengths[j.slot], r) for j, r in fresh]
        if self.fused_block is not None:  # fc, hidden_norm and every layer's keys and values: one C call
            ctx = self.fused_block.context(feats, segments, self.cache)
        else:
            ctx = self._context(feats.to(w.device, w.dtype), segments)
        if self.lilicorr is not None:  # its anchor's row, for the lattice
            last = torch.tensor([r for _, r in fresh]).cumsum(0) - 1
            self.anchor_ctx[[j.slot for j, _ in fresh]] = ctx[last.to(w.device)]
        for j, r in fresh:
            self.lengths[j.slot] += r

    def _context(self, feats: Tensor, segments: list[tuple[int, int, int]]) -> Tensor:
        """ctx = hidden_norm(fc(feats)) [R, H] of the (slot, start, count) segments' new positions,
        their keys and values into every layer's cache."""
        ctx = self.hidden_norm(self.fc(feats))
        rows = Rows.of([Segment(*seg) for seg in segments], ctx.device)
        if self.fused is not None:  # every layer's keys and values in one C call
            self.fused.context_kv(ctx.contiguous(), self.fused.step(rows, self.cos, self.sin, self.cache), 0,
                                  len(self.layers))
            return ctx
        cos, sin = self.cos[rows.pos, None], self.sin[rows.pos, None]
        for i, layer in enumerate(self.layers):
            k, v = _context_kv(layer.self_attn, ctx, cos, sin)
            self.cache.k[i][rows.slot, :, rows.write] = k  # [R, kv_heads, hd] into each row's slot and position
            self.cache.v[i][rows.slot, :, rows.write] = v
        return ctx

    def _block(self, jobs: list[DraftJob]) -> BlockOut:
        """The query blocks [anchor, mask, ...] at positions p.. -> the final-norm hidden states of
        the rows that predict draft positions 0..N-1 and what the algorithm reads of their logits."""
        s = self.spec
        if self.fused_block is not None:  # embedding, layers, norm and lm_head: one C call
            hidden, logits = self.fused_block.draft([(j.slot, self.lengths[j.slot], int(j.context[-1])) for j in jobs],
                                                    s.first_prediction, s.draft_slots, self._logit_rows(jobs),
                                                    self.cache)
        else:
            hidden, logits = self._block_modules(jobs)
        if s.lilicorr is None:
            return BlockOut(hidden, logits)
        log_probs, candidates = logits.float().log_softmax(-1).topk(s.lilicorr.candidate_topk, -1)
        return BlockOut(hidden, None, candidates, log_probs, self.target_embed(candidates))

    def _block_modules(self, jobs: list[DraftJob]) -> tuple[Tensor, Tensor]:
        """`_block`'s hidden states and logits through the modules (or the fused layers alone)."""
        s, dev = self.spec, self.norm.weight.device
        T = s.block_len
        tokens = torch.full((len(jobs), T), s.mask_token_id, dtype=torch.long)
        tokens[:, 0] = torch.stack([j.context[-1].cpu() for j in jobs])
        tokens = tokens.flatten().to(dev)
        x = self.embed_tokens(tokens)  # [J·T, H]
        if self.mask_embedding is not None:
            x = torch.where((tokens == s.mask_token_id)[:, None], self.mask_embedding.to(x.dtype), x)
        full = torch.ones(T, T, dtype=torch.bool)
        rows = {causal: Rows.of([Segment(j.slot, self.lengths[j.slot], T, None if causal else full) for j in jobs],
                                dev) for causal in set(s.layer_causal)}
        x = self._layers(x, rows)
        a = s.first_prediction
        hidden = self.norm(x).view(len(jobs), T, -1)[:, a : a + s.draft_slots]  # [J, N, H]
        return hidden, self.lm_head(hidden[:, : self._logit_rows(jobs)])  # [J, n, Vd]

    def _layers(self, x: Tensor, rows: dict[bool, Rows]) -> Tensor:
        """Every layer over the query rows x [R, H], each with the rows of its causality; fused: a C
        call per run of layers alike (x updated in place)."""
        causal = self.spec.layer_causal
        if self.fused is not None:
            steps = {c: self.fused.step(r, self.cos, self.sin, self.cache) for c, r in rows.items()}
            for c, run in itertools.groupby(range(len(causal)), key=causal.__getitem__):
                run = list(run)
                self.fused.layers(x, steps[c], run[0], len(run))
            return x
        pos = next(iter(rows.values())).pos
        cos, sin = self.cos[pos, None], self.sin[pos, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self.cache.k[i], self.cache.v[i], rows[causal[i]])
        return x

    def _scaled(self, logits: Tensor) -> Tensor:
        scale = self.spec.logit_scale
        return (logits if scale is None else logits * scale).float()

    def _choose(self, logits: Tensor, jobs: list[DraftJob], step: int) -> Tensor:
        """Draft-vocab logits [J, Vd] -> each job's target id at its draft position `step`, [J]."""
        if all(j.sampler is None for j in jobs):
            return self.draft_to_target[argmax_rows(logits)]
        return torch.tensor([_pick(logits[i], j, step, self.draft_to_target) for i, j in enumerate(jobs)],
                            device=logits.device)

    def _draft_dflash(self, out: BlockOut, jobs: list[DraftJob]) -> list[Draft]:
        """Every slot on its own: argmax, or the keyed sample of softmax(logits) per position."""
        lengths = [min(j.k, self.spec.draft_slots) for j in jobs]
        logits = self._scaled(out.logits)  # [J, k, Vd]
        chosen = torch.stack([self._choose(logits[:, q], jobs, q) for q in range(logits.shape[1])], 1).cpu()
        return [Draft(chosen[i, :n].clone()) for i, n in enumerate(lengths)]

    def _draft_dspark(self, out: BlockOut, jobs: list[DraftJob]) -> list[Draft]:
        """Left to right: slot q's logits + the Markov bias of the token before it (the anchor,
        then the draft just chosen); then every slot's confidence from the same pairs, in one product
        (row-exact: the bits of one product per slot)."""
        lengths = [min(j.k, self.spec.draft_slots) for j in jobs]
        h, base = out.hidden[:, : max(lengths)], out.logits  # [J, k, H], [J, k, Vd]
        prev = torch.stack([j.context[-1] for j in jobs]).to(h.device)
        state, tokens, embedded = None, [], []
        for q in range(h.shape[1]):
            bias = 0
            if self.markov_head is not None:
                e, bias, state = self.markov_head.step(prev, h[:, q], state)
                embedded.append(e)
            prev = self._choose(self._scaled(base[:, q] + bias), jobs, q)
            tokens.append(prev)
        chosen = torch.stack(tokens, 1).cpu()  # [J, k]
        conf = None
        if self.confidence_head is not None:
            conf = self.confidence_head(h, torch.stack(embedded, 1) if embedded else None).cpu()  # [J, k]
        return [Draft(chosen[i, :n].clone(), None if conf is None else conf[i, :n].clone())
                for i, n in enumerate(lengths)]

    def _tree(self, out: BlockOut, i: int, job: DraftJob) -> Draft:
        """Job i's tree over its block's slots (EAGLE-2's dynamic tree over the drafter's own joint
        distribution): slot q expands the top-k nodes of depth q by cumulative probability, each
        into its top-k children from slot q's logits, DSpark's corrected by the Markov bias of that
        node's own token (and its own state: the rnn type's runs along each path); DFlash's slots
        are independent, so every node of a depth gets the same children (a Medusa-style tree).
        The job keeps its best `nodes`. A sampled job's first child at each node is its chain's
        keyed choice there (as EAGLE-3's trees: the multi-draft rule verifies them)."""
        depth, k = min(job.k, self.spec.draft_slots), job.tree.topk
        tree, h, base = Tree(), out.hidden[i], out.logits[i]
        anchor = job.context[-1:].to(h.device)
        state = {-1: None}  # node -> the Markov state its children start from
        for q in range(depth):
            frontier = tree.expandable(q, k, job.tree.nodes) if q else [-1]  # the nodes expanded into slot q
            if not frontier:  # none whose children could make the draft's cut
                break
            prev = torch.tensor([tree.tokens[n] for n in frontier], device=h.device) if q else anchor
            logits, after = self._slot_logits(base[q], h[q], prev, [state[n] for n in frontier])
            added = branch([tree] * len(frontier), frontier, logits, [job] * len(frontier), q,
                           [k] * len(frontier), self.draft_to_target)
            state.update((node, s) for nodes, s in zip(added, after) for node in nodes)
        return tree.draft(job.tree.nodes)

    def _slot_logits(self, base: Tensor, h: Tensor, prev: Tensor, states: list) -> tuple[Tensor, list]:
        """One slot's scaled logits [F, Vd] after each of F nodes (tokens `prev` [F], Markov states
        `states`), and each node's children's Markov state."""
        if self.markov_head is None:
            return self._scaled(base[None].expand(len(prev), -1)), [None] * len(prev)
        state = None if states[0] is None else torch.stack(states)
        _, bias, state = self.markov_head.step(prev, h[None].expand(len(prev), -1), state)
        return self._scaled(base[None] + bias), [None] * len(prev) if state is None else list(state)

    def _draft_lilicorr(self, out: BlockOut, jobs: list[DraftJob]) -> list[Draft]:
        """Top-k candidates per slot, scored jointly over all N slots; each job walks its first k
        slots from the anchor's row, then row i of each slot after candidate i was chosen."""
        candidates = out.candidates
        anchors = self.anchor_ctx[[j.slot for j in jobs]]
        scores = self.lilicorr(out.embeds, out.log_probs, out.hidden, anchors)  # [J, N, k, k]
        drafts = []
        for i, j in enumerate(jobs):
            prev, tokens = 0, []
            for q in range(min(j.k, self.spec.draft_slots)):
                tokens.append(_pick(scores[i, q, prev], j, q, candidates[i, q]))
                prev = int((candidates[i, q] == tokens[-1]).nonzero()[0])
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.long)))
        return drafts


def _context_kv(attn, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Keys (k_norm, RoPE) and values of context rows ctx [R, H] with one layer's projections:
    [R, kv_heads, hd] each. Runs the fused q/k/v projection and drops q (the packed CPU kernel
    hides the fused weight; the context rows of a step are few)."""
    R, hd, q_size = ctx.shape[0], attn.head_dim, attn.heads * attn.head_dim
    k, v = attn.qkv_proj(ctx)[:, q_size:].view(R, 2 * attn.kv_heads, hd).chunk(2, dim=1)
    return apply_rope(attn.k_norm(k), cos, sin), v


def _pick(logits: Tensor, job: DraftJob, step: int, ids: Tensor) -> int:
    """The target id chosen at draft position `step` from logits [K] over the target ids `ids`:
    argmax (lowest index on ties), or the keyed sample of the job's sampler."""
    if job.sampler is None:
        return int(ids[int(logits.argmax())])
    return job.sampler.race(job.sampler.probs(logits[None])[0], len(job.context) + step, ids)


# ---- loading ---------------------------------------------------------------------------------

def load_block(params: dict | None, drafter_dir, target) -> BlockDrafter:
    """Load a canonical block drafter dir for `target`, on its device and dtype. `params` entries
    override config.json fields. Every mismatch is reported at once."""
    from specpack.families.checks import shape_problems
    from specpack.runtime.models.weights import assign_weights, checkpoint_files, read_tensors, tensor_shapes

    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / "config.json").is_file():
        raise InputError(f"no config.json in drafter dir {drafter_dir}", hint=HINT)
    spec = block_spec_from_config({**json.loads((drafter_dir / "config.json").read_text()), **(params or {})})
    files = checkpoint_files(drafter_dir)
    found, expected = tensor_shapes(files), block_tensor_shapes(spec)
    unexpected = sorted(set(found) - set(expected))
    sinks = [n for n in unexpected if n.endswith(".attention_sink_bias")]
    problems = _target_problems(spec, target.spec) + shape_problems(found, expected)
    problems += [f"unexpected tensor {n}: the config has no place for it (a head it does not declare?)"
                 for n in unexpected if n not in sinks]
    if problems:
        raise InputError(f"block drafter {drafter_dir} does not fit this target or its own config",
                         problems=problems, hint="the drafter must be converted for exactly this target model")
    if sinks:
        raise UnsupportedError("the torch runtime cannot run block drafters with attention sinks yet",
                               problems=sinks, hint="serve it with an engine that supports them (specpack export)")
    w = read_tensors(files, expected)
    _check_vocab_map(w.get("d2t"), spec, drafter_dir)
    with torch.device("meta"):
        head = BlockDrafter(spec, target)
    head = assign_weights(head, _state(w, spec), target.device, target.dtype)
    if head.confidence_head is not None:
        head.confidence_head.float()
    return head


def _target_problems(s: BlockSpec, t) -> list[str]:
    problems = [f"{name} is {mine}, the target's is {theirs}" for name, mine, theirs in [
        ("target_hidden_size", s.target_hidden_size, t.hidden_size),
        ("target_vocab_size", s.target_vocab_size, t.vocab_size)] if mine != theirs]
    problems += [f"target layer id {i} is not the input of a layer of the {t.num_layers}-layer target"
                 for i in s.target_layer_ids if not 0 <= i < t.num_layers]
    shared = [what for what, source in (("embedding", s.embedding), ("lm_head", s.lm_head)) if source == "target"]
    if s.lilicorr is not None:
        shared.append("embedding (LiLiCorr's candidates)")
    problems += [f"the head (hidden {s.hidden_size}) cannot use the target's {what} (hidden {t.hidden_size})"
                 for what in shared if s.hidden_size != t.hidden_size]
    if s.embedding == "target" and s.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {s.vocab_size} with the target's embedding of {t.vocab_size} rows")
    if s.lm_head == "target" and s.draft_vocab_size != t.vocab_size:
        problems.append(f"draft_vocab_size {s.draft_vocab_size} with the target's lm_head of {t.vocab_size} rows")
    return problems


def _check_vocab_map(d2t: Tensor | None, s: BlockSpec, where) -> None:
    from specpack.runtime.drafters.eagle3 import _vocab_map_problems  # the same d2t rules as EAGLE-3's

    problems = [] if d2t is None else _vocab_map_problems(d2t, None, s)
    if problems:
        raise InputError(f"block drafter {where} has a broken vocabulary map", problems=problems, hint=HINT)


def _state(w: dict[str, Tensor], s: BlockSpec) -> dict[str, Tensor]:
    """Canonical tensors -> the module's state (fused q/k/v and gate/up; interleaved RoPE as neox)."""
    from specpack.runtime.models.weights import fuse_layer

    state = {k: v for k, v in w.items() if not k.startswith("layers.")}
    state.setdefault("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
    for i in range(s.num_layers):
        layer = _neox_order(w, s, f"layers.{i}.") if s.rope_style == "interleaved" else w
        state.update(fuse_layer(layer, f"layers.{i}.", f"layers.{i}."))
    return state


def _neox_order(w: dict[str, Tensor], s: BlockSpec, p: str) -> dict[str, Tensor]:
    """An interleaved-RoPE layer as a neox one: RoPE on pairs (2i, 2i+1) is RoPE on halves after
    moving the even channels of every q/k head first; q·k, and q_norm / k_norm with their weights
    permuted alike, do not see the order."""
    order = torch.cat([torch.arange(0, s.head_dim, 2), torch.arange(1, s.head_dim, 2)])
    out = dict(w)
    for name, heads in (("q", s.num_heads), ("k", s.num_kv_heads)):
        for kind in ("weight", "bias"):
            key = f"{p}self_attn.{name}_proj.{kind}"
            if key in w:
                t = w[key]
                out[key] = t.view(heads, s.head_dim, *t.shape[1:])[:, order].reshape(t.shape)
        out[f"{p}self_attn.{name}_norm.weight"] = w[f"{p}self_attn.{name}_norm.weight"][order]
    return out
