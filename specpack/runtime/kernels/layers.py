"""Dense decoder layers (Llama / Mistral / Qwen2 / Qwen3) in C over every row of a batched forward:
per layer nine kernel calls, instead of ~40 torch ops and nine module calls, and a run of layers
(every layer between two captured hidden states) in one call from Python (kernels/decoder.c).

    RMSNorm ─ q/k/v ─ RoPE + KV-cache write ─ attention ─ o_proj + residual
    RMSNorm ─ gate/up ─ SiLU·up ─ down + residual

At one row per forward the torch ops between the matrix products cost several milliseconds per
token in dispatch alone, more than the products themselves take with int8 weights. Row-exact like
every kernel here (a row's result does not depend on the other rows). RoPE and the residual adds
give the same bits as the torch ops they replace; RMSNorm and SiLU differ from torch's in the last
bits (another summation order for the mean of squares, another exp polynomial), within fp32
rounding. `SPECPACK_FUSED=0` keeps the module path (for comparison).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from specpack.runtime.kernels._lib import _library, available
from specpack.runtime.kernels.attention import CACHE_DTYPES
from specpack.runtime.kernels.gguf import BlockEmbedding

MAX_HEAD_DIM = 1024  # sp_rope_cache's scratch


def enabled() -> bool:
    return os.environ.get("SPECPACK_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


class _Lin(ctypes.Structure):  # decoder.c's sp_lin_t
    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("fmt", ctypes.c_int32), ("threads", ctypes.c_int32), ("group", ctypes.c_int32),
                ("prefetch", ctypes.c_int32), ("isa", ctypes.c_int32)]


class _Layer(ctypes.Structure):  # sp_layer_t
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin)]


class _Forward(ctypes.Structure):  # sp_forward_t
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("hd", ctypes.c_int64), ("inter", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("threads", ctypes.c_int32), ("k", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("layer_stride", ctypes.c_int64), ("slot_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("ld", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("slot", ctypes.c_void_p),
                ("write", ctypes.c_void_p), ("ctx", ctypes.c_void_p), ("end", ctypes.c_void_p),
                ("mask", ctypes.c_void_p), ("ldm", ctypes.c_int64), ("kv16", ctypes.c_int64)]


class Step(NamedTuple):
    """One forward's rows as C arrays (kept alive here) and the `_Forward` that points at them."""
    arrays: tuple  # cos, sin [R, hd]; slot, write, ctx, end int64 [R]; mask uint8 [R, W] or None
    forward: _Forward
    scratch: Tensor


class FusedLayers:
    """Dense decoder layers (`dense.Block`: a `Transformer`'s, a block drafter's) whose linear layers
    all run on the packed kernel, sized by `spec` (a TargetSpec, a BlockSpec); made by `of`, which
    says None where they cannot run fused."""

    def __init__(self, s, layers):
        self.lib = _library()[0]
        self.heads, self.kv_heads, self.hd = s.num_heads, s.num_kv_heads, s.head_dim
        self.hidden, self.inter, self.eps = s.hidden_size, s.intermediate_size, float(s.rms_norm_eps)
        self.scale = self.hd ** -0.5
        self.threads = _threads([lin for b in layers for lin in _linears(b.self_attn, b.mlp)])
        self._keep = [_norms(b) for b in layers]  # the fp32 norm weights the table points at
        self.table = (_Layer * len(layers))(*(_layer(b, n) for b, n in zip(layers, self._keep)))
        self.width = 2 * self.hidden + (2 * self.heads + 2 * self.kv_heads) * self.hd + 3 * self.inter
        self._capture_ids: dict[tuple[int, ...], ctypes.Array] = {}

    @classmethod
    def of(cls, spec, layers) -> "FusedLayers | None":
        w = layers[0].input_layernorm.weight
        if not (enabled() and available() and spec.head_dim <= MAX_HEAD_DIM and w.dtype == torch.float32
                and w.device.type == "cpu"):
            return None
        if not all(_on_kernel(b.self_attn, b.mlp) for b in layers):
            return None
        return cls(spec, layers)

    def step(self, rows, cos: Tensor, sin: Tensor, cache) -> Step:
        """The per-forward arrays for `rows`; cos, sin: the model's [max_len, hd] tables; cache: the
        model's KVCache ([layers, slots, kv_heads, max_len, hd] keys and values, fp32 or fp16)."""
        *i64, mask = _row_arrays(rows)
        arrays = (cos[rows.pos].contiguous(), sin[rows.pos].contiguous(), *i64, mask)
        k, v = cache.k, cache.v
        if k.stride() != v.stride() or k.dtype != v.dtype or k.dtype not in CACHE_DTYPES:
            raise ValueError("key and value caches must share strides and dtype (fp32 or fp16)")
        f = _Forward(self.hidden, self.heads, self.kv_heads, self.hd, self.inter, self.eps, self.scale, self.threads,
                     k.data_ptr(), v.data_ptr(), *k.stride()[:4], rows.count,
                     *(_ptr(a) for a in arrays), 0 if mask is None else mask.shape[1], int(k.dtype == torch.float16))
        return Step(arrays, f, torch.empty(rows.count * self.width))

    def layers(self, x: Tensor, st: Step, first: int, n: int, capture: Sequence[int] = (),
               aux: Tensor | None = None) -> Tensor:
        """Layers first..first+n-1 over the rows x [R, hidden] (a fresh tensor, updated in place).
        `capture`: layer ids in first..first+n whose input (first + n: the output) is written, as the
        layers reach it, into column block c of aux [R, len(capture) * hidden] (fp32, contiguous)."""
        if capture:
            R, H = x.shape
            if not all(first <= c <= first + n for c in capture):
                raise ValueError(f"capture layers {list(capture)} outside {first}..{first + n}")
            if aux is None or aux.shape != (R, len(capture) * H) or aux.dtype != torch.float32 \
                    or not aux.is_contiguous():
                raise ValueError(f"aux must be a contiguous fp32 [{R}, {len(capture) * H}] tensor")
        key = tuple(capture)
        ids = self._capture_ids.get(key)
        if ids is None:  # a model's few capture sets, made once each
            ids = self._capture_ids[key] = (ctypes.c_int64 * max(1, len(key)))(*key)
        if n > 0 or capture:
            self.lib.sp_decoder_layers(self.table, first, n, ctypes.byref(st.forward), x.data_ptr(),
                                       st.scratch.data_ptr(), ids, len(capture), _ptr(aux) if capture else None)
        return x

    def context_kv(self, ctx: Tensor, st: Step, first: int, n: int) -> None:
        """A block drafter's context rows ctx [R, hidden] (fp32, contiguous; `st` made for their rows)
        as the keys and values of layers first..first+n-1: each layer's k/v projection of the same
        rows, k_norm and RoPE, written into the cache at the rows' positions (decoder.c's sp_context_kv)."""
        if ctx.dtype != torch.float32 or not ctx.is_contiguous() or ctx.shape != (st.forward.rows, self.hidden):
            raise ValueError(f"ctx must be a contiguous fp32 [{st.forward.rows}, {self.hidden}] tensor")
        self.lib.sp_context_kv(self.table, first, n, ctypes.byref(st.forward), ctx.data_ptr(), st.scratch.data_ptr())


def _norms(block) -> tuple:
    w = lambda norm: None if norm is None else norm.weight.detach().float().contiguous()  # noqa: E731
    a = block.self_attn
    return w(block.input_layernorm), w(block.post_attention_layernorm), w(a.q_norm), w(a.k_norm)


def _lin(p) -> _Lin:
    """A PackedLinear as decoder.c's sp_lin_t (the same arguments its __call__ passes)."""
    return _Lin(p._wptr, p._bptr, p.out_features, p.in_features, p._fmt, p.threads if p._parallel else 1,
                p.group, p.prefetch, p.isa)


def _layer(block, norms: tuple) -> _Layer:
    a, m = block.self_attn, block.mlp
    return _Layer(*(_ptr(t) for t in norms), _lin(a.qkv_proj.packed), _lin(a.o_proj.packed),
                  _lin(m.gate_up_proj.packed), _lin(m.down_proj.packed))


def _ptr(t: Tensor | None):
    return None if t is None else t.data_ptr()


def _linears(attn, mlp) -> tuple:
    """A layer's four linear layers."""
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _on_kernel(attn, mlp) -> bool:
    """Whether a layer's four linear layers all run on the packed AVX2/AVX-512 kernel (a layer of
    routed experts never runs fused: its experts differ per token)."""
    return hasattr(mlp, "gate_up_proj") and all(getattr(m, "packed", None) is not None and m.packed.backend == "avx2" for m in _linears(attn, mlp))


def _threads(linears) -> int:
    """The threads a fused call over `linears` (packed) runs on: the most their weight formats' settings
    chose (not the latest format tuned in the process: the greedy screen's w8a8 head is tuned after a
    model's own layers)."""
    return max(m.packed.threads for m in linears)


def _row_arrays(rows) -> tuple:
    """`rows` as the kernels read it: slot, write, ctx, end (int64) and the mask (uint8, or None)."""
    i64 = [t.to(torch.int64).contiguous() for t in (rows.slot, rows.write, rows.ctx, rows.end)]
    return (*i64, None if rows.mask is None else rows.mask.to(torch.uint8).contiguous())


class _Eagle3(ctypes.Structure):  # decoder.c's sp_eagle3_t
    _fields_ = [("layer", _Layer), ("hidden_norm", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("head", _Lin), ("norm_before_residual", ctypes.c_int64)]


class _Embed(ctypes.Structure):  # decoder.c's sp_embed_t
    _fields_ = [("table", ctypes.c_void_p), ("blocks", ctypes.c_void_p), ("kind", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64), ("fd", ctypes.c_int64), ("offset", ctypes.c_int64),
                ("rows", ctypes.c_int64)]


def embed_source(embedding) -> _Embed | None:
    """`embedding` as decoder.c reads token rows from it: an fp32 table (nn.Embedding), GGUF blocks
    (kernels.gguf.BlockEmbedding) or a table left in its file (an embedding with a `pread_source`: (file
    descriptor, offset of row 0), models.weights.FileEmbedding); None for anything else (the caller keeps the
    module path)."""
    if isinstance(embedding, BlockEmbedding) and embedding.raw.is_contiguous():
        raw = embedding.raw
        return _Embed(None, raw.data_ptr(), embedding._type, raw.shape[1], -1, 0, embedding.num_embeddings)
    if getattr(embedding, "pread_source", None) is not None:
        fd, offset = embedding.pread_source
        return _Embed(None, None, 0, 0, fd, offset, embedding.num_embeddings)
    w = getattr(embedding, "weight", None)
    if isinstance(embedding, torch.nn.Embedding) and w.dtype == torch.float32 and w.is_cpu and w.is_contiguous():
        return _Embed(w.data_ptr(), None, 0, 0, -1, 0, w.shape[0])
    return None


class FusedEagle3Layer:
    """An EAGLE-3 head's decoder layer (drafters/eagle3.Eagle3Layer), and with `step` the head's final
    norm and draft-vocab lm_head after it, as one C call (kernels/decoder.c's sp_eagle3_step) for the
    head's every draft step: a tree draft runs one per level, and as ~40 torch ops (or ~10 kernel
    calls from Python) a step cost more than its matrix products. The same operations as
    `FusedLayers` (RoPE and the residual adds torch's bits, RMSNorm and SiLU within fp32 rounding of
    torch's); row-exact.

        cat(RMSNorm(emb), RMSNorm(h)) ─ q/k/v ─ RoPE + KV-cache write ─ attention ─ o_proj (+ h)
        ─ RMSNorm ─ gate/up ─ SiLU·up ─ down (+ residual) [─ RMSNorm ─ lm_head]"""

    def __init__(self, layer):
        a, m = layer.self_attn, layer.mlp
        self.lib = _library()[0]
        self.heads, self.kv_heads, self.hd = a.heads, a.kv_heads, a.head_dim
        self.hidden, self.inter = m.down_proj.packed.out_features, m.down_proj.packed.in_features
        self.eps = float(layer.input_layernorm.eps)
        self.norms = [n.weight.detach().float().contiguous()
                      for n in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm)]
        self.layer = _Layer(_ptr(self.norms[0]), _ptr(self.norms[2]), None, None, _lin(a.qkv_proj.packed),
                            _lin(a.o_proj.packed), _lin(m.gate_up_proj.packed), _lin(m.down_proj.packed))
        self.norm_before_residual = layer.norm_before_residual
        self.threads = _threads(_linears(a, m))
        self.width = 4 * self.hidden + (2 * self.heads + 2 * self.kv_heads) * self.hd + 3 * self.inter
        self._heads: dict[int, tuple] = {}  # id(lm_head module) -> (sp_eagle3_t, final norm weight, lm_head)

    @classmethod
    def of(cls, layer) -> "FusedEagle3Layer | None":
        a = layer.self_attn
        if not (enabled() and available() and a.head_dim <= MAX_HEAD_DIM and a.q_norm is None
                and layer.input_layernorm.weight.device.type == "cpu" and _on_kernel(a, layer.mlp)):
            return None
        return cls(layer)

    def __call__(self, emb: Tensor, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                 rows) -> Tensor:
        """As Eagle3Layer.forward: emb, h [R, H] fp32; cos, sin [R, 1, hd]; k_cache, v_cache the
        head's [slots, kv_heads, max_len, hd] fp32 cache -> [R, H]."""
        return self.step(emb, h, cos, sin, k_cache, v_cache, rows)[0]

    def step(self, emb: Tensor, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, rows,
             logit_rows: Sequence[int] = (), norm=None, lm_head=None) -> tuple[Tensor, Tensor | None]:
        """`__call__`, then `lm_head(norm(out[logit_rows]))` (norm: the head's final RMSNorm, lm_head
        its draft-vocab head on the packed kernel: modules, see `head_fuses`) in the same call ->
        (out [R, H], logits [len(logit_rows), Vd], or None without lm_head)."""
        R, H, hd = h.shape[0], self.hidden, self.hd
        if (norm is None) != (lm_head is None):
            raise ValueError("the head's final norm and lm_head go together")
        if len(logit_rows) and (lm_head is None or not all(0 <= r < R for r in logit_rows)):
            raise ValueError(f"logit rows {list(logit_rows)} need an lm_head and must lie in 0..{R - 1}")
        emb, h = emb.float().contiguous(), h.float().contiguous()
        *i64, mask = _row_arrays(rows)
        cr, sr = cos.reshape(R, hd).contiguous(), sin.reshape(R, hd).contiguous()
        f = _Forward(H, self.heads, self.kv_heads, hd, self.inter, self.eps, hd ** -0.5, self.threads,
                     k_cache.data_ptr(), v_cache.data_ptr(), 0, *k_cache.stride()[:3], R, cr.data_ptr(),
                     sr.data_ptr(), *(t.data_ptr() for t in i64), _ptr(mask),
                     0 if mask is None else mask.shape[1], 0)
        table = self._table(norm, lm_head)
        out = torch.empty(R, H)
        logits = None if lm_head is None else torch.empty(len(logit_rows), lm_head.out_features)
        picked = (ctypes.c_int64 * max(1, len(logit_rows)))(*logit_rows)
        scratch = torch.empty(R * self.width + len(logit_rows) * H)
        self.lib.sp_eagle3_step(ctypes.byref(table), ctypes.byref(f), emb.data_ptr(), h.data_ptr(), out.data_ptr(),
                                picked, len(logit_rows), _ptr(logits), scratch.data_ptr())
        return out, logits

    def chain(self, slots: Sequence[int], starts: Sequence[int], ks: Sequence[int], h: Tensor, drafts: list[list[int]],
              embedding, d2t: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, norm,
              lm_head) -> bool:
        """The greedy chain after the first draft step, in one C call (decoder.c's sp_eagle3_chain): sequence j
        in cache slot slots[j] (its cache holding starts[j] positions) drafts up to ks[j] tokens, drafts[j] its
        first (target ids), h [J, H] its state after it; appends the rest to `drafts`. d2t: the target id of each
        draft id (int64); cos, sin the head's RoPE tables. False (nothing drafted) where `embedding` is not a
        table decoder.c reads (see embed_source) or a row could not be read; the caller drafts as before."""
        source = embed_source(embedding)
        J, kmax = len(slots), max(ks)
        if source is None or not self.head_fuses(norm, lm_head) or kmax < 2:
            return False
        H, hd, vd = self.hidden, self.hd, lm_head.out_features
        h = h.float().contiguous().clone()
        out = torch.zeros(J, kmax, dtype=torch.int64)
        out[:, 0] = torch.tensor([d[0] for d in drafts])
        slot_t, start_t, k_t = (torch.tensor(list(xs), dtype=torch.int64) for xs in (slots, starts, ks))
        cos, sin, d2t = cos.float().contiguous(), sin.float().contiguous(), d2t.to(torch.int64).contiguous()
        f = _Forward(H, self.heads, self.kv_heads, hd, self.inter, self.eps, hd ** -0.5, self.threads,
                     k_cache.data_ptr(), v_cache.data_ptr(), 0, *k_cache.stride()[:3], 0, None, None, None, None,
                     None, None, None, 0, 0)
        scratch = torch.empty(14 * J + J * (2 * hd + 3 * H + vd) + J * self.width + J * H)
        failed = self.lib.sp_eagle3_chain(ctypes.byref(self._table(norm, lm_head)), ctypes.byref(f), cos.data_ptr(),
                                          sin.data_ptr(), ctypes.byref(source), d2t.data_ptr(), vd, J,
                                          slot_t.data_ptr(), start_t.data_ptr(), k_t.data_ptr(), kmax, h.data_ptr(),
                                          out.data_ptr(), scratch.data_ptr())
        if failed:
            return False
        for j, d in enumerate(drafts):
            d[1:] = out[j, 1:ks[j]].tolist()
        return True

    def head_fuses(self, norm, lm_head) -> bool:
        """Whether `step` can run this final norm (an RMSNorm module) and lm_head (a module) too:
        lm_head on the packed kernel over the hidden size, the norm's epsilon the layer's."""
        packed = getattr(lm_head, "packed", None)
        return (packed is not None and packed.backend == "avx2" and packed.in_features == self.hidden
                and float(norm.eps) == self.eps and norm.weight.device.type == "cpu")

    def _table(self, norm, lm_head) -> _Eagle3:
        key = id(lm_head)
        if key not in self._heads:  # once per head; the norm weight and the module (so its id) kept alive here
            final = None if norm is None else norm.weight.detach().float().contiguous()
            head = _Lin() if lm_head is None else _lin(lm_head.packed)
            self._heads[key] = (_Eagle3(self.layer, _ptr(self.norms[1]), _ptr(final), head,
                                        int(self.norm_before_residual)), final, lm_head)
        return self._heads[key][0]


class _Block(ctypes.Structure):  # decoder.c's sp_block_t
    _fields_ = [("fc", _Lin), ("hidden_norm", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", _Lin),
                ("embed", _Embed), ("mask_embed", ctypes.c_void_p), ("mask_token", ctypes.c_int64),
                ("causal", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


class FusedBlock:
    """A block drafter's draft forward (drafters/block.py: its context rows, then its query blocks
    through its layers, final norm and lm_head) as two C calls, decoder.c's sp_block_context and
    sp_block_draft, in place of the fused layers with ~20 torch ops around them. Right after a
    weight stream (the target's forward, the drafter's own layers evict the caches) a small torch op
    costs 50-300 us instead of its 3-25 us (bench: a norm on 5 rows 18 -> 312 us after a 64 MB
    copy); the first ones pay most, so fewer ops save less than their count says: a DSpark step's
    drafting 3.6 -> 3.2 ms (chain of 5) and 3.7 -> 3.5 ms (tree) on the demo head, Zen 4. The rows
    are built from Python ints (a block's are regular: no mask, each row sees the whole block or
    the chain up to itself by its end), not as tensors."""

    def __init__(self, drafter, layers: FusedLayers):
        s, self.layers, self.lib = drafter.spec, layers, layers.lib
        self.spec = s
        self._keep = [t.detach().float().contiguous() for t in (drafter.hidden_norm.weight, drafter.norm.weight)]
        mask = drafter.mask_embedding
        self._mask = None if mask is None else mask.detach().float().contiguous()
        self._causal = (ctypes.c_uint8 * len(s.layer_causal))(*map(int, s.layer_causal))
        self.embed = drafter.embed_tokens  # kept alive: the table points into it
        self.head_rows = drafter.lm_head.out_features
        self.table = _Block(_lin(drafter.fc.packed), _ptr(self._keep[0]), _ptr(self._keep[1]),
                            _lin(drafter.lm_head.packed), embed_source(self.embed), _ptr(self._mask),
                            s.mask_token_id, ctypes.cast(self._causal, ctypes.c_void_p), None, None)
        self.tables = None  # the cos/sin tables the table points at (set_tables)
        self.scratch = torch.empty(0)

    @classmethod
    def of(cls, drafter) -> FusedBlock | None:
        """None unless the drafter's layers run fused, its fc and lm_head on the packed kernel and
        its embedding one decoder.c reads (embed_source: an fp32 table, GGUF blocks, a table in its file)."""
        layers = getattr(drafter, "fused", None)
        if not isinstance(layers, FusedLayers):
            return None
        linears = (drafter.fc, drafter.lm_head)
        if not (all(getattr(m, "packed", None) is not None and m.packed.backend == "avx2" for m in linears)
                and embed_source(drafter.embed_tokens) is not None):
            return None
        return cls(drafter, layers)

    def set_tables(self, cos: Tensor, sin: Tensor) -> None:
        """The drafter's RoPE tables [positions, hd] (fp32, contiguous; made again by its reserve)."""
        self.tables = (cos.float().contiguous(), sin.float().contiguous())
        self.table.cos, self.table.sin = (t.data_ptr() for t in self.tables)

    def context(self, feats: Tensor, segments: Sequence[tuple[int, int, int]], cache) -> Tensor:
        """New context rows: feats [R, F] the target's features of (slot, start, count) `segments`'
        positions -> ctx [R, hidden] (hidden_norm(fc(feats))), their keys and values written into
        `cache` for every layer."""
        slot, write = _rows(segments)
        self._check(cache, slot, write)
        R, L = len(slot), self.layers
        feats = feats.float().contiguous()
        ctx = torch.empty(R, L.hidden)
        f, arrays = self._forward(cache, slot, write, write, write)
        scratch = self._scratch(R * (2 * L.hd + L.hidden + (L.heads + 2 * L.kv_heads) * L.hd))
        self.lib.sp_block_context(L.table, len(self.spec.layer_causal), ctypes.byref(self.table), ctypes.byref(f),
                                  arrays[1], feats.data_ptr(), ctx.data_ptr(), scratch)
        return ctx

    def draft(self, blocks: Sequence[tuple[int, int, int]], first: int, slots: int, logit_rows: int, cache):
        """Query blocks of (slot, start, anchor token): [anchor, mask, ...] at start.. of each slot ->
        (hidden [J, slots, hidden] = the final norm of rows first..first+slots-1 of each block,
        logits [J, logit_rows, head] of the first logit_rows of them)."""
        T, L = self.spec.block_len, self.layers
        J = len(blocks)
        slot, write = _rows([(s, p, T) for s, p, _ in blocks])
        full = [p + T for _, p, _ in blocks for _ in range(T)]
        tokens = [t for *_, anchor in blocks for t in (anchor, *[self.spec.mask_token_id] * (T - 1))]
        starts = [p for _, p, _ in blocks for _ in range(T)]
        self._check(cache, slot, write, tokens)
        f, arrays = self._forward(cache, slot, write, starts, full)
        R = J * T
        hidden_rows = [j * T + first + q for j in range(J) for q in range(slots)]
        picked = [j * slots + q for j in range(J) for q in range(logit_rows)]
        x, hidden = torch.empty(R, L.hidden), torch.empty(J, slots, L.hidden)
        logits = torch.empty(J, logit_rows, self.head_rows)
        scratch = self._scratch(R * (2 * L.hd + L.width) + len(picked) * L.hidden)
        failed = self.lib.sp_block_draft(L.table, len(self.spec.layer_causal), ctypes.byref(self.table),
                                         ctypes.byref(f), _i64([w + 1 for w in write]), arrays[1], _i64(tokens),
                                         x.data_ptr(), _i64(hidden_rows), len(hidden_rows), hidden.data_ptr(),
                                         _i64(picked), len(picked), logits.data_ptr(), scratch)
        if failed:
            raise OSError("an embedding row of the block drafter could not be read: its table's file changed after "
                          "loading (load the artifact again)")
        return hidden, logits

    def _check(self, cache, slot, write, tokens=()) -> None:
        """The C calls index the cache, the RoPE tables and the embedding with these unchecked: an
        IndexError here, as the module path's torch indexing raises, and never a read or write past them."""
        k = cache.k
        positions = min(k.shape[3], len(self.tables[0]) if self.tables else 0)
        if slot and not (0 <= min(slot) and max(slot) < k.shape[1]):
            raise IndexError(f"slots {min(slot)}..{max(slot)} outside the drafter's cache of {k.shape[1]}")
        if write and not (0 <= min(write) and max(write) < positions):
            raise IndexError(f"positions {min(write)}..{max(write)} outside the drafter's {positions} (reserve more)")
        if tokens and not (0 <= min(tokens) and max(tokens) < self.table.embed.rows):
            raise IndexError(f"token ids {min(tokens)}..{max(tokens)} outside the drafter's embedding of "
                             f"{self.table.embed.rows} rows")

    def _forward(self, cache, slot, write, ctx, end) -> tuple:
        """(sp_forward_t over the rows, without a mask; the slot, write, ctx, end arrays it points at:
        keep them alive while it is used). cos/sin are filled by the C call (from write)."""
        L, k, v = self.layers, cache.k, cache.v
        arrays = [_i64(a) for a in (slot, write, ctx, end)]
        f = _Forward(L.hidden, L.heads, L.kv_heads, L.hd, L.inter, L.eps, L.scale, L.threads, k.data_ptr(),
                     v.data_ptr(), *k.stride()[:4], len(slot), None, None, *(ctypes.addressof(a) for a in arrays),
                     None, 0, int(k.dtype == torch.float16))
        return f, arrays

    def _scratch(self, floats: int) -> int:
        if self.scratch.numel() < floats:
            self.scratch = torch.empty(floats)
        return self.scratch.data_ptr()


def _rows(segments) -> tuple[list[int], list[int]]:
    """(slot, cache position) of every row of (slot, start, count) segments."""
    slot, write = [], []
    for s, start, n in segments:
        slot += [s] * n
        write += range(start, start + n)
    return slot, write


def _i64(values) -> ctypes.Array:
    return (ctypes.c_int64 * max(1, len(values)))(*values)
