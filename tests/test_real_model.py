"""The embedded real model end to end: GGUF import → signed build → verify → run, lossless."""

import pytest

pytestmark = pytest.mark.slow


def test_smollm2_build_verify_run_lossless(tmp_path, monkeypatch, cli):
    import json

    from specpack import demo

    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path))
    artifact, pub = demo.prepare(demo.cache_dir(), lambda s: None)
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
