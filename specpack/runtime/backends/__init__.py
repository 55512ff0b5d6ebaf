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
(and `graph_block.GraphBlock` for block drafters):
the exported graphs (converters/onnx_export) read the P cached slots of each layer and write the T
new ones, one sequence per call, and these adapters keep one cache per sequence slot, the length
pointers and the masks exactly as the torch model does. The drafters' own loops (`draft`) are the
torch drafters', reused unchanged.
"""

from __future__ import annotations

import importlib
from typing import Sequence

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
    Roll back by assigning a smaller `length`."""

    def __init__(self, entries: int, slot: Sequence[int], max_len: int, dtype, device):
        self.store = torch.zeros(entries, max_len, *slot, dtype=dtype, device=device)
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


class GraphTarget:
    """The target as an exported step graph; subclasses implement `_run` (one graph call).

    Each sequence slot has its own `SlotCache`; a graph call reads and writes `self.cache`, which
    `forward_rows` points at the slot of the segment it runs (one call per segment: the graphs
    take one sequence). `max_tokens_per_call` (None: unbounded) splits longer inputs, such as
    prefills beyond a TensorRT profile, into consecutive calls: the same result, since each call
    sees the cache the last wrote. Capturing the number of target layers returns the graph's
    `hidden` output (the state an MTP drafter reads)."""

    max_tokens_per_call: int | None = None

    def __init__(self, spec, graph, aux_layer_ids: Sequence[int] | None, device: torch.device, dtype: torch.dtype):
        self.spec, self.graph = spec, graph
        self.aux_layer_ids = tuple(aux_layer_ids or ())
        self.device, self.dtype = device, dtype
        self.names = [i.name for i in graph.inputs]
        self.new_names = new_slot_names(graph)
        self.widths = {o.name: o.shape[1] for o in graph.outputs if o.name in ("aux", "hidden")}
        self.caches: list[SlotCache] = []
        self.cache: SlotCache | None = None

    def setup_cache(self, max_len: int, slots: int = 1) -> None:
        """Make room for `slots` sequences of `max_len` positions (reallocating only when either
        grows) and empty the caches."""
        if not self.caches or self.caches[0].max_len < max_len or len(self.caches) < slots:
            self.caches = []
            self.caches = [SlotCache.for_graph(self.graph, max_len, self.dtype, self.device) for _ in range(slots)]
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
        out = self.forward_rows(tokens, rows, capture, [T - 1] if last_only else None)
        self.caches[0].length = start + T
        return out

    def forward_rows(self, tokens: Tensor, rows, capture: Sequence[int] = (), logits_rows=None):
        """The contract of `Decoder.forward_rows`: one graph call (or chunked calls) per segment,
        each on its slot's cache."""
        from specpack.runtime.models.dense import Output

        name, dev = self._output_of(capture), self.device
        wanted = range(tokens.shape[0]) if logits_rows is None else logits_rows
        logits, states = {}, []
        for seg, a in rows.segments:
            mine = [r - a for r in wanted if a <= r < a + seg.T]
            part = self._segment(tokens[a : a + seg.T].to(dev), seg, mine)
            logits.update({a + r: row for r, row in zip(mine, part["logits"])})
            if name:
                states.append(part[name])
        out = torch.stack([logits[r] for r in wanted]) if len(wanted) else torch.empty(0, self.spec.vocab_size)
        return Output(out, torch.cat(states) if name else None)

    def _segment(self, tokens: Tensor, seg, rows: list[int]) -> dict[str, Tensor]:
        """One segment on its slot's cache: logits of its `rows`, aux / hidden of all its rows."""
        self.cache = self.caches[seg.slot]
        parts = segment_calls(self.cache, seg, rows, self.max_tokens_per_call,
                              lambda a, b, pos, mask, want: self._run(tokens[a:b], pos, mask, want))
        out = {"logits": torch.cat([p["logits"][:n] for n, p in parts])}
        out.update({n: torch.cat([p[n] for _, p in parts]) for n in self.widths})
        return out

    def _outputs(self, T: int, K: int) -> dict[str, Tensor]:
        """Fresh buffers for the graph's outputs but the cache: logits [K, V] fp32, aux / hidden [T, width]."""
        out = {"logits": torch.empty(K, self.spec.vocab_size, device=self.device)}
        out.update({name: torch.empty(T, width, device=self.device) for name, width in self.widths.items()})
        return out

    def _run(self, tokens: Tensor, positions: Tensor, mask: Tensor, rows: Tensor) -> dict[str, Tensor]:
        """One graph call: reads `cache.past()`, writes `cache.new(T)`, returns `_outputs` filled."""
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
