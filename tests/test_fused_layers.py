"""Fused decoder layers (kernels/layers.c): the same model, a few C calls per layer. RoPE and the
cache write give torch's bits; RMSNorm and SiLU stay within fp32 rounding of torch's; the whole
forward stays within 1e-5 of the module path for every dense family and is row-exact."""

import pytest
import torch
import torch.nn.functional as F

import tiny
from eagle_fixtures import one_thread  # noqa: F401
from specpack.runtime import kernels
from specpack.runtime.kernels import layers as kf
from specpack.runtime.kernels._lib import _library
from specpack.runtime.kernels.accelerate import use_cpu_kernels
from specpack.runtime.models.dense import RMSNorm, apply_rope, rope_tables, rope_inv_freq
from specpack.runtime.models.weights import load_target

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernel: {kernels.unavailable_reason()}")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hd", [16, 12])
def test_rope_and_cache_write_are_torchs_bits(cache_dtype, hd):
    """The rotation and the cache write equal torch's ops, the fp16 cache's rounding included."""
    torch.manual_seed(0)
    R, H, KVH, S, L = 5, 4, 2, 3, 12
    cos, sin = rope_tables(rope_inv_freq(hd, 10000.0, None), L, torch.float32, "cpu")
    qkv = torch.randn(R, (H + 2 * KVH) * hd) * 3
    qkv[0, -3:] = torch.tensor([70000.0, 1e-6, -2.0**-20])  # fp16 overflow and subnormals round as torch rounds them
    pos, slot, write = torch.tensor([3, 0, 7, 11, 4]), torch.tensor([0, 2, 1, 1, 2]), torch.tensor([2, 9, 0, 5, 1])
    kc, vc = torch.zeros(S, KVH, L, hd, dtype=cache_dtype), torch.zeros(S, KVH, L, hd, dtype=cache_dtype)
    q, k, v = qkv.clone().split([H * hd, KVH * hd, KVH * hd], -1)
    c, s = cos[pos][:, None], sin[pos][:, None]
    want_q, want_k = apply_rope(q.reshape(R, H, hd), c, s), apply_rope(k.reshape(R, KVH, hd), c, s)
    cr, sr = cos[pos].contiguous(), sin[pos].contiguous()
    _library()[0].sp_rope_cache(qkv.data_ptr(), R, qkv.shape[1], H, KVH, hd, cr.data_ptr(), sr.data_ptr(), hd,
                                None, None, 0.0, kc.data_ptr(), vc.data_ptr(), int(cache_dtype == torch.float16),
                                *kc.stride()[:3], slot.data_ptr(), write.data_ptr())
    assert torch.equal(qkv[:, : H * hd].reshape(R, H, hd), want_q)
    want_v = v.reshape(R, KVH, hd).to(cache_dtype)
    assert torch.equal(kc[slot, :, write], want_k.to(cache_dtype)) and torch.equal(vc[slot, :, write], want_v)
    untouched = torch.ones(S, L, dtype=torch.bool)
    untouched[slot, write] = False
    assert not kc.permute(0, 2, 1, 3)[untouched].any()


def test_rmsnorm_and_silu_mul_within_rounding_of_torch():
    torch.manual_seed(1)
    lib = _library()[0]
    for n in (576, 64, 37):
        x, w = torch.randn(7, n) * 3, torch.randn(n)
        norm = RMSNorm(n, 1e-5)
        norm.weight.data = w
        y = torch.empty_like(x)
        lib.sp_rmsnorm(x.data_ptr(), 7, n, n, w.data_ptr(), 1e-5, y.data_ptr(), n)
        torch.testing.assert_close(y, norm(x), rtol=3e-7, atol=1e-7)
        gu = torch.randn(7, 2 * n) * 4
        gu[0, 0], gu[0, 1] = -200.0, 200.0  # exp over- and underflow stay finite
        m = torch.empty(7, n)
        lib.sp_silu_mul(gu.data_ptr(), 7, n, 2 * n, m.data_ptr(), n)
        g, u = gu.chunk(2, -1)
        torch.testing.assert_close(m, F.silu(g) * u, rtol=1e-6, atol=1e-6)


def test_fused_layers_run_on_the_threads_of_their_own_weight_format(tmp_path):
    """Not on the thread count of the format tuned last in the process (the greedy screen's w8a8
    head, after the model's own: one thread chosen for it once ran every layer on one)."""
    from specpack.runtime.kernels import _lib

    model = load_target(tiny.make_target(tmp_path / "llama", "llama"))
    use_cpu_kernels(model)
    linears = [lin for b in model.layers for lin in kf._linears(b.self_attn, b.mlp)]
    for lin in linears:
        lin.packed.threads = 2
    try:
        _lib.set_tuned_threads(None)
        _lib.set_tuned_threads(1)
        assert kf.FusedLayers.of(model.spec, model.layers).threads == 2
        linears[-1].packed.threads = 3
        assert kf.FusedLayers.of(model.spec, model.layers).threads == 3
    finally:
        _lib.set_tuned_threads(None)


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_fused_forward_matches_the_module_path(tmp_path, family):
    """Same weights, same cache positions: fused logits within 1e-5 of the module path's, and a
    verify block of rows bit-identical to decoding them one at a time."""
    model = load_target(tiny.make_target(tmp_path / family, family))
    threads = torch.get_num_threads()
    use_cpu_kernels(model)
    torch.set_num_threads(threads)
    assert isinstance(model.fused, kf.FusedLayers)
    fused, ids = model.fused, torch.tensor([5, 17, 99, 3, 250, 7, 42, 11, 300, 12])
    model.setup_cache(32)
    got = model(ids).logits
    model.fused, model.cache.length = None, 0
    want = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    model.fused, model.cache.length = fused, 0
    model(ids[:4])
    block = model(ids[4:]).logits
    model.cache.length = 4
    assert torch.equal(block, torch.cat([model(ids[i: i + 1]).logits for i in range(4, len(ids))]))



def test_captured_layers_are_copied_within_one_c_call_without_changing_a_bit(tmp_path):
    """A forward that captures hidden states for a drafter is still one C call (each return to
    Python waits for the GIL behind a server's HTTP threads); the logits are the same bits with or
    without captures, each captured state is the module path's input of that layer (the last id:
    the output), in the order asked, repeats included; ids past the layers are refused."""
    model = load_target(tiny.make_target(tmp_path / "t", "qwen3"))
    threads = torch.get_num_threads()
    use_cpu_kernels(model)
    torch.set_num_threads(threads)
    ids, n = torch.tensor([5, 17, 99, 3, 250, 7]), len(model.layers)
    model.setup_cache(16)
    whole = model(ids).logits
    calls = []
    real = model.fused.lib

    class Counting:
        def __getattr__(self, name):
            fn = getattr(real, name)
            return (lambda *a: calls.append(a) or fn(*a)) if name == "sp_decoder_layers" else fn

    model.fused.lib = Counting()
    for capture in ([0], [n - 1, 1], list(range(n + 1)), [n, 0, n]):
        model.cache.length, calls[:] = 0, []
        out = model(ids, capture=capture)
        assert len(calls) == 1 and torch.equal(out.logits, whole)
        fused, model.fused, model.cache.length = model.fused, None, 0
        want = model(ids, capture=capture).aux
        model.fused = fused
        torch.testing.assert_close(out.aux, want, atol=1e-5, rtol=0)
    model.fused.lib = real
    with pytest.raises(ValueError, match="capture layers"):
        model.fused.layers(torch.zeros(2, model.spec.hidden_size), None, 0, n, [n + 1], torch.empty(2, 0))


def test_fused_layers_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPACK_FUSED", "0")
    model = load_target(tiny.make_target(tmp_path / "t", "llama"))
    threads = torch.get_num_threads()
    assert use_cpu_kernels(model) > 0
    torch.set_num_threads(threads)
    assert model.fused is None


@pytest.mark.parametrize("before_residual", [False, True])
def test_the_eagle3_heads_fused_layer_matches_its_module_path(before_residual):
    """The head's layer as kernel calls: within 1e-5 of the module path on a batch of draft rows
    (three sequences, one with a prefix in its cache, one a tree block), the cache written the same,
    and each row what it is alone (row-exact)."""
    import specpack
    from specpack.runtime.models.rows import Rows, Segment
    from test_engine import artifact

    m = specpack.load(artifact("eagle3"))
    with torch.inference_mode():
        _eagle3_layer_both_ways(m.drafter, before_residual)


def _eagle3_layer_both_ways(d, before_residual: bool) -> None:
    from specpack.runtime.models.rows import Rows, Segment

    layer = d.layers[0]
    layer.norm_before_residual = before_residual
    assert layer.fuse_layers() and isinstance(layer.fused, kf.FusedEagle3Layer)
    g = torch.Generator().manual_seed(3)
    H = d.spec.hidden_size
    block = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    segs = [Segment(0, 5, 2), Segment(2, 0, 1), Segment(1, 9, 3, block, torch.tensor([9, 10, 10]))]
    rows = Rows.of(segs, "cpu")
    emb, h = torch.randn(6, H, generator=g), torch.randn(6, H, generator=g)
    d.reserve(3, 32)
    warm = torch.randn(d.cache.k[0].shape, generator=g)  # [slots, kv heads, positions, hd]: earlier positions
    outs, caches = [], []
    for fused in (layer.fused, None):
        d.cache.k[0].copy_(warm)
        d.cache.v[0].copy_(d.cache.k[0] * 0.5)
        layer.fused = fused
        outs.append(layer(emb, h, d.cos[rows.pos, None], d.sin[rows.pos, None], d.cache.k[0], d.cache.v[0], rows))
        caches.append(d.cache.k[0].clone())
        if fused is not None:
            kept = fused
    layer.fused = kept
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    assert torch.equal(caches[0], caches[1])  # RoPE and the cache write are torch's bits
    alone = Rows.of([Segment(2, 0, 1)], "cpu")
    one = layer(emb[2:3], h[2:3], d.cos[alone.pos, None], d.sin[alone.pos, None], d.cache.k[0], d.cache.v[0], alone)
    assert torch.equal(one[0], outs[0][2])
    layer.norm_before_residual = d.spec.norm_before_residual
    layer.fuse_layers()


def test_the_eagle3_heads_whole_step_is_one_call_matching_its_module_path():
    """`_forward` with the layer, final norm and lm_head in one C call (FusedEagle3Layer.step): the
    layer's output bit for bit what the layer alone gives, the logits of the picked rows within fp32
    rounding of the module path, each row what it is alone; a logit row outside the rows is refused."""
    from test_engine import artifact

    import specpack
    from specpack.runtime.models.rows import Rows, Segment

    d = specpack.load(artifact("eagle3")).drafter
    layer = d.layers[0]
    assert layer.fused is not None and layer.fused.head_fuses(d.norm, d.lm_head)
    g = torch.Generator().manual_seed(5)
    H = d.spec.hidden_size
    block = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    rows = Rows.of([Segment(0, 5, 2), Segment(2, 0, 1), Segment(1, 9, 3, block, torch.tensor([9, 10, 10]))], "cpu")
    h, tokens = torch.randn(6, H, generator=g), torch.randint(0, d.spec.target_vocab_size, (6,), generator=g)
    picked = [1, 2, 4, 5]
    d.reserve(3, 32)
    warm = torch.randn(d.cache.k[0].shape, generator=g)
    results = []
    with torch.inference_mode():
        for fused in (layer.fused, None):
            d.cache.k[0].copy_(warm)
            d.cache.v[0].copy_(warm * 0.5)
            kept, layer.fused = layer.fused, fused
            results.append(d._forward(h, tokens, rows, picked))
            layer.fused = kept
        (out, logits), (ref_out, ref_logits) = results
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        d.cache.k[0].copy_(warm)
        d.cache.v[0].copy_(warm * 0.5)
        alone = Rows.of([Segment(2, 0, 1)], "cpu")
        one_out, one_logits = d._forward(h[2:3], tokens[2:3], alone, [0])
        assert torch.equal(one_out[0], out[2]) and torch.equal(one_logits[0], logits[1])
        with pytest.raises(ValueError, match="logit rows"):
            layer.fused.step(d.embed_tokens(tokens), h, d.cos[rows.pos, None], d.sin[rows.pos, None],
                             d.cache.k[0], d.cache.v[0], rows, [6], d.norm, d.lm_head)


@pytest.mark.parametrize("table", ["file", "blocks", "module"])
def test_the_eagle3_greedy_chain_in_one_call_drafts_what_the_step_loop_drafts(table, monkeypatch):
    """After its first step a greedy EAGLE-3 chain runs as one C call (FusedEagle3Layer.chain: embedding row,
    layer, norm, lm_head, argmax, draft-to-target map, per step): the same drafts and the same cache as the
    Python loop of fused steps, for three sequences drafting 3, 1 and 4 tokens, whichever table the token
    embeddings come from (the target's fp32 table left in its file, GGUF blocks, an fp32 module)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    import specpack
    from specpack.runtime.drafters.base import DraftJob
    from specpack.runtime.kernels.gguf import BlockEmbedding, Blocks
    from test_engine import artifact

    d = specpack.load(artifact("eagle3")).drafter
    dense = d.embed_tokens.weight.detach().clone()
    if table == "blocks":
        raw = torch.from_numpy(quantize(dense.numpy().astype(np.float32), GGMLQuantizationType.Q8_0))
        object.__setattr__(d, "embed_tokens", BlockEmbedding(Blocks.of("Q8_0", raw, dense.shape[1])))
    elif table == "module":
        object.__setattr__(d, "embed_tokens", torch.nn.Embedding.from_pretrained(dense))
    else:
        assert d.embed_tokens.pread_source is not None
    g = torch.Generator().manual_seed(11)
    F_ = len(d.spec.aux_layer_ids) * d.spec.target_hidden_size
    V = d.spec.target_vocab_size
    jobs = [DraftJob(slot, torch.randint(0, V, (n,), generator=g), torch.randn(r, F_, generator=g), k, None)
            for slot, n, r, k in ((2, 9, 3, 3), (0, 5, 2, 1), (1, 7, 7, 4))]
    steps = []
    monkeypatch.setattr(d.layers[0].fused, "step", _counting(d.layers[0].fused.step, steps))
    results = {}
    with torch.inference_mode():
        for flag in ("1", "0"):
            monkeypatch.setenv("SPECPACK_EAGLE3_CHAIN", flag)
            d.reserve(3, 32)
            steps.clear()
            drafts = d.draft(jobs)
            results[flag] = ([x.tokens.tolist() for x in drafts], d.cache.k[0].clone(), len(steps))
    (chain, chain_cache, chain_steps), (loop, loop_cache, loop_steps) = results["1"], results["0"]
    assert [len(x) for x in chain] == [3, 1, 4] and chain == loop
    assert torch.equal(chain_cache, loop_cache)
    assert (chain_steps, loop_steps) == (1, 4)  # the first step from Python, then one call (the loop: 3 more)


def _counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return counted
