"""import-gguf keeps a file's quantized tensors as llama.cpp's blocks (issue 51), and the runtime decodes them
as they are: the bytes are the file's, the values gguf-py's, the output that of the same arithmetic, and
speculative greedy output equals plain output at that precision."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import eagle_fixtures as ef
import tiny
from gguf_fixtures import write_llama_gguf
from specpack.runtime.kernels import linear as kl
from specpack.converters.gguf import gguf_name, import_gguf, unpermute_rotary
from specpack.errors import ConversionError, InputError, UnsupportedError
from specpack.runtime.kernels.accelerate import PackedLinearModule
from specpack.runtime.kernels.gguf import BlockEmbedding
from specpack.runtime.spec_model import SpecModel, load_drafter, load_target

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
KEPT = {r"token_embd|^output\.": T.Q8_0, r"attn_q\.": T.Q4_0, r"blk\.5\.ffn_down": T.Q8_0, r"blk\.4\.ffn_down": T.Q5_0,
        r"blk\.3\.ffn_down": T.Q5_1, r"attn_|ffn_": T.Q4_1}
NEW = 24


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny Llama the trained EAGLE-3 head follows, as a GGUF of Q4_0 / Q4_1 / Q8_0 tensors, imported
    kept and dequantized."""
    root = tmp_path_factory.mktemp("kept")
    tok = root / "tok"
    tiny.make_tokenizer(tok)
    path = write_llama_gguf(root / "model.gguf", tiny.build_model("llama"), tok, types=KEPT)
    import_gguf(path, root / "kept", progress=False)
    import_gguf(path, root / "f32", progress=False, dequantize=True)
    return path, root / "kept", root / "f32"


def test_the_blocks_are_the_files_bytes(files):
    path, kept, _ = files
    types = json.loads((kept / "config.json").read_text())["quantization_config"]
    assert types["quant_method"] == "gguf"
    reader = gguf.GGUFReader(path)
    cfg = json.loads((kept / "config.json").read_text())
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    with safe_open(kept / "model.safetensors", framework="np") as f:
        stored = {n: f.get_tensor(n) for n in f.keys()}
    by_gguf = {t.name: t for t in reader.tensors}
    assert types["tensor_types"]["model.embed_tokens.weight"] == "Q8_0"
    assert types["tensor_types"]["model.layers.0.self_attn.q_proj.weight"] == "Q4_0"
    for name, kind in types["tensor_types"].items():
        gname = gguf_name(name)
        t = by_gguf[gname]
        assert t.tensor_type.name == kind and stored[name].dtype == np.uint8
        want = np.asarray(t.data)
        leaf = gname.split(".")[-2]
        if leaf in heads:
            want = unpermute_rotary(want, heads[leaf])  # whole rows of blocks move
        assert np.array_equal(stored[name], want), name
    quantized = sum(int(t.data.nbytes) for t in reader.tensors)
    assert (kept / "model.safetensors").stat().st_size <= 1.25 * quantized


def test_the_target_computes_with_the_files_values(files):
    _, kept, f32 = files
    q, ref = load_target(kept), load_target(f32)
    layer = q.layers[0].self_attn.qkv_proj
    assert isinstance(layer, PackedLinearModule) and layer.packed.weights == "w4a8"
    down = [q.layers[i].mlp.down_proj.packed.weights for i in range(6)]
    assert down == ["w4a8"] * 3 + ["w5a8", "w5a8s", "w8a8"]  # Q5_1, Q5_0 at their 6 and 5.5 bits, Q8_0 on int8
    for i in (3, 4):
        assert torch.equal(q.layers[i].mlp.down_proj.dense_weight(), ref.layers[i].mlp.down_proj.weight)
    assert q.lm_head.packed.weights == "w8a8"  # a Q8_0 head: llama.cpp's Q8_0 x Q8_0
    assert torch.equal(layer.dense_weight(), ref.layers[0].self_attn.qkv_proj.weight)
    assert torch.equal(q.lm_head.dense_weight(), ref.lm_head.weight)
    rows = torch.tensor([[3, 0, 383], [7, 7, 1]])
    assert isinstance(q.embed_tokens, BlockEmbedding) and torch.equal(q.embed_tokens(rows), ref.embed_tokens(rows))
    assert q.embed_tokens._dense is None  # rows are gathered from the blocks: no fp32 table
    assert torch.equal(q.embed_tokens.weight, ref.embed_tokens.weight)  # made on demand for a kernel needing it
    ids = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119])
    with torch.no_grad():
        q.setup_cache(len(ids))
        ref.setup_cache(len(ids))
        a, b = q(ids).logits, ref(ids).logits
    # int8 activations (llama.cpp's arithmetic) against fp32 ones on the same weights
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@pytest.fixture(scope="module")
def quantized(files):
    return load_target(files[1])


@pytest.mark.parametrize("drafter", ["ngram", "eagle3-trained"])
def test_speculative_greedy_equals_plain_at_the_files_precision(quantized, drafter):
    seqs = ef.greedy_sequences(tiny.build_model("llama"), ef.training_prompts(), 12)
    prompts = [seqs[i, : 8 + i % 5].tolist() for i in range(12)]
    if drafter == "ngram":
        d = load_drafter("ngram", {"min_n": 1, "max_n": 3}, None, quantized)
    else:
        d = load_drafter("eagle3", None, ef.trained_head("llama"), quantized)
    plain, spec = SpecModel(quantized), SpecModel(quantized, d)
    accepted = []
    for i, p in enumerate(prompts):
        want = plain.generate(p, NEW, speculative=False, eos_ids=()).tokens
        got = spec.generate(p, NEW, draft_len=1 + i % 6, eos_ids=())
        assert got.tokens == want, f"prompt {i}"
        accepted.append(got.stats.acceptance_length)
    if drafter == "eagle3-trained":  # the head still drafts much of what the 4-bit target says (fp32: 2.5+,
        assert sum(accepted) / len(accepted) > 1.5  # a random head: below 1.2)


def test_a_type_not_kept_is_refused_naming_it(tmp_path):
    tok = tmp_path / "tok"
    tiny.make_tokenizer(tok)
    path = write_llama_gguf(tmp_path / "m.gguf", tiny.build_model("llama"), tok,
                            types={r"ffn_down": T.IQ4_NL, r"attn_": T.Q4_1})
    with pytest.raises(UnsupportedError) as err:
        import_gguf(path, tmp_path / "out", progress=False)
    assert "blk.0.ffn_down.weight: IQ4_NL" in err.value.problems and "--dequantize" in err.value.hint
    assert not (tmp_path / "out").exists()
    import_gguf(path, tmp_path / "out", progress=False, dequantize=True)  # the fp32 import still reads it


def test_blocks_that_do_not_fill_the_shape_are_refused_at_load(files, tmp_path):
    import shutil

    from specpack.runtime.models.weights import load_target as load

    bad = tmp_path / "bad"
    shutil.copytree(files[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["tensor_types"]["model.layers.0.mlp.up_proj.weight"] = "Q8_0"  # the bytes are Q4_1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="up_proj.weight"):
        load(bad)
    cfg["quantization_config"]["tensor_types"]["model.layers.0.mlp.up_proj.weight"] = "IQ2_XS"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="IQ2_XS"):
        load(bad)


def test_blocks_run_on_the_cpu_in_float32_only(files):
    with pytest.raises(InputError, match="GGUF blocks"):
        load_target(files[1], dtype=torch.bfloat16)


def test_a_fused_layer_of_two_kernels_is_widened_and_says_so(tmp_path, caplog):
    """Q8_0 v rows beside 4-bit q and k rows (a Q4_K_M file mixes types this way): no one kernel reads the
    fused q/k/v, so it runs on fp32 panels of the same values, with a warning."""
    tok = tmp_path / "tok"
    tiny.make_tokenizer(tok)
    path = write_llama_gguf(tmp_path / "m.gguf", tiny.build_model("llama"), tok,
                            types={r"attn_v\.": T.Q8_0, r"attn_|ffn_": T.Q4_1})
    import_gguf(path, tmp_path / "kept", progress=False)
    import_gguf(path, tmp_path / "f32", progress=False, dequantize=True)
    q = load_target(tmp_path / "kept")
    assert "Q4_1 + Q8_0 layers run widened to fp32" in caplog.text
    qkv = q.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.dense_weight(), load_target(tmp_path / "f32").layers[0].self_attn.qkv_proj.weight)
    assert q.layers[0].mlp.gate_up_proj.packed.weights == "w4a8"


def test_a_k_quant_file_runs_its_blocks_natively(tmp_path):
    """A Q4_K_M / Q5_K_M-style mix (Q4_K, Q5_K, Q6_K feed-forward down, Q8_0 embedding and head) on rows 256 wide:
    Q4_K on fp32-scaled 4-bit panels (w4a8k), Q5_K on 5-bit ones (w5a8k), Q6_K on 6-bit ones (w6a8), with
    gguf-py's values; greedy speculative == plain."""
    tok = tmp_path / "tok"
    tiny.make_tokenizer(tok)
    model = tiny.build_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64)
    path = write_llama_gguf(tmp_path / "m.gguf", model, tok,
                            types={r"token_embd|^output\.": T.Q8_0, r"ffn_down": T.Q6_K, r"attn_output": T.Q5_K,
                                   r"ffn_up": T.Q5_K, r"attn_|ffn_": T.Q4_K})
    import_gguf(path, tmp_path / "kept", progress=False)
    import_gguf(path, tmp_path / "f32", progress=False, dequantize=True)
    q, ref = load_target(tmp_path / "kept"), load_target(tmp_path / "f32")
    for i in range(2):
        # Q4_K q/k/v; Q5_K o; Q4_K gate beside Q5_K up: the 5-bit format reads both
        for name, fmt in (("self_attn.qkv_proj", "w4a8k"), ("mlp.gate_up_proj", "w5a8k"), ("self_attn.o_proj", "w5a8k")):
            a, b = q.layers[i].get_submodule(name), ref.layers[i].get_submodule(name)
            assert a.packed.weights == fmt and torch.equal(a.dense_weight(), b.weight), (i, name)
        down = q.layers[i].mlp.down_proj
        assert down.packed.weights == "w6a8" and torch.equal(down.dense_weight(), ref.layers[i].mlp.down_proj.weight)
    d = load_drafter("ngram", {"min_n": 1, "max_n": 3}, None, q)
    plain, spec = SpecModel(q), SpecModel(q, d)
    for i, p in enumerate([[1, 5, 9, 5, 9, 5], [1, 2, 3, 4, 2, 3, 4], [7, 8, 7, 8, 7]]):
        want = plain.generate(p, 16, speculative=False, eos_ids=()).tokens
        assert spec.generate(p, 16, draft_len=2 + i, eos_ids=()).tokens == want


@pytest.fixture(scope="module")
def kept_artifacts(files, tmp_path_factory):
    """The kept target built with the trained EAGLE-3 head and a DSpark head in DeepSpec's layout."""
    import block_layouts as bl
    from test_engine import _prompts, _sglang_trained_head

    from specpack.packager import BuildOptions, build

    tmp = tmp_path_factory.mktemp("kept-art")
    hf = tiny.build_model("llama")
    seqs = [ef.greedy_sequences(hf, torch.tensor([p]), 12)[0].tolist() for p in _prompts(tiny.VOCAB)]
    dspark = bl.bigram_dspark(tmp / "dspark", ef.target_dir("llama"), {(a, b) for s in seqs for a, b in zip(s, s[1:])},
                              ids_out=(0, 2, 4))
    heads = {"eagle3": _sglang_trained_head(tmp / "eagle3-head"), "block": dspark}
    return {kind: build(BuildOptions(target=files[1], drafter=str(head), out=tmp / kind)).out
            for kind, head in heads.items()}


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_the_batched_engine_on_blocks_equals_single_requests(kept_artifacts, kind):
    import specpack
    from test_engine import alone, drive, requests

    from specpack.runtime.engine import Engine

    m = specpack.load(kept_artifacts[kind])
    assert m.target.layers[0].mlp.gate_up_proj.packed.weights == "w4a8"
    assert m.target.embed_tokens._dense is None  # a block drafter's fused step reads the blocks too: no fp32 table
    if kind == "block" and kl.available():
        assert m.drafter.fused_block is not None
    reqs = requests(m)
    want = [alone(m, r) for r in reqs]
    engine = Engine(m.target, m.drafter, slots=3, max_len=64, prefill_chunk=5)
    got = drive(engine, {0: reqs[:2], 1: reqs[2:4], 4: reqs[4:]})
    assert got == dict(enumerate(want))


def test_a_fused_layer_of_int8_exact_types_runs_on_int8_panels(tmp_path):
    """Q5_0 q and k rows beside Q8_0 v rows (llama-quantize's Q4_K_M on rows not 256 wide): every value is an int8
    multiple of its block's d, so the fused q/k/v runs on w8a8 panels exactly, not widened."""
    tok = tmp_path / "tok"
    tiny.make_tokenizer(tok)
    path = write_llama_gguf(tmp_path / "m.gguf", tiny.build_model("llama"), tok,
                            types={r"attn_v\.": T.Q8_0, r"attn_q\.": T.Q4_0, r"attn_|ffn_": T.Q5_0})
    import_gguf(path, tmp_path / "kept", progress=False)
    import_gguf(path, tmp_path / "f32", progress=False, dequantize=True)
    qkv = load_target(tmp_path / "kept").layers[0].self_attn.qkv_proj
    assert qkv.packed.weights == "w8a8"
    assert torch.equal(qkv.dense_weight(), load_target(tmp_path / "f32").layers[0].self_attn.qkv_proj.weight)


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_beside_blocks_the_drafter_is_packed_in_int8_unless_another_precision_is_asked(kept_artifacts, kind):
    import specpack
    from specpack.runtime.kernels._lib import _library

    if not kl.available():
        pytest.skip(kl.unavailable_reason())

    def drafter_formats(m):
        return {mod.packed.weights for mod in m.drafter.modules() if hasattr(mod, "packed")} - {"w4a8"}

    blocks = "w8a8" if _library()[0].sp_vnni() else "int8"
    assert drafter_formats(specpack.load(kept_artifacts[kind])) == {blocks}
    assert drafter_formats(specpack.load(kept_artifacts[kind], weights="bf16")) == {"bf16"}


def test_the_drafter_follows_weights_beside_a_float_target():
    from types import SimpleNamespace as NS

    from specpack.runtime.backends.torch_backend import drafter_weights

    def manifest(scheme, kind="eagle3"):
        quantization = NS(scheme=scheme) if scheme else None
        return NS(target=NS(arch=NS(quantization=quantization)), drafter=NS(kind=kind))

    assert drafter_weights(manifest(None), "fp32") == "fp32"
    assert drafter_weights(manifest("fp8-block"), "fp32") == "fp32"
    assert drafter_weights(manifest("gguf"), "int8") == "int8"
    assert drafter_weights(manifest("gguf", "ngram"), "fp32") == "fp32"
    if kl.available():
        assert drafter_weights(manifest("gguf"), "fp32") in ("w8a8", "int8")
