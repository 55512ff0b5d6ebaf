"""Backends: where the target (and drafter) of a loaded artifact run. A plain dict registry.

Every backend module exposes `NAME` and

    load(artifact, manifest, device, dtype, **options) -> (target, drafter)

`target` quacks like `runtime.model.Transformer` as far as the speculative loop needs:
`.spec`, `.device`, `.dtype`, `.setup_cache(max_len)`, `target(tokens, positions=None, mask=None,
capture=(), last_only=False) -> Output(logits, aux)` over T new tokens, and `.cache.length`
(read it; assign a smaller value to roll back). `drafter` has `.kind`, `.capture_layers`,
`.reset(max_len)` and `.propose(context, feats, draft_len, sampler) -> Draft`. So
`SpecModel(target, drafter)` and its loop run unchanged on every backend.

The graph backends (onnxruntime, tensorrt) share `GraphTarget` / `GraphEagle3` below: the exported
graphs (converters/onnx_export.py) read the P cached slots of each layer and write the T new ones,
and these adapters keep the cache, the length pointer and the masks exactly as the torch model does.
"""

from __future__ import annotations

import importlib
from typing import Sequence

import torch
from torch import Tensor

from specpack.errors import InputError, UnsupportedError
from specpack.runtime.eagle3 import Eagle3Drafter

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
    """Keys and values of every layer in one buffer [2·layers, max_len, kv_heads, head_dim], in the
    graphs' input order (key.0, value.0, key.1, ...), slot-major: the first `length` slots of each
    layer are a contiguous prefix a graph reads without a copy, and its new slots go straight after.
    Roll back by assigning a smaller `length`."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        self.store = torch.zeros(2 * layers, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.store.shape[1]

    def past(self) -> list[Tensor]:
        """Views of the committed slots: past_key.0, past_value.0, past_key.1, ..."""
        return list(self.store[:, : self.length].unbind(0))

    def new(self, T: int) -> list[Tensor]:
        """Views of the T slots after the committed ones, in the same order."""
        return list(self.store[:, self.length : self.length + T].unbind(0))


def full_mask(start: int, T: int, block: Tensor | None, device) -> Tensor:
    """[T, start+T] bool: every cached slot plus `block` [T, T] among the new tokens (causal when None),
    the same rule as `KVCache.mask` but always materialised (the graphs take a mask input)."""
    if block is None:
        block = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(T, start, dtype=torch.bool, device=device), block.to(device, torch.bool)], 1)


class GraphTarget:
    """The target as an exported step graph; subclasses implement `_run` (one graph call).

    `max_tokens_per_call` (None: unbounded) splits longer inputs, such as prefills beyond a TensorRT
    profile, into consecutive calls: the same result, since each call sees the cache the last wrote."""

    max_tokens_per_call: int | None = None

    def __init__(self, spec, aux_layer_ids: Sequence[int] | None, device: torch.device, dtype: torch.dtype):
        self.spec = spec
        self.aux_layer_ids = tuple(aux_layer_ids or ())
        self.device, self.dtype = device, dtype
        self.cache: SlotCache | None = None

    def setup_cache(self, max_len: int) -> None:
        """Make room for `max_len` positions (reallocating only when it grows) and empty the cache."""
        if self.cache is None or self.cache.max_len < max_len:
            s = self.spec
            self.cache = SlotCache(s.num_layers, s.num_kv_heads, s.head_dim, max_len, self.dtype, self.device)
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
        logits, aux = [], []
        for a, b in chunks(T, self.max_tokens_per_call):
            cache.length = start + a
            # all rows' logits, or only the last chunk's last row (each other chunk computes one, dropped)
            rows = torch.arange(0 if not last_only else b - a - 1, b - a, device=dev)
            lg, ax = self._run(tokens[a:b], positions[a:b], mask[a:b, : start + b], rows)
            logits.append(lg)
            aux.append(ax)
        cache.length = start + T
        logits = logits[-1] if last_only else torch.cat(logits)
        return Output(logits, torch.cat(aux) if capture and aux[0] is not None else None)

    def _run(self, tokens: Tensor, positions: Tensor, mask: Tensor, rows: Tensor) -> tuple[Tensor, Tensor | None]:
        """One graph call: reads `cache.past()`, writes `cache.new(T)`, returns (logits [K, V] fp32, aux)."""
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
            self.cache = SlotCache(1, s.num_kv_heads, s.head_dim, max_len, self.dtype, self.device)
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
        outs = []
        for a, b in chunks(T, self.max_tokens_per_call):
            cache.length = start + a
            out, logits = self._run(feats[a:b], hidden[max(a - R, 0) : max(b - R, 0)], tokens[a:b],
                                    torch.arange(start + a, start + b, device=dev), mask[a:b, : start + b],
                                    torch.tensor([b - a - 1], device=dev))
            outs.append(out)
        cache.length = start + T
        return torch.cat(outs), logits

    def _run(self, feats, hidden, tokens, positions, mask, rows) -> tuple[Tensor, Tensor]:
        """One graph call: (hidden_out [T, H], logits [K, Vd] fp32); reads and writes the cache as GraphTarget."""
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
