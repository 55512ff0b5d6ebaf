"""Backends: where the target (and drafter) of a loaded artifact run. A plain dict registry.

Every backend module exposes `NAME` and

    load(artifact, manifest, device, dtype, **options) -> (target, drafter)

`target` quacks like `runtime.model.Decoder` as far as the engine needs: `.spec`, `.device`,
`.dtype`, `.setup_cache(max_len, slots)`, `.forward_rows(tokens, rows, capture, logits_rows, greedy_rows) ->
Output(logits, aux)` over the new rows of many sequences (runtime.rows), `.compact(slot, src, dst)`
(a verified draft tree's accepted rows moved after the prefix), and the single-sequence
`target(tokens, positions=None, mask=None, capture=(), last_only=False)` with `.cache.length`.
`drafter` has `.kind`, `.capture_layers`, `.reserve(slots, max_len)`, `.start(slot)` and
`.draft(jobs) -> [Draft]`. So `SpecModel(target, drafter)` and the engine run unchanged on every
backend.

The graph backends (onnxruntime, tensorrt) share `GraphTarget` / `GraphEagle3` / `GraphMtp` below
(and `graph_block.GraphBlock` for block drafters). Every graph runs the new rows of every sequence
of a step in one call (the weights stream once), reading the whole cache buffer of all slots and
gathering each sequence's own rows (`ManySequenceGraph`, `SharedCaches`, `batch_layout`). These
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
    """One sequence slot's part of a graph's cache, `store` [entries, max_len, *slot] (a view of the
    `SharedCaches` buffer), in the graphs' input order (key.0, value.0, key.1, ... or latent.0,
    latent.1, ...), slot-major; `length` is how many positions it holds (roll back by assigning a
    smaller one)."""

    def __init__(self, store: Tensor):
        self.store = store
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.store.shape[1]

    @torch.inference_mode()
    def compact(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move the slots at positions `src` to `dst` in every entry (as `KVCache.compact`)."""
        s, d = torch.as_tensor(src, device=self.store.device), torch.as_tensor(dst, device=self.store.device)
        self.store[:, d] = self.store[:, s]


class SharedCaches:
    """Every sequence slot's `SlotCache` as a view of one buffer `flat` [entries, slots * max_len,
    *slot]: a many-sequence graph (`layers.Batch`) reads each entry whole as its `past_*` input and
    gathers the rows it needs; slot s owns rows s * max_len .. (s + 1) * max_len - 1."""

    def __init__(self, layout: tuple[int, Sequence[int]], slots: int, max_len: int, dtype, device):
        entries, slot = layout  # as `cache_layout` reads it from a graph
        self.flat = torch.zeros(entries, slots * max_len, *slot, dtype=dtype, device=device)
        view = self.flat.view(entries, slots, max_len, *slot)
        self.slots = [SlotCache(view[:, s]) for s in range(slots)]
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
    """The many-sequence graph inputs (exports/onnx/layers.Batch, and `positions`) of one
    call over `pieces`, and the cache buffer row (`SharedCaches`) each new row's slots go to. Padded
    places attend one key (no row all -inf); padded cache indices point at row 0 (masked).

    Batch invariance on ONNX Runtime: a sequence's logits must not depend on what else runs in the
    call. Its rows go through the linear layers with the others (row-exact there); its attention
    sees padding, whose masked keys add exact zeros at the end of each ordered sum in
    `layers.attend`. ONNX Runtime's matrix product takes another path for a one-row operand,
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


class ManySequenceGraph:
    """What the adapters of the many-sequence graphs (the target's, the EAGLE-3 head's, each MTP
    layer's) share: every
    sequence slot's cache as a view of one buffer (`SharedCaches`), which each call reads whole and
    gathers from, so one call runs the new rows of every sequence of a forward and the weights stream
    once whatever the batch. `max_tokens_per_call` (None: unbounded) splits longer inputs, such as
    prefills beyond a TensorRT profile, into consecutive calls (`plan_calls`): the same result, since
    each call sees the cache the last wrote. Subclasses set `graph`, `spec`, `device`, `dtype` and
    implement `_run` (one graph call); a backend that needs the new slots written somewhere fixed
    (TensorRT: 256-byte aligned) sets `new_buffer` [entries, max_tokens_per_call, *slot]."""

    max_tokens_per_call: int | None = None
    new_buffer: Tensor | None = None

    def _bind(self, graph, role: str) -> None:
        """Read `graph`'s cache names; refuse an export whose graph takes one sequence a call."""
        if "seq_rows" not in [i.name for i in graph.inputs]:
            raise InputError(f"this ONNX export's {role} graph runs one sequence a call (made by an older specpack)",
                             hint="re-export with `specpack export ARTIFACT --to onnx --force`")
        self.graph = graph
        self.past_names = [i.name for i in graph.inputs if i.name.startswith("past_")]
        self.new_names = new_slot_names(graph)
        self.min_q = 2 if query_group(self.spec) == 1 else 1  # see batch_layout
        self.shared: SharedCaches | None = None
        self.caches: list[SlotCache] = []
        self.cache: SlotCache | None = None

    def _reserve(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of `max_len` positions (reallocating only when either grows);
        every slot emptied."""
        if self.shared is None or self.shared.max_len < max_len or len(self.shared.slots) < slots:
            self.shared = None
            self.shared = SharedCaches(cache_layout(self.graph), slots, max_len, self.dtype, self.device)
        self.caches = self.shared.slots
        for c in self.caches:
            c.length = 0
        self.cache = self.caches[0]

    def _rows(self, rows, per_row: dict[str, Tensor], fixed: dict[str, Tensor], wanted: list[int],
              widths: dict[str, int], vocab: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Run `rows` (runtime.rows.Rows): `per_row` inputs [R, ...] indexed by row, `fixed` ones as
        they are -> (logits [len(wanted), vocab] of the `wanted` rows, each output of `widths` [R, width]:
        every output of the graph but logits and the cache's, as a call binds them all)."""
        dev, R = self.device, rows.count
        for seg, _ in rows.segments:
            if seg.start + seg.T > self.shared.max_len:
                raise InputError(f"{seg.start + seg.T} positions do not fit the KV cache of {self.shared.max_len}",
                                 hint="call setup_cache with a larger max_len")
        logits, full = {}, {name: torch.empty(R, w, device=dev) for name, w in widths.items()}
        for pieces in plan_calls(rows, self.max_tokens_per_call):
            src = torch.cat([p.rows for p in pieces])
            place = {r: i for i, r in enumerate(src.tolist())}
            mine = [r for r in dict.fromkeys(wanted) if r in place]
            idx = src.to(dev)
            out = self._call({**{k: t[idx] for k, t in per_row.items()}, **fixed}, pieces,
                             [place[r] for r in mine] or [len(src) - 1], widths, vocab)
            logits.update(zip(mine, out["logits"]))
            for name in widths:
                full[name][idx] = out[name]
        out = torch.stack([logits[r] for r in wanted]) if wanted else torch.empty(0, vocab, device=dev)
        return out, full

    def _call(self, inputs: dict[str, Tensor], pieces: Sequence[Piece], want: list[int], widths: dict[str, int],
              vocab: int) -> dict[str, Tensor]:
        """One graph call over `pieces`: logits [K, vocab] of rows `want` (call-local) and the `widths`
        outputs of all its rows; the new slots written into the cache buffer."""
        T, dev = sum(len(p.rows) for p in pieces), self.device
        layout, dest = batch_layout(pieces, self.shared.max_len, self.min_q)
        inputs = {**inputs, "logits_index": torch.tensor(want, device=dev),
                  **{k: v.to(dev) for k, v in layout.items()}, **dict(zip(self.past_names, self.shared.past()))}
        outputs = {"logits": torch.empty(len(want), vocab, device=dev),
                   **{name: torch.empty(T, w, device=dev) for name, w in widths.items()}}
        new = self._new_slots(T)
        self._run(T, inputs, {**outputs, **dict(zip(self.new_names, new.unbind(0)))})
        self.shared.write(new, dest.to(dev))
        return outputs

    def _new_slots(self, T: int) -> Tensor:
        """Where a call writes its T new slots: [entries, T, *slot], each entry contiguous."""
        if self.new_buffer is not None:
            return self.new_buffer[:, :T]
        flat = self.shared.flat
        return torch.empty(flat.shape[0], T, *flat.shape[2:], dtype=flat.dtype, device=flat.device)

    def _run(self, T: int, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """One graph call of T rows: reads `inputs`, fills `outputs` (named as the graph's)."""
        raise NotImplementedError


class GraphTarget(ManySequenceGraph):
    """The target as an exported many-sequence step graph (exports/onnx: `target_step`),
    behaving like `Decoder` for the engine. Capturing the number of target layers returns the graph's
    `hidden` output (the state an MTP drafter reads)."""

    def __init__(self, spec, graph, aux_layer_ids: Sequence[int] | None, device: torch.device, dtype: torch.dtype):
        self.spec, self.device, self.dtype = spec, device, dtype
        self._bind(graph, "target")
        self.aux_layer_ids = tuple(aux_layer_ids or ())
        self.widths = {o.name: o.shape[1] for o in graph.outputs if o.name in ("aux", "hidden")}

    def setup_cache(self, max_len: int, slots: int = 1) -> None:
        """Make room for `slots` sequences of `max_len` positions (reallocating only when either
        grows) and empty the caches."""
        self._reserve(slots, max_len)

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

    def forward_rows(self, tokens: Tensor, rows, capture: Sequence[int] = (), logits_rows=None, greedy_rows=()):
        """The contract of `Decoder.forward_rows`: one graph call over every segment (more when
        `max_tokens_per_call` splits them); each segment's slot ends `T` positions longer. Every
        logit is computed (`greedy_rows` only permits less)."""
        from specpack.runtime.models.dense import Output

        name = self._output_of(capture)
        wanted = list(range(tokens.shape[0])) if logits_rows is None else list(logits_rows)
        logits, out = self._rows(rows, {"tokens": tokens.to(self.device)}, {}, wanted, self.widths,
                                 self.spec.vocab_size)
        for seg, _ in rows.segments:
            self.caches[seg.slot].length = seg.start + seg.T
        return Output(logits, out[name] if name else None)


def chunks(T: int, size: int | None) -> list[tuple[int, int]]:
    """[(start, end)] covering range(T) in pieces of at most `size` (one piece when None)."""
    size = size or T
    return [(a, min(a + size, T)) for a in range(0, T, size)]


class _Features:
    """Target features handed to `_forward`: the graph applies fc itself (see GraphEagle3.fc)."""

    def __init__(self, feats: Tensor):
        self.feats = feats


class GraphEagle3(ManySequenceGraph):
    """The EAGLE-3 head as an exported many-sequence step graph. Drafting reuses
    `Eagle3Drafter.draft` unchanged: only `fc` and `_forward` differ (the graph runs fc, the layer
    and the head), one call over every sequence's rows (split as GraphTarget's)."""

    kind = "eagle3"
    draft, _choose, start = Eagle3Drafter.draft, Eagle3Drafter._choose, Eagle3Drafter.start
    _grow, _branch, tree_drafts = Eagle3Drafter._grow, Eagle3Drafter._branch, True
    reset, propose = Eagle3Drafter.reset, Eagle3Drafter.propose

    def __init__(self, spec, graph, d2t: Tensor, device: torch.device, dtype: torch.dtype):
        self.spec, self.device, self.dtype = spec, device, dtype
        self._bind(graph, "EAGLE-3")
        self.capture_layers = spec.aux_layer_ids
        self.draft_to_target = (torch.arange(spec.draft_vocab_size) + d2t).to(device)
        self.lengths: list[int] = []

    def reserve(self, slots: int, max_len: int) -> None:
        self._reserve(slots, max_len)
        self.lengths = [0] * len(self.caches)

    def _chain_in_c(self, jobs, h, drafts) -> bool:
        return False  # each chain step is a run of the graph

    def fc(self, feats: Tensor) -> _Features:
        return _Features(feats)

    def _forward(self, h, tokens: Tensor, rows, logit_rows: list[int]) -> tuple[Tensor, Tensor]:
        """As `Eagle3Drafter._forward`; `h` is target features (from `fc`) or the head's own states."""
        s, dev = self.spec, self.device
        width = len(s.aux_layer_ids) * s.target_hidden_size
        if isinstance(h, _Features):
            per_row, fixed = {"feats": h.feats.float()}, {"hidden": torch.empty(0, s.hidden_size, device=dev)}
        else:
            per_row, fixed = {"hidden": h.float()}, {"feats": torch.empty(0, width, device=dev)}
        logits, out = self._rows(rows, {**per_row, "tokens": tokens.to(dev)}, fixed, list(logit_rows),
                                 {"hidden_out": s.hidden_size}, s.draft_vocab_size)
        return out["hidden_out"], logits


class MtpLayerGraph(ManySequenceGraph):
    """One MTP layer's many-sequence step graph over its own cache buffer; `run(T, inputs, outputs)`
    is one call of it (the backend's session or engine)."""

    def __init__(self, target_spec, graph, device: torch.device, dtype: torch.dtype, run):
        self.spec, self.device, self.dtype, self.run = target_spec, device, dtype, run
        self._bind(graph, f"MTP layer {graph.layer}")

    def _run(self, T, inputs, outputs):
        self.run(T, inputs, outputs)


class GraphMtp:
    """MTP layers as exported step graphs, one per layer, drafting exactly as `MtpDrafter`: its
    `draft` runs unchanged over `_run_layer` below, one call of layer k's graph over every
    sequence's rows (`MtpLayerGraph`). The target graph's `hidden` output is already the state
    layer 0 reads. Subclasses pass each layer's `run`."""

    kind = "mtp"
    draft, check_draft_len, start = MtpDrafter.draft, MtpDrafter.check_draft_len, MtpDrafter.start
    _absorb, _reuse, _choose = MtpDrafter._absorb, MtpDrafter._reuse, MtpDrafter._choose
    tree_drafts = True
    reset, propose = MtpDrafter.reset, MtpDrafter.propose

    def __init__(self, spec, target: GraphTarget, graphs, device: torch.device, dtype: torch.dtype, runs):
        if "hidden" not in target.widths:
            raise InputError("the target graph of this ONNX export returns no hidden state for the MTP layers",
                             hint="re-export with `specpack export ARTIFACT --to onnx --force`")
        self.spec, self.target, self.graphs = spec, target, graphs
        self.device, self.dtype = device, dtype
        self.capture_layers = (target.spec.num_layers,)
        self.layers = [MtpLayerGraph(target.spec, g, device, dtype, run) for g, run in zip(graphs, runs)]
        self.done: list[list[int]] = []
        self.absorbed: list[int] = []

    def _target_state(self, h: Tensor) -> Tensor:
        return h  # the target graph already returns the state layer 0 reads

    def reserve(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of `max_len` rows per layer (as `MtpDrafter.reserve`)."""
        for layer in self.layers:
            layer._reserve(slots, max_len)
        outs = getattr(self, "outs", None)
        if outs is None or outs.shape[0] < slots or outs.shape[2] < max_len:
            self.outs = None
            self.outs = torch.zeros(slots, self.spec.num_layers + 1, max_len, self.spec.hidden_size,
                                    device=self.device)
        n = self.outs.shape[0]
        self.done, self.absorbed = [[0] * self.spec.num_layers for _ in range(n)], [0] * n

    def _run_layer(self, k: int, h: Tensor, tokens: Tensor, rows, jobs=()) -> tuple[Tensor, Tensor]:
        """As `MtpDrafter._run_layer`: layer k over `rows` -> (chain hidden [R, H], logits [J, V] of
        each segment's last row; every logit: the graph has no screen)."""
        logits, out = self.layers[k]._rows(rows, {"hidden": h.float(), "tokens": tokens.to(self.device)}, {},
                                           rows.last_rows(), {"hidden_out": self.spec.hidden_size},
                                           self.target.spec.vocab_size)
        return out["hidden_out"], logits


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
