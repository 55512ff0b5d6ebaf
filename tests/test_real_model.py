"""The embedded real model end to end: GGUF import → signed build → verify → run, lossless."""

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_artifact(tmp_path_factory):
    """The demo's own preparation in a fresh cache, once for the module: (artifact, public key)."""
    from specpack import demo

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECPACK_CACHE", str(tmp_path_factory.mktemp("demo-cache")))
        yield demo.prepare(demo.cache_dir(), lambda s: None)


def test_smollm2_build_verify_run_lossless(demo_artifact, cli):
    import json

    from specpack import demo

    artifact, pub = demo_artifact
    assert cli("verify", artifact, "--key", pub)[0] == 0
    for prompt in demo.PROMPTS.values():
        runs = {}
        for flag in ("--no-spec", "--draft-len=8"):
            code, out, err = cli("run", artifact, "--chat", "--prompt", prompt, "--max-new-tokens", "64",
                                 flag, "--key", pub, "--json")
            assert code == 0, err
            runs[flag] = json.loads(out)
        assert runs["--draft-len=8"]["token_ids"] == runs["--no-spec"]["token_ids"]
        assert len(runs["--no-spec"]["token_ids"]) > 10


def test_shipped_eagle3_head_builds_drafts_and_is_lossless(demo_artifact):
    """heads/smollm2-135m-eagle3 (bash bench/distill_smollm2.sh) binds to the embedded target and
    drafts far better than chance; speculative greedy equals plain greedy."""
    import specpack
    from specpack import demo

    _, pub = demo_artifact
    model = specpack.load(demo.prepare_eagle3(demo.cache_dir(), lambda s: None), public_key=pub)
    assert model.manifest.drafter.kind == "eagle3" and model.manifest.drafter.draft_vocab_size == 4096
    tok = model.tokenizer
    prompt = tok('def count_vowels(text: str) -> int:\n    """Return the number of vowels in text."""\n').input_ids
    plain = model.generate(prompt, max_new_tokens=64, speculative=False)
    spec = model.generate(prompt, max_new_tokens=64, draft_len=3)
    assert spec.tokens == plain.tokens
    assert spec.stats.acceptance_length > 1.4, spec.stats  # an untrained head stays near 1.0


def test_shipped_dspark_head_builds_drafts_and_is_lossless(demo_artifact):
    """heads/smollm2-135m-dspark (bash bench/distill_smollm2_dspark.sh), when it is there: it binds
    to the embedded target through the DeepSpec converter and drafts far better than chance."""
    import specpack
    from specpack import demo

    _, pub = demo_artifact
    built = demo.prepare_head(demo.cache_dir(), "DSpark", lambda s: None)
    if built is None:
        pytest.skip("no heads/smollm2-135m-dspark (bash bench/distill_smollm2_dspark.sh trains it)")
    model = specpack.load(built, public_key=pub)
    drafter = model.manifest.drafter
    assert (drafter.kind, drafter.algorithm, drafter.source_layout) == ("block", "dspark", "deepspec-dspark")
    tok = model.tokenizer
    prompt = tok('def count_vowels(text: str) -> int:\n    """Return the number of vowels in text."""\n').input_ids
    plain = model.generate(prompt, max_new_tokens=64, speculative=False)
    spec = model.generate(prompt, max_new_tokens=64, draft_len=drafter.draft_slots)
    assert spec.tokens == plain.tokens
    assert spec.stats.acceptance_length > 1.4, spec.stats  # an untrained head stays near 1.0
