"""Inputs a user can get wrong raise typed errors with a message and a hint."""

import json
import shutil

import pytest

from eagle_fixtures import one_thread, target_dir  # noqa: F401
from specpack.errors import InputError, UnsupportedError
from specpack.runtime.spec_model import MAX_DRAFT_LEN, SpecModel, load_drafter, load_target


@pytest.fixture(scope="module")
def model():
    target = load_target(target_dir("llama"))
    return SpecModel(target, load_drafter("ngram", None, None, target), context_length=32)


def test_prompt_longer_than_context(model):
    with pytest.raises(InputError) as e:
        model.generate(list(range(5, 45)), 4)
    assert "40 tokens but the context holds 32" in e.value.message and e.value.hint
    with pytest.raises(InputError):
        model.generate(list(range(5, 37)), 4)  # exactly full: no room for a new token


@pytest.mark.parametrize("draft_len", [0, MAX_DRAFT_LEN + 1, -3])
def test_draft_length_out_of_range(model, draft_len):
    with pytest.raises(InputError, match="draft length") as e:
        model.generate([5, 6, 7], 4, draft_len=draft_len)
    assert f"1..{MAX_DRAFT_LEN}" in e.value.hint


def test_bad_sampling_settings(model):
    with pytest.raises(InputError) as e:
        model.generate([5, 6, 7], 4, temperature=-0.5)
    assert "temperature -0.5" in e.value.problems[0]
    with pytest.raises(InputError) as e:
        model.generate([5, 6, 7], 4, temperature=1.0, top_p=0.0, top_k=-1)
    assert len(e.value.problems) == 2


def test_empty_and_out_of_vocab_prompts(model):
    with pytest.raises(InputError, match="prompt is empty"):
        model.generate([], 4)
    with pytest.raises(InputError, match="outside the vocabulary"):
        model.generate([5, 100000], 4)
    with pytest.raises(InputError, match="max_new_tokens"):
        model.generate([5], 0)


def test_drafter_errors(model):
    with pytest.raises(InputError, match="needs a drafter"):
        SpecModel(model.target).generate([5, 6], 4)
    with pytest.raises(UnsupportedError) as e:
        load_drafter("medusa", None, None, model.target)
    assert "eagle3" in e.value.hint and "ngram" in e.value.hint
    with pytest.raises(InputError, match="n-gram sizes"):
        load_drafter("ngram", {"min_n": 3, "max_n": 2}, None, model.target)


def test_unsupported_architecture(tmp_path):
    target = shutil.copytree(target_dir("llama"), tmp_path / "t")
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "architectures": ["Gemma2ForCausalLM"]}))
    with pytest.raises(UnsupportedError) as e:
        load_target(target)
    assert "Gemma2ForCausalLM" in e.value.message
    assert "Qwen3ForCausalLM" in e.value.hint
