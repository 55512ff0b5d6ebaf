"""GGUF blocks on the CPU kernels without widening: Q4_0 / Q4_1 as w4a8 panels (w4a8.c), Q8_0 as w8a8
panels. Each against gguf-py's dequantization of the same blocks and the torch fallback (the same
arithmetic, bit for bit), row-exact, on both tile sets."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from specpack.families import gguf_blocks as gb
from specpack.runtime.kernels import linear as kl
from specpack.runtime.kernels.linear import PackedLinear

ISAS = {"avx2": {"isa": "avx2", "isa_few": "avx2"}, "avx512": {"isa": "avx512", "isa_few": "avx512"}}


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.delenv("SPECPACK_KERNELS", raising=False)
    yield
    kl._library.cache_clear()


def blocks(kind: str, n: int, k: int, seed: int = 0):
    if kind in ("Q4_K", "Q5_K", "Q6_K"):  # gguf-py cannot quantize K-quants: random blocks (test_gguf_blocks' generator)
        from test_gguf_blocks import random_blocks

        raw = random_blocks(kind, n, k, seed)
    else:
        w = np.random.default_rng(seed).normal(0, 0.05, size=(n, k)).astype(np.float32)
        raw = gguf_quantize(w, GGMLQuantizationType[kind])
    return torch.from_numpy(raw), torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k))


def layer(kind: str, raw: torch.Tensor, n: int, k: int, bias=None, tuned=None) -> PackedLinear:
    a = gb.decode(kind, raw, k)
    q = a.q.view(n, k // 32, 32)
    if kind == "Q8_0":
        return PackedLinear.of_panels(kl.pack_q8_blocks(q, a.scale), "w8a8", (n, k), bias, tuned=tuned)
    if kind == "Q5_0":
        panels = kl.pack_w5a8((a.q.view(n, k // 32, 32).to(torch.int16) + 16).to(torch.uint8), a.scale)
        return PackedLinear.of_panels(panels, "w5a8s", (n, k), bias, tuned=tuned)
    if kind == "Q5_1":
        panels = kl.pack_w5a8(a.q.view(n, k // 32, 32), a.scale, a.min)
        return PackedLinear.of_panels(panels, "w5a8", (n, k), bias, tuned=tuned)
    if kind == "Q5_K":
        panels = kl.pack_w5a8(a.q.view(n, k // 32, 32), a.scale, a.min, wide=True)
        return PackedLinear.of_panels(panels, "w5a8k", (n, k), bias, tuned=tuned)
    if kind == "Q6_K":
        halves = a.scale.view(n, -1, 2)
        panels = kl.pack_w6a8((a.q.view(n, k // 32, 32).to(torch.int16) + 32).to(torch.uint8), halves[..., 0],
                              halves[..., 1])
        return PackedLinear.of_panels(panels, "w6a8", (n, k), bias, tuned=tuned)
    wide, sym = kind == "Q4_K", kind == "Q4_0"
    fmt = "w4a8k" if wide else "w4a8s" if sym else "w4a8"
    return PackedLinear.of_panels(kl.pack_w4a8(q, a.scale, None if sym else a.min, wide=wide), fmt, (n, k), bias,
                                  tuned=tuned)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_K", "Q5_1"])
def test_the_kernel_computes_with_gguf_pys_values(kind):
    n, k = 45, 256 if kind.endswith("_K") else 96  # a partial last panel
    raw, dense = blocks(kind, n, k)
    lin = layer(kind, raw, n, k)
    assert torch.equal(lin.dense(), dense)  # the values the kernel multiplies: exactly gguf-py's
    x = torch.randn(7, k)
    exact = x.double() @ dense.double().T
    scale = x.double().abs() @ dense.double().abs().T
    # int8 activations (amax / 127 per 32: at most half a step off each) bound the error
    assert ((lin(x).double() - exact).abs() <= scale / 127 * 0.5 + 1e-6).all()


def test_q8_0_blocks_are_the_panels_w8a8_packs_from_their_values():
    raw, dense = blocks("Q8_0", 40, 128)
    a = gb.decode("Q8_0", raw, 128)
    assert torch.equal(kl.pack_q8_blocks(a.q.view(40, 4, 32), a.scale), kl.pack_w8a8(dense))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q5_K", "Q5_1"])
def test_fallback_is_the_kernel_arithmetic_on_both_tile_sets(kind, monkeypatch):
    if not kl.available():
        pytest.skip(kl.unavailable_reason())
    torch.manual_seed(3)
    n, k = 70, 768
    raw, _ = blocks(kind, n, k, seed=5)
    bias, x, r = torch.randn(n), torch.randn(9, k), torch.randn(9, n)
    outs = {isa: layer(kind, raw, n, k, bias, tuned=t)(x, residual=r) for isa, t in ISAS.items()}
    if kl._library()[0].sp_vnni():
        assert torch.equal(outs["avx2"], outs["avx512"])
    monkeypatch.setenv("SPECPACK_KERNELS", "0")
    kl._library.cache_clear()
    fallback = layer(kind, raw, n, k, bias)
    assert fallback.backend == "torch"
    assert torch.equal(fallback(x, residual=r), outs["avx2"])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q5_K", "Q5_1"])
@pytest.mark.parametrize("isa", list(ISAS))
def test_rows_are_exact_whatever_their_number(isa, kind):
    if not kl.available():
        pytest.skip(kl.unavailable_reason())
    n, k = 200, 512
    raw, _ = blocks(kind, n, k, seed=2)
    lin = layer(kind, raw, n, k, tuned=ISAS[isa])
    x = torch.randn(17, k)
    y = lin(x)
    for m in (1, 2, 3, 4, 5, 9, 16):  # every tile shape: 4 rows of two panels at once, 6 of one, ...
        assert torch.equal(lin(x[:m]), y[:m]), m
    assert all(torch.equal(lin(x[i:i + 1]), y[i:i + 1]) for i in range(17))


def test_panels_round_trip_and_refuse_what_they_cannot_hold():
    raw, dense = blocks("Q4_1", 20, 64)
    a = gb.decode("Q4_1", raw, 64)
    panels = kl.pack_w4a8(a.q.view(20, 2, 32), a.scale, a.min)
    assert panels.shape == (2, 2, kl.W4_BLOCK_BYTES)
    u, d, m = kl.w4a8_values(panels)
    assert torch.equal(u[:20].to(torch.uint8), a.q.view(20, 2, 32)) and torch.equal(d[:20], a.scale)
    assert torch.equal(kl.unpack(panels, "w4a8", 20, 64), dense)
    with pytest.raises(ValueError, match="fp16"):
        kl.pack_w4a8(a.q.view(20, 2, 32), a.scale * (1 + 2 ** -20), a.min)
    with pytest.raises(TypeError, match=r"uint8 \[2, 2, 320\]"):
        PackedLinear.of_panels(panels[:, :1], "w4a8", (20, 64))
    with pytest.raises(TypeError, match="packed from GGUF"):
        PackedLinear(dense, weights="w4a8")


@pytest.mark.parametrize("kind", list(gb.TYPES))
def test_an_embedding_of_blocks_looks_rows_up_with_gguf_pys_values(kind, monkeypatch):
    from specpack.runtime.kernels.gguf import BlockEmbedding, Blocks

    n, k = 40, 512
    raw, dense = blocks(kind, n, k, seed=7)
    ids = torch.tensor([[3, 0, 39], [17, 17, 5]])
    emb = BlockEmbedding(Blocks.of(kind, raw, k))
    got = emb(ids)
    assert torch.equal(got, dense[ids]) and torch.equal(got, gb.dequantize(kind, raw, k)[ids])
    for bad in (40, -1):
        with pytest.raises(IndexError, match=f"token id {bad} is outside the 40-row"):
            emb(torch.tensor([1, bad]))
    monkeypatch.setenv("SPECPACK_KERNELS", "0")  # the torch path: the same values
    kl._library.cache_clear()
    assert torch.equal(BlockEmbedding(Blocks.of(kind, raw, k))(ids), got)
