"""The torch backend on CPU runs its linear layers on the packed kernel: same logits, lossless."""

import pytest
import torch

from specpack.packager import BuildOptions, NgramParams, build
from specpack.runtime import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernel: {kernels.unavailable_reason()}")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("acc") / "art"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=out, ngram=NgramParams(1, 3, 6)))
    return out


def _load(artifact, cpu_kernels):
    from specpack.packager import verify
    from specpack.runtime import backends

    threads = torch.get_num_threads()
    try:
        return backends.load("torch", artifact, verify(artifact).manifest, cpu_kernels=cpu_kernels)
    finally:
        torch.set_num_threads(threads)


def test_every_linear_is_packed_and_logits_match(artifact):
    from specpack.runtime.kernels.accelerate import PackedLinearModule

    (fast, _), (ref, _) = _load(artifact, True), _load(artifact, False)
    assert not any(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert sum(isinstance(m, PackedLinearModule) for m in fast.modules()) == 8 * 4 + 1
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 42, 11, 300])
    for model in (fast, ref):
        model.setup_cache(64)
    torch.testing.assert_close(fast(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)


def test_verify_rows_match_one_token_decoding(artifact):
    """Projections are bit-identical across row counts (tests/test_kernels.py); attention over a
    block of T queries may round differently from one query at a time, by a few ulps."""
    (fast, _) = _load(artifact, True)
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 42, 11, 300, 12, 13])
    fast.setup_cache(64)
    fast(ids[:4])
    chunk = fast(ids[4:]).logits  # one verify forward over 7 tokens
    fast.cache.length = 4
    singles = torch.cat([fast(ids[i : i + 1]).logits for i in range(4, len(ids))])
    assert (chunk - singles).abs().max() < 1e-5


def test_greedy_speculative_equals_plain_with_kernels(artifact):
    import specpack

    model = specpack.load(artifact)
    prompt = [5, 17, 99, 3, 5, 17, 99, 3, 5, 17]
    for draft_len in (1, 3, 6, 8):
        spec = model.generate(prompt, max_new_tokens=40, draft_len=draft_len)
        plain = model.generate(prompt, max_new_tokens=40, speculative=False)
        assert spec.tokens == plain.tokens


def test_fp32_layers_holding_16_bit_values_stream_16_bits_for_the_same_bits():
    """A head stored in fp16 and widened at load (the shipped drafters) is packed as fp16 panels:
    the kernel widens them back to the same fp32 values, so outputs equal the fp32 packing bit for
    bit at half the bytes; bf16-valued weights alike; genuine fp32 weights stay fp32."""
    from specpack.runtime.kernels.accelerate import PackedLinearModule, exact_format, use_cpu_kernels

    torch.manual_seed(0)
    fp32 = torch.randn(96, 64)
    # bf16 values inside fp16's range are fp16 values too (fp16 is taken first): these are beyond it
    stored = {"fp16": fp32.half().float(), "bf16": (fp32 * 1e6).bfloat16().float(), "fp32": fp32}
    x = torch.randn(5, 64)
    for name, w in stored.items():
        assert exact_format(w) == name
        model = torch.nn.Sequential(torch.nn.Linear(64, 96))
        model[0].weight.data.copy_(w)
        want = kernels.pack(w, model[0].bias.detach(), weights="fp32")(x)
        threads = torch.get_num_threads()
        try:
            assert use_cpu_kernels(model) == 1
        finally:
            torch.set_num_threads(threads)
        assert isinstance(model[0], PackedLinearModule) and model[0].packed.weights == name
        assert torch.equal(model[0](x), want), name
        assert torch.equal(model[0].dense_weight(), w)
