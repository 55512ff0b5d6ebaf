"""The attention kernel (kernels/attention.c): close to float64 attention, and row-exact: a row's output
is bit-identical whether it is computed alone or with any other rows (rows of one sequence share
their keys in one work item, so how rows are grouped must not change a bit)."""

import pytest
import torch

from specpack.runtime.kernels import attention as ka

pytestmark = pytest.mark.skipif(not ka.available(), reason="CPU kernel unavailable")


def _case(seed: int, R: int, H: int, KVH: int, dk: int, dv: int, tree: bool):
    g = torch.Generator().manual_seed(seed)
    S, L = 3, 160
    kc = torch.randn(S, KVH, L, max(dk, dv), generator=g)
    vc = kc if dk != dv else torch.randn(S, KVH, L, dv, generator=g)  # MLA: one latent cache for both
    q = torch.randn(R, H, dk, generator=g)
    # runs of rows of one sequence (a verified draft, a prefill chunk), then single rows of others
    slot = torch.tensor([0] * (R // 2) + [int(i % 2 + 1) for i in range(R - R // 2)])
    ctx = torch.where(slot == 0, 40, torch.randint(0, 120, (R,), generator=g))
    end = ctx + 1 + torch.where(slot == 0, torch.arange(R), torch.randint(0, 9, (R,), generator=g))
    mask = (torch.rand(R, 32, generator=g) > 0.4) if tree else None
    if mask is not None:
        mask[0] = False  # a tree row that sees only the committed keys
    return q, kc, vc, slot, ctx, end, mask


@pytest.mark.parametrize("H, KVH, dk, dv", [(9, 3, 64, 64), (4, 4, 64, 64), (8, 1, 128, 128),
                                            (4, 2, 24, 24), (4, 1, 80, 72), (2, 2, 13, 13)])
@pytest.mark.parametrize("tree", [False, True])
def test_close_to_float64_and_every_row_as_if_alone(H, KVH, dk, dv, tree):
    q, kc, vc, slot, ctx, end, mask = _case(H * 100 + dk, 11, H, KVH, dk, dv, tree)
    scale = dk ** -0.5
    got = ka.attention(q, kc, vc, slot, ctx, end, mask, scale, dv=dv)
    want = ka.reference(q, kc, vc, slot, ctx, end, mask, scale, dv=dv)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    for r in range(len(q)):
        one = ka.attention(q[r:r + 1], kc, vc, slot[r:r + 1], ctx[r:r + 1], end[r:r + 1],
                           None if mask is None else mask[r:r + 1], scale, dv=dv)
        assert torch.equal(one[0], got[r]), r
    for a, b in [(0, 3), (2, 7), (5, 11)]:  # other groupings of the same rows
        part = ka.attention(q[a:b], kc, vc, slot[a:b], ctx[a:b], end[a:b],
                            None if mask is None else mask[a:b], scale, dv=dv)
        assert torch.equal(part, got[a:b]), (a, b)


def test_a_row_that_sees_nothing_gets_zeros():
    q, kc, vc, slot, ctx, end, mask = _case(1, 4, 4, 2, 16, 16, True)
    ctx[:], end[:] = 0, 3
    mask[:] = False
    mask[1, 0] = True  # row 1 sees its own first new key only
    out = ka.attention(q, kc, vc, slot, ctx, end, mask, 0.25)
    assert not out[[0, 2, 3]].any() and out[1].abs().sum() > 0


@pytest.mark.parametrize("H, KVH, dk, dv", [(9, 3, 64, 64), (8, 1, 128, 128), (4, 1, 80, 72), (2, 2, 13, 13)])
@pytest.mark.parametrize("tree", [False, True])
def test_an_fp16_cache_gives_the_bits_of_its_fp32_widening(H, KVH, dk, dv, tree):
    """Every fp16 element is widened exactly as it is loaded; nothing after depends on the type."""
    q, kc, vc, slot, ctx, end, mask = _case(H * 7 + dk, 11, H, KVH, dk, dv, tree)
    k16 = kc.half()
    v16 = k16 if vc is kc else vc.half()
    scale = dk ** -0.5
    got = ka.attention(q, k16, v16, slot, ctx, end, mask, scale, dv=dv)
    widened = ka.attention(q, k16.float(), v16.float(), slot, ctx, end, mask, scale, dv=dv)
    assert torch.equal(got, widened)
    for r in (0, 5, 10):  # row-exact on fp16 too
        one = ka.attention(q[r:r + 1], k16, v16, slot[r:r + 1], ctx[r:r + 1], end[r:r + 1],
                           None if mask is None else mask[r:r + 1], scale, dv=dv)
        assert torch.equal(one[0], got[r]), r


def test_key_and_value_caches_must_share_a_dtype():
    q, kc, vc, slot, ctx, end, mask = _case(2, 3, 4, 2, 16, 16, False)
    with pytest.raises(ValueError, match="dtype"):
        ka.attention(q, kc.half(), vc, slot, ctx, end, mask, 0.25)


@pytest.mark.parametrize("H, KVH, dk, dv", [(9, 3, 64, 64), (8, 1, 128, 128), (8, 2, 64, 64), (4, 1, 80, 72),
                                            (2, 2, 13, 13)])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("kv16", [False, True])
def test_the_avx512_loops_give_the_avx2_bits(H, KVH, dk, dv, tree, kv16):
    """Scores three queries at a time and value sums six query heads at a time (AVX-512) run each
    (query, key) through the same chains as the AVX2 loops: the same bits, for any head grouping."""
    from specpack.runtime.kernels._lib import _library

    lib = _library()[0]
    if not lib.sp_avx512():
        pytest.skip("this CPU has no AVX-512: only the AVX2 loops run")
    q, kc, vc, slot, ctx, end, mask = _case(H * 13 + dk, 11, H, KVH, dk, dv, tree)
    if kv16:
        kc, vc = kc.half(), (kc.half() if vc is kc else vc.half())
    scale = dk ** -0.5
    try:
        lib.sp_attention_avx512(0)
        avx2 = ka.attention(q, kc, vc, slot, ctx, end, mask, scale, dv=dv)
    finally:
        lib.sp_attention_avx512(1)
    assert torch.equal(ka.attention(q, kc, vc, slot, ctx, end, mask, scale, dv=dv), avx2)
