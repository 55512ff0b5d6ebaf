"""Loading holds the packed weights, not the file beside them (issue 62 point 1): the CPU kernels' layers are
packed as each decoder layer is read, and the mapped file's pages are handed back once their packed copy
exists. Memory is read from /proc (Linux), never timed."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specpack.runtime import kernels
from specpack.runtime.models.weights import Checkpoint, FileEmbedding, checkpoint_files, load_target

import tiny

pytestmark = [pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps"),
              pytest.mark.skipif(not kernels.available(), reason=f"CPU kernel: {kernels.unavailable_reason()}")]
MiB = 1 << 20


def resident(path: Path) -> int:
    """Bytes of `path` resident in this process (every mapping of it, from /proc/self/smaps)."""
    total, inside, name = 0, False, str(Path(path).resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            inside = fields[-1] == name
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory):
    """Big enough (~20 MiB) that its pages are measurable: 4 layers, a 4096-token vocabulary, an untied head."""
    return tiny.make_target(tmp_path_factory.mktemp("mem") / "target", "llama", vocab_size=4096, hidden_size=256,
                            intermediate_size=1024, num_hidden_layers=4)


def test_released_pages_leave_the_process_and_the_values_stay(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(16 * MiB // 4, dtype=torch.float32), "b": torch.ones(3, 5)}, path)
    checkpoint = Checkpoint(checkpoint_files(tmp_path))
    t = checkpoint.read(["a", "b"])
    before = t["a"].sum().item()  # every page read
    assert resident(path) >= 16 * MiB
    checkpoint.release([t["a"]])
    assert resident(path) < 1 * MiB
    assert t["a"].sum().item() == before and torch.equal(t["b"], torch.ones(3, 5))  # read from the file again
    checkpoint.release([torch.zeros(4)])  # not a view of the mapping: left alone
    assert not t["a"].is_shared() and t["a"].dtype == torch.float32 and t["a"].shape == (16 * MiB // 4,)


@pytest.mark.parametrize("weights", ["fp32", "bf16", "w8a8"])
def test_packing_at_load_is_packing_after_load(wide_target, weights):
    from specpack.runtime.kernels.accelerate import PackedLinearModule, use_cpu_kernels

    threads = torch.get_num_threads()
    try:
        early, late = load_target(wide_target, weights=weights), load_target(wide_target)
        assert not any(isinstance(m, torch.nn.Linear) for m in early.modules())
        use_cpu_kernels(early, weights), use_cpu_kernels(late, weights)
    finally:
        torch.set_num_threads(threads)
    packed = {n: m for n, m in early.named_modules() if isinstance(m, PackedLinearModule)}
    other = {n: m for n, m in late.named_modules() if isinstance(m, PackedLinearModule)}
    assert packed.keys() == other.keys() and len(packed) == 4 * 4 + 1
    for name, m in packed.items():
        assert m.packed.weights == other[name].packed.weights and torch.equal(m.weight, other[name].weight), name
    ids = torch.tensor([5, 17, 99, 3, 250, 7])
    for model in (early, late):
        model.setup_cache(32)
    assert torch.equal(early(ids).logits, late(ids).logits)


def test_a_loaded_target_keeps_no_page_of_its_packed_layers(wide_target):
    """After specpack.load the mapped checkpoint holds only what was touched since (an embedding row a
    lookup read, the norms): at most a few pages a tensor, not the file."""
    import specpack
    from specpack.packager import BuildOptions, NgramParams, build

    artifact = wide_target.parent / "art"
    if not artifact.exists():
        build(BuildOptions(target=wide_target, drafter="ngram", out=artifact, ngram=NgramParams(1, 3, 6)))
    threads = torch.get_num_threads()
    try:
        model = specpack.load(artifact)
    finally:
        torch.set_num_threads(threads)
    file = artifact / "model.safetensors"
    assert file.stat().st_size > 15 * MiB
    assert resident(file) < 1 * MiB
    out = model.generate([5, 17, 99, 3], max_new_tokens=8, speculative=False)
    assert len(out.tokens) == 8 and resident(file) < 1 * MiB  # lookups read rows with pread; norms are copies
    assert isinstance(model.target.embed_tokens, FileEmbedding)
    ids = torch.tensor([[0, 4095], [17, 17]])
    assert torch.equal(model.target.embed_tokens(ids), model.target.embed_tokens.weight[ids])
    with pytest.raises(IndexError):
        model.target.embed_tokens(torch.tensor([4096]))


def test_the_generic_tokenizer_is_the_one_autotokenizer_makes(tiny_target):
    """load_tokenizer makes a tokenizer whose config names the generic class with that class (AutoTokenizer's
    resolution imports ~55 MiB of modules): the same tokens, text, chat prompt and special ids."""
    from transformers import AutoTokenizer

    from specpack.runtime.api import load_tokenizer

    lean, auto = load_tokenizer(tiny_target), AutoTokenizer.from_pretrained(tiny_target)
    assert type(lean) is type(auto)
    for text in ["def add(a, b):\n    return a + b", "<|im_start|>user\nHi<|im_end|>", "  spaces\tand\nlines ", ""]:
        ids = auto(text)["input_ids"]
        assert lean(text)["input_ids"] == ids and lean.decode(ids) == auto.decode(ids)
    chat = [{"role": "user", "content": "Hello"}]
    assert lean.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    for attr in ("all_special_ids", "eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(lean, attr) == getattr(auto, attr), attr
    assert {k: str(v) for k, v in lean.added_tokens_decoder.items()} == \
        {k: str(v) for k, v in auto.added_tokens_decoder.items()}


@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int8", "w8a8", "fp32 of fp16 values"])
def test_a_large_weight_packed_a_stretch_at_a_time_is_the_same_layer(monkeypatch, weights):
    """packed_linear with `release` reads a weight over CHUNK_BYTES a stretch of rows at a time (the loader hands
    each stretch's pages back): the same panels, format and products as packing it whole."""
    from specpack.runtime.kernels import accelerate

    monkeypatch.setattr(accelerate, "CHUNK_BYTES", 64 * 40 * 4)  # 64 rows of 40 a stretch
    torch.manual_seed(0)
    w = torch.randn(200, 40)
    if weights == "fp32 of fp16 values":
        w, weights = w.half().float(), "fp32"
    released = []
    whole = accelerate.packed_linear(w, torch.randn(200), weights)
    parts = accelerate.packed_linear(w, whole.bias, weights, release=released.append)
    assert parts.packed.weights == whole.packed.weights and torch.equal(parts.weight, whole.weight)
    assert len(released) >= 4 and sum(len(r) for r in released) >= 200
    x = torch.randn(3, 40)
    assert torch.equal(parts(x), whole(x))


def test_a_tensor_in_a_dtype_the_runtime_does_not_read_is_refused_by_name(tmp_path):
    from specpack.errors import InputError

    save_file({"w": torch.zeros(4, 4, dtype=torch.uint16)}, tmp_path / "model.safetensors")
    with pytest.raises(InputError, match=r"w in .*model.safetensors is stored as U16") as err:
        Checkpoint(checkpoint_files(tmp_path)).read(["w"])
    assert "F32, F16, BF16 or U8" in err.value.hint


def test_a_draft_model_is_packed_as_it_is_read_too(wide_target):
    """A draft model (a whole decoder) goes through the target's loader with the drafter's weight format: after
    specpack.load its file keeps no page of the packed layers, and speculation stays lossless."""
    import specpack
    from specpack.packager import BuildOptions, build
    from test_draft_model import make_draft

    artifact = wide_target.parent / "art-draft"
    if not artifact.exists():
        draft = make_draft(wide_target.parent / "draft", wide_target, layers=2)
        build(BuildOptions(target=wide_target, drafter=str(draft), out=artifact))
    threads = torch.get_num_threads()
    try:
        model = specpack.load(artifact)
    finally:
        torch.set_num_threads(threads)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.drafter.modules())
    file = next((artifact / "drafter").glob("*.safetensors"))
    assert file.stat().st_size > 8 * MiB and resident(file) < 1 * MiB
    plain = model.generate([5, 17, 99, 3], max_new_tokens=8, speculative=False, eos_ids=()).tokens
    assert model.generate([5, 17, 99, 3], max_new_tokens=8, draft_len=3, eos_ids=()).tokens == plain
