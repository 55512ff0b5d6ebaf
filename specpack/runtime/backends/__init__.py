"""Backends: where the target (and drafter) of a loaded artifact run. A plain dict registry.

Every backend module exposes `NAME` and

    load(artifact, manifest, device, dtype, **options) -> (target, drafter)

`target` quacks like `runtime.model.Transformer` as far as the speculative loop needs:
`.spec`, `.device`, `.dtype`, `.setup_cache(max_len)`, `target(tokens, positions=None, mask=None,
capture=(), last_only=False) -> Output(logits, aux)` over T new tokens, and `.cache.length`
(read it; assign a smaller value to roll back). `drafter` has `.kind`, `.capture_layers`,
`.reset(max_len)` and `.propose(context, feats, draft_len, sampler) -> Draft`. So
`SpecModel(target, drafter)` and its loop run unchanged on every backend.

The graph backends (onnxruntime, tensorrt) share `GraphTarget` / `GraphEagle3` / `GraphMtp` below:
the exported graphs (converters/onnx_export) read the P cached slots of each layer and write the T
new ones, and these adapters keep the cache, the length pointer and the masks exactly as the torch
model does. The drafters' own loops (`propose`) are the torch drafters', reused unchanged.
"""

from __future__ import annotations

import importlib
from typing import Sequence

import torch
from torch import Tensor

from specpack.errors import InputError, UnsupportedError
from specpack.runtime.eagle3 import Eagle3Drafter
from specpack.runtime.mtp import MtpDrafter

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


def full_mask(start: int, T: int, block: Tensor | None, device) -> Tensor:
    """[T, start+T] bool: every cached slot plus `block` [T, T] among the new tokens (causal when None),
    the same rule as `KVCache.mask` but always materialised (the graphs take a mask input)."""
    if block is None:
        block = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(T, start, dtype=torch.bool, device=device), block.to(device, torch.bool)], 1)


class GraphTarget:
    """The target as an exported step graph; subclasses implement `_run` (one graph call).

    `max_tokens_per_call` (None: unbounded) splits longer inputs, such as prefills beyond a TensorRT
    profile, into consecutive calls: the same result, since each call sees the cache the last wrote.
    When the graph returns `hidden` (for an MTP drafter), `last_hidden` holds (first row, hidden
    [T, H]) of the latest call, as `MtpDrafter`'s hook records it on the torch target."""

    max_tokens_per_call: int | None = None

    def __init__(self, spec, graph, aux_layer_ids: Sequence[int] | None, device: torch.device, dtype: torch.dtype):
        self.spec, self.graph = spec, graph
        self.aux_layer_ids = tuple(aux_layer_ids or ())
        self.device, self.dtype = device, dtype
        self.names = [i.name for i in graph.inputs]
        self.new_names = new_slot_names(graph)
        self.widths = {o.name: o.shape[1] for o in graph.outputs if o.name in ("aux", "hidden")}
        self.cache: SlotCache | None = None
        self.last_hidden: tuple[int, Tensor] | None = None

    def setup_cache(self, max_len: int) -> None:
        """Make room for `max_len` positions (reallocating only when it grows) and empty the cache."""
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = SlotCache.for_graph(self.graph, max_len, self.dtype, self.device)
        self.cache.length = 0

    def __call__(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                 capture: Sequence[int] = (), last_only: bool = False):
        """Run T new tokens after the cached ones (the contract of `Transformer.forward`)."""
        from specpack.runtime.model import Output

        cache, T, dev = self.cache, tokens.shape[0], self.device
        start = cache.length
        if start + T > cache.max_len:
            raise InputError(f"{start + T} positions do not fit the KV cache of {cache.max_len}",
                             hint="call setup_cache with a larger max_len")
        if capture and tuple(capture) != self.aux_layer_ids:
            raise UnsupportedError(f"the exported graph returns the hidden states of layers {self.aux_layer_ids}, "
                                   f"not {tuple(capture)}", hint="re-export for this drafter")
        tokens = tokens.to(dev)
        positions = torch.arange(start, start + T, device=dev) if positions is None else positions.to(dev)
        mask = full_mask(start, T, mask, dev)

        def call(a, b):
            # all rows' logits, or only the last chunk's last row (each other chunk computes one, dropped)
            rows = torch.arange(0 if not last_only else b - a - 1, b - a, device=dev)
            return self._run(tokens[a:b], positions[a:b], mask[a:b, : start + b], rows)

        parts = run_chunks(cache, T, self.max_tokens_per_call, call)
        if "hidden" in self.widths:
            self.last_hidden = (start, torch.cat([p["hidden"] for p in parts]))
        logits = parts[-1]["logits"] if last_only else torch.cat([p["logits"] for p in parts])
        return Output(logits, torch.cat([p["aux"] for p in parts]) if capture else None)

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
    """Target features handed to `step`: the graph applies fc itself (see GraphEagle3.fc)."""

    def __init__(self, feats: Tensor):
        self.feats = feats


class GraphEagle3:
    """The EAGLE-3 head as an exported step graph. Drafting reuses `Eagle3Drafter.propose` and
    `choose` unchanged: only `fc` and `step` differ (the graph runs fc, the layer and the head)."""

    kind = "eagle3"
    propose = Eagle3Drafter.propose
    choose = Eagle3Drafter.choose
    max_tokens_per_call: int | None = None

    def __init__(self, spec, d2t: Tensor, device: torch.device, dtype: torch.dtype):
        self.spec, self.device, self.dtype = spec, device, dtype
        self.capture_layers = spec.aux_layer_ids
        self.draft_to_target = (torch.arange(spec.draft_vocab_size) + d2t).to(device)
        self.cache: SlotCache | None = None

    def reset(self, max_len: int) -> None:
        s = self.spec
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = SlotCache(2, (s.num_kv_heads, s.head_dim), max_len, self.dtype, self.device)
        self.cache.length = 0

    def fc(self, feats: Tensor) -> _Features:
        return _Features(feats)

    def step(self, h, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """As `Eagle3Drafter.step`: appends T positions; returns (hidden [T, H], logits [1, Vd]).
        `h` is target features (from `fc`, rows first) or the head's own hidden states."""
        s, cache, T, dev = self.spec, self.cache, tokens.shape[0], self.device
        start = cache.length
        n_feats = len(s.aux_layer_ids) * s.target_hidden_size
        feats = h.feats if isinstance(h, _Features) else torch.empty(0, n_feats, device=dev)
        hidden = torch.empty(0, s.hidden_size, device=dev) if isinstance(h, _Features) else h
        R, mask = feats.shape[0], full_mask(start, T, None, dev)

        def call(a, b):
            return self._run(feats[a:b], hidden[max(a - R, 0) : max(b - R, 0)], tokens[a:b],
                             torch.arange(start + a, start + b, device=dev), mask[a:b, : start + b],
                             torch.tensor([b - a - 1], device=dev))

        outs = run_chunks(cache, T, self.max_tokens_per_call, call)
        return torch.cat([o for o, _ in outs]), outs[-1][1]

    def _run(self, feats, hidden, tokens, positions, mask, rows) -> tuple[Tensor, Tensor]:
        """One graph call: (hidden_out [T, H], logits [K, Vd] fp32); reads and writes the cache as GraphTarget."""
        raise NotImplementedError


class GraphMtp:
    """MTP layers as exported step graphs, one per layer, drafting exactly as `MtpDrafter`: its
    `propose` and `_step` run unchanged over `_run_layer` below; the target graph's `hidden` output
    stands in for the hook on the torch target's last layer. Subclasses implement `_run`."""

    kind = "mtp"
    capture_layers: tuple[int, ...] = ()
    propose = MtpDrafter.propose
    check_draft_len = MtpDrafter.check_draft_len
    _absorb_target = MtpDrafter._absorb_target
    _step = MtpDrafter._step
    max_tokens_per_call: int | None = None

    def __init__(self, spec, target: GraphTarget, graphs, device: torch.device, dtype: torch.dtype):
        if "hidden" not in target.widths:
            raise InputError("the target graph of this ONNX export returns no hidden state for the MTP layers",
                             hint="re-export with `specpack export ARTIFACT --to onnx --force`")
        self.spec, self.target, self.graphs = spec, target, graphs
        self.device, self.dtype = device, dtype
        self.names = [[i.name for i in g.inputs] for g in graphs]
        self.new_names = [new_slot_names(g) for g in graphs]
        self.caches: list[SlotCache] = []
        self.done: list[int] = []

    @property
    def _seen(self) -> tuple[int, Tensor] | None:
        return self.target.last_hidden

    def _target_state(self, h: Tensor) -> Tensor:
        return h  # the target graph already returns the state layer 0 reads

    def reset(self, max_len: int) -> None:
        """Room for `max_len` rows per layer; empties the caches (as `MtpDrafter.reset`)."""
        if not self.caches or self.caches[0].max_len < max_len:
            self.caches = [SlotCache.for_graph(g, max_len, self.dtype, self.device) for g in self.graphs]
            self.outs = torch.zeros(self.spec.num_layers + 1, max_len, self.spec.hidden_size, device=self.device)
        for c in self.caches:
            c.length = 0
        self.done = [0] * self.spec.num_layers

    def _run_layer(self, k: int, h: Tensor, tokens: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """As `MtpDrafter._run_layer`: layer k over rows start.. -> (chain hidden [T, H], logits [1, V])."""
        cache, T, dev = self.caches[k], tokens.shape[0], self.device
        cache.length = start
        mask = full_mask(start, T, None, dev)

        def call(a, b):
            return self._run(k, h[a:b], tokens[a:b], torch.arange(start + a, start + b, device=dev),
                             mask[a:b, : start + b], torch.tensor([b - a - 1], device=dev))

        outs = run_chunks(cache, T, self.max_tokens_per_call, call)
        return torch.cat([o for o, _ in outs]), outs[-1][1]

    def _run(self, k: int, hidden, tokens, positions, mask, rows) -> tuple[Tensor, Tensor]:
        """One call of layer k's graph: (hidden_out [T, H], logits [K, V] fp32); reads and writes
        `caches[k]` as GraphTarget does its cache."""
        raise NotImplementedError


def eagle3_files(artifact) -> tuple:
    """(Eagle3Spec, d2t) of the artifact's canonical drafter, without loading its weights."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from specpack.runtime.eagle3 import eagle3_spec_from_config

    d = Path(artifact) / "drafter"
    spec = eagle3_spec_from_config(json.loads((d / "config.json").read_text()))
    with safe_open(d / "model.safetensors", framework="pt") as f:
        return spec, f.get_tensor("d2t")


def mtp_files(artifact):
    """The `MtpSpec` of the artifact's canonical MTP drafter, without loading its weights."""
    import json
    from pathlib import Path

    from specpack.runtime.mtp import mtp_spec_from_config

    return mtp_spec_from_config(json.loads((Path(artifact) / "drafter" / "config.json").read_text()))
