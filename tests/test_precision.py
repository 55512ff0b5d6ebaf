"""Half-precision and int8 weights (and int8 activations: w8a8) on the CPU kernels: at each precision a request's greedy output
is the same alone, in any batch and with or without speculation (every drafter kind), the model
stays close to fp32, and the options are checked up front."""

import functools

import pytest
import torch

from eagle_fixtures import one_thread  # noqa: F401
from specpack.errors import InputError
from specpack.runtime import kernels
from specpack.runtime.engine import Engine
from specpack.runtime.kernels.accelerate import PackedLinearModule
from test_engine import alone, artifact, drive, requests

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernel: {kernels.unavailable_reason()}")
PRECISIONS = ["fp16", "bf16", "int8", "w8a8"]  # bf16: on AMX tiles where the CPU has them


@functools.cache
def model(kind: str, weights: str):
    import specpack

    return specpack.load(artifact(kind), weights=weights)


@needs_kernel
@pytest.mark.parametrize("weights", PRECISIONS)
@pytest.mark.parametrize("kind", ["ngram", "eagle3", "draft_model", "mtp-2"])
def test_batched_speculative_greedy_equals_plain_alone(kind, weights):
    m = model(kind, weights)
    packed = [x for x in m.target.modules() if isinstance(x, PackedLinearModule)]
    # bf16: on AMX tiles where they run (every layer but the head), else the vector kernel
    formats = {weights, "bf16-amx"} if weights == "bf16" and kernels.linear.bf16_tiles() else {weights}
    assert packed and all(x.packed.weights in formats and x.packed.backend == "avx2" for x in packed)
    reqs = requests(m)
    want = [alone(m, r) for r in reqs]  # one request at a time, no speculation
    engine = Engine(m.target, m.drafter, slots=3, max_len=64, prefill_chunk=5)
    got = drive(engine, {0: reqs[:2], 1: reqs[2:4], 4: reqs[4:]})
    assert [got[i] for i in range(len(reqs))] == want, (kind, weights)


@needs_kernel
@pytest.mark.parametrize("weights", PRECISIONS)
def test_verify_rows_are_bit_identical_to_one_token_decoding(weights):
    """A verify forward over 7 tokens gives each row the logits decoding it alone gives, bit for bit."""
    target = model("ngram", weights).target
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 42, 11, 300, 12, 13])
    target.setup_cache(64)
    target(ids[:4])
    chunk = target(ids[4:]).logits
    target.cache.length = 4
    singles = torch.cat([target(ids[i: i + 1]).logits for i in range(4, len(ids))])
    assert torch.equal(chunk, singles)


@pytest.mark.parametrize("weights, bound", [("fp16", 0.01), ("bf16", 0.05), ("int8", 0.1), ("w8a8", 0.1)])
def test_close_to_fp32(weights, bound):
    """The logits stay near fp32's: the largest difference within 1% of their spread for fp16, 5%
    for bf16, 10% for int8 and w8a8 (measured on the tiny target: 0.2%, 1.2%, 4%, 4%)."""
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 42, 11, 300])
    ref, low = model("ngram", "fp32").target, model("ngram", weights).target
    for m in (ref, low):
        m.setup_cache(64)
    a, b = ref(ids).logits, low(ids).logits
    assert 0 < (a - b).abs().max() <= bound * a.std()


@pytest.mark.parametrize("weights", ["int8", "w8a8"])
def test_fallback_without_the_kernel_keeps_the_precision(monkeypatch, weights):
    """SPECPACK_KERNELS=0: the layers run F.linear on the rounded (dequantized) weights (w8a8: the
    kernel's int8 arithmetic in torch): the same logits as the kernel up to summation order, and
    speculation still changes nothing."""
    import specpack

    monkeypatch.setenv("SPECPACK_KERNELS", "0")
    m = specpack.load(artifact("ngram"), weights=weights)
    packed = [x for x in m.target.modules() if isinstance(x, PackedLinearModule)]
    assert packed and all(x.packed.backend == "torch" for x in packed)
    prompt = [5, 17, 99, 3, 5, 17, 99, 3, 5, 17]
    assert m.generate(prompt, 24, draft_len=4).tokens == m.generate(prompt, 24, speculative=False).tokens
    if kernels.linear._library()[0] is not None:
        monkeypatch.delenv("SPECPACK_KERNELS")
        fast = model("ngram", weights).target
        ids = torch.tensor([5, 17, 99, 3])
        for t in (fast, m.target):
            t.setup_cache(16)
        torch.testing.assert_close(fast(ids).logits, m.target(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options, problem", [
    ({"weights": "int4"}, "unknown weight precision"),
    ({"weights": "bf16", "backend": "onnxruntime"}, "backend onnxruntime"),
    ({"weights": "int8", "dtype": "bfloat16"}, "dtype bfloat16"),
])
def test_weights_option_is_checked_before_loading(options, problem):
    import specpack

    with pytest.raises(InputError) as err:
        specpack.load(artifact("ngram"), **options)
    assert problem in str(err.value) + " ".join(err.value.problems)


@needs_kernel
def test_a_bf16_checkpoint_loads_as_stored_and_bf16_weights_are_exact(tmp_path):
    """A checkpoint stored in bf16 with `weights="bf16"`: the linear layers are packed from the
    stored values (no fp32 copy of the model), the rest is widened to fp32, and the logits are
    bit-identical to running the fp32 kernel on the same (widened) weights; on AMX tiles (whose
    activations carry 16 significant bits) within 1e-4 of them, and greedy output the same."""
    import specpack
    import tiny
    from specpack.packager import BuildOptions, NgramParams, build

    src = tmp_path / "bf16-target"
    tiny.build_model("llama").to(torch.bfloat16).save_pretrained(src, safe_serialization=True)
    tiny.make_tokenizer(src, tiny.VOCAB)
    art = build(BuildOptions(target=src, drafter="ngram", out=tmp_path / "art", ngram=NgramParams(1, 3, 4))).out
    half, full = specpack.load(art, weights="bf16"), specpack.load(art)
    packed = [m for m in half.target.modules() if isinstance(m, PackedLinearModule)]
    tiles = kernels.linear.bf16_tiles()
    assert packed
    for name, m in half.target.named_modules():
        if isinstance(m, PackedLinearModule):  # the head keeps the vector kernel (the greedy screen's)
            assert m.packed.weights == ("bf16-amx" if tiles and name != "lm_head" else "bf16"), name
            assert m.weight.dtype == torch.bfloat16, name
    rest = [t for m in half.target.modules() if not isinstance(m, PackedLinearModule)
            for t in [*m._parameters.values(), *m._buffers.values()] if t is not None and t.is_floating_point()]
    assert rest and all(t.dtype == torch.float32 for t in rest) and half.target.fused is not None
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 42])
    for m in (half, full):
        m.target.setup_cache(32)
    got, want = half.target(ids).logits, full.target(ids).logits
    if tiles:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    else:
        assert torch.equal(got, want)
    prompt = [5, 17, 99, 3, 5, 17, 99, 3]
    assert half.generate(prompt, 16, draft_len=3).tokens == full.generate(prompt, 16, speculative=False).tokens
