"""An fp16 KV cache for a float32 target (`--kv-cache fp16`): keys and values rounded to fp16 as they
are written, widened exactly as the attention kernel reads them. A request's greedy output is the
same alone, in any batch and with or without speculation (every drafter kind, with fp32 and w8a8
weights), verify rows equal one-token decoding bit for bit, the model stays close to its fp32
cache, the fallback without the kernel agrees, and the option is checked before loading."""

import functools

import pytest
import torch

from eagle_fixtures import one_thread  # noqa: F401
from specpack.errors import InputError
from specpack.runtime import kernels
from specpack.runtime.engine import Engine
from test_engine import alone, artifact, drive, requests

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernel: {kernels.unavailable_reason()}")


@functools.cache
def model(kind: str, weights: str = "fp32", kv_cache: str = "fp16"):
    import specpack

    return specpack.load(artifact(kind), weights=weights, kv_cache=kv_cache)


def test_the_target_cache_is_fp16_and_the_drafters_is_not():
    m = model("eagle3")
    m.target.setup_cache(32, 2)
    m.drafter.reserve(2, 32)
    assert m.target.cache.k.dtype == m.target.cache.v.dtype == torch.float16
    assert m.drafter.cache.k.dtype == torch.float32
    m.target.kv_dtype = None  # back to the model's dtype: the next setup reallocates
    m.target.setup_cache(32, 2)
    assert m.target.cache.k.dtype == torch.float32
    m.target.kv_dtype = torch.float16


@needs_kernel
@pytest.mark.parametrize("weights", ["fp32", "w8a8"])
@pytest.mark.parametrize("kind", ["ngram", "eagle3", "draft_model", "mtp-2"])
def test_batched_speculative_greedy_equals_plain_alone(kind, weights):
    m = model(kind, weights)
    reqs = requests(m)
    want = [alone(m, r) for r in reqs]  # one request at a time, no speculation
    engine = Engine(m.target, m.drafter, slots=3, max_len=64, prefill_chunk=5)
    got = drive(engine, {0: reqs[:2], 1: reqs[2:4], 4: reqs[4:]})
    assert m.target.cache.k.dtype == torch.float16
    assert [got[i] for i in range(len(reqs))] == want, (kind, weights)


@needs_kernel
@pytest.mark.parametrize("weights", ["fp32", "w8a8"])
def test_verify_rows_are_bit_identical_to_one_token_decoding(weights):
    target = model("ngram", weights).target
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 42, 11, 300, 12, 13])
    target.setup_cache(64)
    target(ids[:4])
    chunk = target(ids[4:]).logits
    target.cache.length = 4
    singles = torch.cat([target(ids[i: i + 1]).logits for i in range(4, len(ids))])
    assert torch.equal(chunk, singles)


def test_close_to_the_fp32_cache():
    """The logits move by at most 1% of their spread (measured on the tiny target: ~0.1%), and not 0:
    the cache really is rounded."""
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 42, 11, 300, 12, 13, 14, 15])
    ref, low = model("ngram", kv_cache="model").target, model("ngram").target
    for m in (ref, low):
        m.setup_cache(64)
    a, b = ref(ids).logits, low(ids).logits
    assert 0 < (a - b).abs().max() <= 0.01 * a.std()


def test_fallback_without_the_kernel_agrees(monkeypatch):
    """SPECPACK_KERNELS=0: torch writes the rounded keys and SDPA reads them widened: the kernel's
    logits up to summation order, and speculation still changes nothing."""
    import specpack

    monkeypatch.setenv("SPECPACK_KERNELS", "0")
    m = specpack.load(artifact("ngram"), kv_cache="fp16")
    prompt = [5, 17, 99, 3, 5, 17, 99, 3, 5, 17]
    assert m.generate(prompt, 24, draft_len=4).tokens == m.generate(prompt, 24, speculative=False).tokens
    assert m.target.cache.k.dtype == torch.float16
    if kernels.linear._library()[0] is not None:
        monkeypatch.delenv("SPECPACK_KERNELS")
        fast = model("ngram").target
        ids = torch.tensor([5, 17, 99, 3, 7, 8])
        for t in (fast, m.target):
            t.setup_cache(16)
        torch.testing.assert_close(fast(ids).logits, m.target(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options, problem", [
    ({"kv_cache": "int4"}, "unknown KV cache type"),
    ({"kv_cache": "fp16", "backend": "onnxruntime"}, "backend onnxruntime"),
    ({"kv_cache": "fp16", "dtype": "bfloat16"}, "dtype bfloat16"),
])
def test_the_option_is_checked_before_loading(options, problem):
    import specpack

    with pytest.raises(InputError) as err:
        specpack.load(artifact("ngram"), **options)
    assert problem in str(err.value) + " ".join(err.value.problems)


def test_an_mla_target_refuses():
    import specpack

    with pytest.raises(InputError, match="dense targets"):
        specpack.load(artifact("mtp-1"), kv_cache="fp16")


def test_the_memory_plan_counts_two_bytes_a_cached_value():
    from specpack.serving.serve import plan_kv
    from specpack.tuning.profiles import kv_and_weight_bytes

    m = model("eagle3")
    mem = m.manifest.memory
    _, full = kv_and_weight_bytes(m.manifest, "float32", 100)
    _, half = kv_and_weight_bytes(m.manifest, "float32", 100, "float16")
    assert full == (mem.target_kv_bytes_per_token + mem.drafter_kv_bytes_per_token) * 100
    assert half == (mem.target_kv_bytes_per_token // 2 + mem.drafter_kv_bytes_per_token) * 100
    assert plan_kv(m, "float32", 4, 64) == (4, 64)
