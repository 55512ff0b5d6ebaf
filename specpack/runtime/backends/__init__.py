"""Backends: where the target (and drafter) of a loaded artifact run. A plain dict registry.

Every backend module exposes `NAME` and

    load(artifact, manifest, device, dtype, **options) -> (target, drafter)

`target` quacks like `runtime.model.Decoder` as far as the engine needs: `.spec`, `.device`,
`.dtype`, `.setup_cache(max_len, slots)`, `.forward_rows(tokens, rows, capture, logits_rows) ->
Output(logits, aux)` over the new rows of many sequences (runtime.rows), `.compact(slot, src, dst)`
(a verified draft tree's accepted rows moved after the prefix), and the single-sequence
`target(tokens, positions=None, mask=None, capture=(), last_only=False)` with `.cache.length`.
`drafter` has `.kind`, `.capture_layers`, `.reserve(slots, max_len)`, `.start(slot)` and
`.draft(jobs) -> [Draft]`. So `SpecModel(target, drafter)` and the engine run unchanged on every
backend.

The graph backends (onnxruntime, tensorrt) share `GraphTarget` / `GraphEagle3` / `GraphMtp` below
(and `graph_block.GraphBlock` for block drafters). The target graph runs the new rows of every
sequence of a step in one call (the weights stream once), reading the whole cache buffer of all
slots and gathering each sequence's own rows (`SharedCaches`, `batch_layout`); the drafter graphs
read the P cached slots of each layer and write the T new ones, one sequence per call. These
adapters keep the caches, the length pointers and the masks exactly as the torch model does. The
drafters' own loops (`draft`) are the torch drafters', reused unchanged.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from specpack.errors import InputError, UnsupportedError
from specpack.runtime.drafters.eagle3 import Eagle3Drafter
from specpack.runtime.drafters.mtp import MtpDrafter

BACKENDS = {"torch": "torch_backend", "onnxruntime": "onnxruntime_backend", "tensorrt": "tensorrt_backend"}


def get(name: str):
    """The backend module called `name`."""
    if name not in BACKENDS:
        raise InputError(f"unknown backend '{name}'", hint="use one of " + ", ".join(BACKENDS))
    return importlib.import_module(f"specpack.runtime.backends.{BACKENDS[name]}")


def load(name: str, artifact, manifest, device: str = "cpu", dtype: str = "float32", **options):
    """(target, drafter) of the (already verified) `artifact` on backend `name`."""
    return get(name).load(artifact, manifest, device, dtype, **options)


class SlotCache:
    """A graph's cache in one buffer [entries, max_len, *slot], in the graphs' input order (key.0,
    value.0, key.1, ... or latent.0, latent.1, ...), slot-major: the first `length` slots of each
    entry are a contiguous prefix a graph reads without a copy, and its new slots go straight after.
    Roll back by assigning a smaller `length`. `store` (optional) is a view to use as the buffer."""

    def __init__(self, entries: int, slot: Sequence[int], max_len: int, dtype, device, store: Tensor | None = None):
        self.store = torch.zeros(entries, max_len, *slot, dtype=dtype, device=device) if store is None else store
        self.length = 0

    @classmethod
    def for_graph(cls, graph, max_len: int, dtype, device) -> "SlotCache":
        """The cache `graph` reads and writes."""
        return cls(*cache_layout(graph), max_len, dtype, device)

    @property
    def max_len(self) -> int:
        return self.store.shape[1]

    def past(self) -> list[Tensor]:
        """Views of the committed slots: past_key.0, past_value.0, past_key.1, ..."""
        return list(self.store[:, : self.length].unbind(0))

    def new(self, T: int) -> list[Tensor]:
        """Views of the T slots after the committed ones, in the same order."""
        return list(self.store[:, self.length : self.length + T].unbind(0))

    @torch.inference_mode()
    def compact(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move the slots at positions `src` to `dst` in every entry (as `KVCache.compact`)."""
        s, d = torch.as_tensor(src, device=self.store.device), torch.as_tensor(dst, device=self.store.device)
        self.store[:, d] = self.store[:, s]


class SharedCaches:
    """Every sequence slot's `SlotCache` as a view of one buffer `flat` [entries, slots * max_len,
    *slot]: a many-sequence graph (`layers.Batch`) reads each entry whole as its `past_*` input and
    gathers the rows it needs; slot s owns rows s * max_len .. (s + 1) * max_len - 1."""

    def __init__(self, graph, slots: int, max_len: int, dtype, device):
        entries, slot = cache_layout(graph)
        self.flat = torch.zeros(entries, slots * max_len, *slot, dtype=dtype, device=device)
        view = self.flat.view(entries, slots, max_len, *slot)
        self.slots = [SlotCache(entries, slot, max_len, dtype, device, store=view[:, s]) for s in range(slots)]
        self.max_len = max_len

    def past(self) -> list[Tensor]:
        """The graph's `past_*` inputs: every entry whole [slots * max_len, *slot]."""
        return list(self.flat.unbind(0))

    @torch.inference_mode()
    def write(self, new: Tensor, rows: Tensor) -> None:
        """Put the new slots `new` [entries, T, *slot] at buffer rows `rows` [T]."""
        self.flat[:, rows] = new


def cache_layout(graph) -> tuple[int, list[int]]:
    """(entries, slot shape) of a step graph's cache: one entry per `past_*` input [P, *slot]."""
    past = [t for t in graph.inputs if t.name.startswith("past_")]
    return len(past), past[0].shape[1:]


def new_slot_names(graph) -> list[str]:
    """The graph's `new_*` outputs, in cache order."""
    return [o.name for o in graph.outputs if o.name.startswith("new_")]


def run_chunks(cache: SlotCache, T: int, size: int | None, call) -> list:
    """`call(a, b)` for consecutive pieces [a, b) of T new rows (one piece when `size` is None), each
    with `cache.length` at its first row; the cache ends T rows longer. Returns the results."""
    start, results = cache.length, []
    for a, b in chunks(T, size):
        cache.length = start + a
        results.append(call(a, b))
    cache.length = start + T
    return results


def segment_calls(cache: SlotCache, seg, wanted: Sequence[int], size: int | None, call) -> list:
    """One sequence's segment (rows.Segment) on its slot's `cache`, in graph calls of at most `size`
    rows: `call(a, b, positions [b-a], mask [b-a, start+b], want [K])` for consecutive pieces [a, b),
    `want` the piece's rows among `wanted` (segment-local), or its last row when none is (a graph
    computes at least one row's logits). Returns [(how many of `want` were wanted, result)]."""
    dev = cache.store.device
    positions = torch.arange(seg.start, seg.start + seg.T, device=dev) if seg.positions is None \
        else seg.positions.to(dev)
    mask = full_mask(seg.start, seg.T, seg.block, dev)
    if seg.start + seg.T > cache.max_len:
        raise InputError(f"{seg.start + seg.T} positions do not fit the KV cache of {cache.max_len}",
                         hint="call setup_cache with a larger max_len")
    cache.length = seg.start

    def piece(a, b):
        mine = [r - a for r in wanted if a <= r < b]
        return len(mine), call(a, b, positions[a:b], mask[a:b, : seg.start + b],
                               torch.tensor(mine or [b - a - 1], device=dev))

    return run_chunks(cache, seg.T, size, piece)


def full_mask(start: int, T: int, block: Tensor | None, device) -> Tensor:
    """[T, start+T] bool: every cached slot before `block` [T, W] (the last W positions, the new
    tokens last; causal [T, T] when None), the rule of `rows.Segment` always materialised (the
    graphs take a mask input)."""
    if block is None:
        block = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    seen = torch.ones(T, start + T - block.shape[1], dtype=torch.bool, device=device)
    return torch.cat([seen, block.to(device, torch.bool)], 1)


class Piece(NamedTuple):
    """Rows of one segment run in one graph call: on cache `slot` after `past` cached positions,
    `rows` [n] (their indices among the forward's rows) at RoPE `positions` [n], seeing `mask`
    [n, past + n] (the cached positions, then these rows)."""

    slot: int
    past: int
    rows: Tensor
    positions: Tensor
    mask: Tensor


def plan_calls(rows, size: int | None) -> list[list[Piece]]:
    """The graph calls that run `rows` (runtime.rows.Rows) on a many-sequence graph: each segment
    in pieces of at most `size` rows (whole when None), a segment's pieces in successive calls (each
    sees the cache the one before wrote), pieces of different segments together, up to `size` rows
    a call."""
    per_segment = []
    for seg, a in rows.segments:
        positions = torch.arange(seg.start, seg.start + seg.T) if seg.positions is None else seg.positions.cpu()
        mask = full_mask(seg.start, seg.T, seg.block, "cpu")
        per_segment.append([Piece(seg.slot, seg.start + p, torch.arange(a + p, a + q), positions[p:q],
                                  mask[p:q, : seg.start + q]) for p, q in chunks(seg.T, size)])
    calls: list[list[Piece]] = []
    for k in range(max(map(len, per_segment), default=0)):  # round k: every segment's k-th piece
        calls.append([])
        for piece in (ps[k] for ps in per_segment if k < len(ps)):
            if size and calls[-1] and sum(len(p.rows) for p in calls[-1]) + len(piece.rows) > size:
                calls.append([])
            calls[-1].append(piece)
    return calls


def batch_layout(pieces: Sequence[Piece], max_len: int, min_q: int = 1) -> tuple[dict[str, Tensor], Tensor]:
    """The many-sequence graph inputs (converters/onnx_export/layers.Batch, and `positions`) of one
    call over `pieces`, and the cache buffer row (`SharedCaches`) each new row's slots go to. Padded
    places attend one key (no row all -inf); padded cache indices point at row 0 (masked).

    Batch invariance on ONNX Runtime: a sequence's logits must not depend on what else runs in the
    call. Its rows go through the linear layers with the others (row-exact there); its attention
    sees padding, whose masked keys add exact zeros at the end of each ordered sum in
    `layers.attend_batch`. ONNX Runtime's matrix product takes another path for a one-row operand,
    so each sequence is padded to `min_q` rows (2 where one query head reads each key head, else 1).
    Tested: tests/test_engine.py, logits bit for bit."""
    B, Q = len(pieces), max(min_q, *(len(p.rows) for p in pieces))
    P = max(p.past for p in pieces)
    seq_rows = torch.zeros(B, Q, dtype=torch.long)
    cache_rows = torch.zeros(B, P, dtype=torch.long)
    mask = torch.zeros(B, Q, P + Q, dtype=torch.bool)
    mask[:, :, P] = True
    places, dest, t = [], [], 0
    for b, p in enumerate(pieces):
        n, base = len(p.rows), p.slot * max_len
        seq_rows[b, :n] = torch.arange(t, t + n)
        places.append(torch.arange(b * Q, b * Q + n))
        cache_rows[b, : p.past] = torch.arange(base, base + p.past)
        mask[b, :n, : p.past] = p.mask[:, : p.past]
        mask[b, :n, P : P + n] = p.mask[:, p.past :]
        dest.append(torch.arange(base + p.past, base + p.past + n))
        t += n
    layout = {"positions": torch.cat([p.positions for p in pieces]), "seq_rows": seq_rows,
              "row_place": torch.cat(places), "cache_rows": cache_rows, "mask": mask}
    return layout, torch.cat(dest)


def query_group(spec) -> int:
    """Query heads per key head in the graph's attention (MLA: every head reads the one latent)."""
    from specpack.runtime.models.deepseek import DeepseekSpec

    return spec.num_heads if isinstance(spec, DeepseekSpec) else spec.num_heads // spec.num_kv_heads


class GraphTarget:
    """The target as an exported many-sequence step graph (converters/onnx_export: `target_step`);
    subclasses implement `_run` (one graph call).

    Every sequence slot's cache is a view of one buffer (`SharedCaches`), which each call reads whole
    and gathers from: one call runs the new rows of every sequence of a forward, so the weights
    stream once per step whatever the batch. `max_tokens_per_call` (None: unbounded) splits longer
    inputs, such as prefills beyond a TensorRT profile, into consecutive calls (`plan_calls`): the
    same result, since each call sees the cache the last wrote. Capturing the number of target layers
    returns the graph's `hidden` output (the state an MTP drafter reads)."""

    max_tokens_per_call: int | None = None

    def __init__(self, spec, graph, aux_layer_ids: Sequence[int] | None, device: torch.device, dtype: torch.dtype):
        if "seq_rows" not in [i.name for i in graph.inputs]:
            raise InputError("this ONNX export's target graph runs one sequence a call (made by an older specpack)",
                             hint="re-export with `specpack export ARTIFACT --to onnx --force`")
        self.spec, self.graph = spec, graph
        self.aux_layer_ids = tuple(aux_layer_ids or ())
        self.device, self.dtype = device, dtype
        self.past_names = [i.name for i in graph.inputs if i.name.startswith("past_")]
        self.new_names = new_slot_names(graph)
        self.widths = {o.name: o.shape[1] for o in graph.outputs if o.name in ("aux", "hidden")}
        self.min_q = 2 if query_group(spec) == 1 else 1  # see batch_layout
        self.shared: SharedCaches | None = None
        self.caches: list[SlotCache] = []
        self.cache: SlotCache | None = None

    def setup_cache(self, max_len: int, slots: int = 1) -> None:
        """Make room for `slots` sequences of `max_len` positions (reallocating only when either
        grows) and empty the caches."""
        if self.shared is None or self.shared.max_len < max_len or len(self.shared.slots) < slots:
            self.shared = None
            self.shared = SharedCaches(self.graph, slots, max_len, self.dtype, self.device)
        self.caches = self.shared.slots
        for c in self.caches:
            c.length = 0
        self.cache = self.caches[0]

    def compact(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move cache rows of `slot` from positions `src` to `dst` (the contract of `Decoder.compact`)."""
        self.caches[slot].compact(src, dst)

    def _output_of(self, capture: Sequence[int]) -> str | None:
        if not capture:
            return None
        if tuple(capture) == self.aux_layer_ids:
            return "aux"
        if tuple(capture) == (self.spec.num_layers,) and "hidden" in self.widths:
            return "hidden"
        raise UnsupportedError(f"the exported graph returns the hidden states of layers {self.aux_layer_ids}, "
                               f"not {tuple(capture)}", hint="re-export for this drafter")

    def __call__(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                 capture: Sequence[int] = (), last_only: bool = False):
        """One sequence in slot 0 (the contract of `Transformer.forward`)."""
        from specpack.runtime.models.rows import Rows, Segment

        start, T = self.caches[0].length, tokens.shape[0]
        rows = Rows.of([Segment(0, start, T, mask, positions)], self.device)
        return self.forward_rows(tokens, rows, capture, [T - 1] if last_only else None)

    def forward_rows(self, tokens: Tensor, rows, capture: Sequence[int] = (), logits_rows=None):
        """The contract of `Decoder.forward_rows`: one graph call over every segment (more when
        `max_tokens_per_call` splits them); each segment's slot ends `T` positions longer."""
        from specpack.runtime.models.dense import Output

        name, dev, R = self._output_of(capture), self.device, tokens.shape[0]
        wanted = list(range(R)) if logits_rows is None else list(logits_rows)
        for seg, _ in rows.segments:
            if seg.start + seg.T > self.shared.max_len:
                raise InputError(f"{seg.start + seg.T} positions do not fit the KV cache of {self.shared.max_len}",
                                 hint="call setup_cache with a larger max_len")
        logits, states = {}, torch.empty(R, self.widths[name], device=dev) if name else None
        tokens = tokens.to(dev)
        for pieces in plan_calls(rows, self.max_tokens_per_call):
            src = torch.cat([p.rows for p in pieces])
            place = {r: i for i, r in enumerate(src.tolist())}
            mine = [r for r in dict.fromkeys(wanted) if r in place]
            out = self._call(tokens[src.to(dev)], pieces, [place[r] for r in mine] or [len(src) - 1])
            logits.update(zip(mine, out["logits"]))
            if name:
                states[src.to(dev)] = out[name]
        for seg, _ in rows.segments:
            self.caches[seg.slot].length = seg.start + seg.T
        out = torch.stack([logits[r] for r in wanted]) if wanted else torch.empty(0, self.spec.vocab_size, device=dev)
        return Output(out, states)

    def _call(self, tokens: Tensor, pieces: Sequence[Piece], want: list[int]) -> dict[str, Tensor]:
        """One graph call over `pieces`: logits of rows `want` (call-local), aux / hidden of all;
        the new slots written into the cache buffer."""
        T, dev = tokens.shape[0], self.device
        layout, dest = batch_layout(pieces, self.shared.max_len, self.min_q)
        inputs = {"tokens": tokens, "logits_index": torch.tensor(want, device=dev),
                  **{k: v.to(dev) for k, v in layout.items()}, **dict(zip(self.past_names, self.shared.past()))}
        new = self._new_slots(T)
        outputs = self._outputs(T, len(want))
        self._run(T, inputs, {**outputs, **dict(zip(self.new_names, new.unbind(0)))})
        self.shared.write(new, dest.to(dev))
        return outputs

    def _new_slots(self, T: int) -> Tensor:
        """Where a call writes its T new slots: [entries, T, *slot], each entry contiguous."""
        flat = self.shared.flat
        return torch.empty(flat.shape[0], T, *flat.shape[2:], dtype=flat.dtype, device=flat.device)

    def _outputs(self, T: int, K: int) -> dict[str, Tensor]:
        """Fresh buffers for the graph's outputs but the cache: logits [K, V] fp32, aux / hidden [T, width]."""
        out = {"logits": torch.empty(K, self.spec.vocab_size, device=self.device)}
        out.update({name: torch.empty(T, width, device=self.device) for name, width in self.widths.items()})
        return out

    def _run(self, T: int, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """One graph call of T rows: reads `inputs`, fills `outputs` (named as the graph's)."""
        raise NotImplementedError


def chunks(T: int, size: int | None) -> list[tuple[int, int]]:
    """[(start, end)] covering range(T) in pieces of at most `size` (one piece when None)."""
    size = size or T
    return [(a, min(a + size, T)) for a in range(0, T, size)]


class _Features:
    """Target features handed to `_forward`: the graph applies fc itself (see GraphEagle3.fc)."""

    def __init__(self, feats: Tensor):
        self.feats = feats


class GraphEagle3:
    """The EAGLE-3 head as an exported step graph. Drafting reuses `Eagle3Drafter.draft` unchanged:
    only `fc` and `_forward` differ (the graph runs fc, the layer and the head), one call per
    sequence (chunked as GraphTarget's), on that sequence's slot cache."""

    kind = "eagle3"
    draft, _choose, start = Eagle3Drafter.draft, Eagle3Drafter._choose, Eagle3Drafter.start
    _grow, _branch, tree_drafts = Eagle3Drafter._grow, Eagle3Drafter._branch, True
    reset, propose = Eagle3Drafter.reset, Eagle3Drafter.propose
    max_tokens_per_call: int | None = None

    def __init__(self, spec, d2t: Tensor, device: torch.device, dtype: torch.dtype):
        self.spec, self.device, self.dtype = spec, device, dtype
        self.capture_layers = spec.aux_layer_ids
        self.draft_to_target = (torch.arange(spec.draft_vocab_size) + d2t).to(device)
        self.caches: list[SlotCache] = []
        self.cache: SlotCache | None = None  # the slot a graph call runs on
        self.lengths: list[int] = []

    def reserve(self, slots: int, max_len: int) -> None:
        s = self.spec
        if not self.caches or self.caches[0].max_len < max_len or len(self.caches) < slots:
            self.caches = []
            self.caches = [SlotCache(2, (s.num_kv_heads, s.head_dim), max_len, self.dtype, self.device)
                           for _ in range(slots)]
        self.lengths = [0] * len(self.caches)

    def fc(self, feats: Tensor) -> _Features:
        return _Features(feats)

    def _forward(self, h, tokens: Tensor, rows, logit_rows: list[int]) -> tuple[Tensor, Tensor]:
        """As `Eagle3Drafter._forward`; `h` is target features (from `fc`) or the head's own states."""
        s, dev = self.spec, self.device
        feats = h.feats if isinstance(h, _Features) else None
        outs, logits = [], {}
        for seg, a in rows.segments:
            self.cache = self.caches[seg.slot]
            x = (feats if feats is not None else h)[a : a + seg.T]
            none_f, none_h = torch.empty(0, len(s.aux_layer_ids) * s.target_hidden_size, device=dev), \
                torch.empty(0, s.hidden_size, device=dev)
            mine = [r - a for r in logit_rows if a <= r < a + seg.T]
            parts = segment_calls(self.cache, seg, mine, self.max_tokens_per_call, lambda p, q, pos, mask, want:
                                  self._run(x[p:q] if feats is not None else none_f,
                                            x[p:q] if feats is None else none_h,
                                            tokens[a + p : a + q], pos, mask, want))
            outs += [o for _, (o, _) in parts]
            got = torch.cat([lg[:n] for n, (_, lg) in parts])
            logits.update({a + r: row for r, row in zip(mine, got)})
        return torch.cat(outs), torch.stack([logits[r] for r in logit_rows])

    def _run(self, feats, hidden, tokens, positions, mask, rows) -> tuple[Tensor, Tensor]:
        """One graph call: (hidden_out [T, H], logits [K, Vd] fp32); reads and writes `self.cache`
        as GraphTarget does."""
        raise NotImplementedError


class GraphMtp:
    """MTP layers as exported step graphs, one per layer, drafting exactly as `MtpDrafter`: its
    `draft` runs unchanged over `_run_layer` below, one call per sequence on that sequence's
    caches (`self.caches[k]` is layer k's cache of the slot being run). The target graph's `hidden`
    output is already the state layer 0 reads. Subclasses implement `_run`."""

    kind = "mtp"
    draft, check_draft_len, start = MtpDrafter.draft, MtpDrafter.check_draft_len, MtpDrafter.start
    _absorb, _reuse, _choose = MtpDrafter._absorb, MtpDrafter._reuse, MtpDrafter._choose
    tree_drafts = True
    reset, propose = MtpDrafter.reset, MtpDrafter.propose
    max_tokens_per_call: int | None = None

    def __init__(self, spec, target: GraphTarget, graphs, device: torch.device, dtype: torch.dtype):
        if "hidden" not in target.widths:
            raise InputError("the target graph of this ONNX export returns no hidden state for the MTP layers",
                             hint="re-export with `specpack export ARTIFACT --to onnx --force`")
        self.spec, self.target, self.graphs = spec, target, graphs
        self.device, self.dtype = device, dtype
        self.capture_layers = (target.spec.num_layers,)
        self.names = [[i.name for i in g.inputs] for g in graphs]
        self.new_names = [new_slot_names(g) for g in graphs]
        self.slot_caches: list[list[SlotCache]] = []  # [slot][layer]
        self.caches: list[SlotCache] = []  # the layers' caches of the slot being run
        self.done: list[list[int]] = []
        self.absorbed: list[int] = []

    def _target_state(self, h: Tensor) -> Tensor:
        return h  # the target graph already returns the state layer 0 reads

    def reserve(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of `max_len` rows per layer (as `MtpDrafter.reserve`)."""
        if not self.slot_caches or self.slot_caches[0][0].max_len < max_len or len(self.slot_caches) < slots:
            self.slot_caches = []
            self.slot_caches = [[SlotCache.for_graph(g, max_len, self.dtype, self.device) for g in self.graphs]
                                for _ in range(slots)]
            self.outs = torch.zeros(slots, self.spec.num_layers + 1, max_len, self.spec.hidden_size,
                                    device=self.device)
        n = len(self.slot_caches)
        self.done, self.absorbed = [[0] * self.spec.num_layers for _ in range(n)], [0] * n

    def _run_layer(self, k: int, h: Tensor, tokens: Tensor, rows) -> tuple[Tensor, Tensor]:
        """As `MtpDrafter._run_layer`: layer k over `rows` -> (chain hidden [R, H], logits [J, V] of
        each segment's last row)."""
        outs, logits = [], []
        for seg, a in rows.segments:
            self.caches = self.slot_caches[seg.slot]
            parts = segment_calls(self.caches[k], seg, [seg.T - 1], self.max_tokens_per_call,
                                  lambda p, q, pos, mask, want: self._run(k, h[a + p : a + q], tokens[a + p : a + q],
                                                                          pos, mask, want))
            outs += [o for _, (o, _) in parts]
            logits.append(parts[-1][1][1][:1])
        return torch.cat(outs), torch.cat(logits)

    def _run(self, k: int, hidden, tokens, positions, mask, rows) -> tuple[Tensor, Tensor]:
        """One call of layer k's graph: (hidden_out [T, H], logits [K, V] fp32); reads and writes
        `caches[k]` as GraphTarget does its cache."""
        raise NotImplementedError


def eagle3_files(artifact) -> tuple:
    """(Eagle3Spec, d2t) of the artifact's canonical drafter, without loading its weights."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from specpack.runtime.drafters.eagle3 import eagle3_spec_from_config

    d = Path(artifact) / "drafter"
    spec = eagle3_spec_from_config(json.loads((d / "config.json").read_text()))
    with safe_open(d / "model.safetensors", framework="pt") as f:
        return spec, f.get_tensor("d2t")


def mtp_files(artifact):
    """The `MtpSpec` of the artifact's canonical MTP drafter, without loading its weights."""
    import json
    from pathlib import Path

    from specpack.runtime.drafters.mtp import mtp_spec_from_config

    return mtp_spec_from_config(json.loads((Path(artifact) / "drafter" / "config.json").read_text()))
