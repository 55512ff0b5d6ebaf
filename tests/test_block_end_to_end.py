"""Block drafters from a published layout to decoded text: build (converters) -> verify -> load (runtime)
-> the batched engine. Greedy speculative output equals plain output, alone and in a batch; `specpack
run` needs no options; each layout's drafts are those of the same canonical head."""

import pytest

import block_layouts as bl
from specpack.packager import BuildOptions, build
from specpack.runtime.engine import Engine, Request

LAYOUTS = ["zlab-dflash", "lilicorr", "deepspec-dspark", "speculators-dspark", "deepseek-dflash"]


@pytest.fixture(scope="module", params=LAYOUTS)
def artifact(request, tmp_path_factory, tiny_target):
    tmp = tmp_path_factory.mktemp(request.param)
    head = bl.write(request.param, tmp / "head", tiny_target)
    return request.param, build(BuildOptions(target=tiny_target, drafter=str(head), out=tmp / "art")).out


def test_greedy_speculative_equals_plain_alone_and_batched(artifact):
    import specpack

    layout, art = artifact
    m = specpack.load(art)
    assert m.manifest.drafter.kind == "block" and m.drafter.kind == "block"
    prompts = [[5, 9, 14, 3, 22, 7] * 3, [40, 41, 42, 43] * 4, [100, 7, 100, 7, 12, 30]]
    plain = [m.generate(p, 20, speculative=False, eos_ids=()).tokens for p in prompts]
    spec = [m.generate(p, 20, eos_ids=()).tokens for p in prompts]
    assert spec == plain, layout
    engine = Engine(m.target, m.drafter, slots=3, max_len=64)
    reqs = [Request(p, 20, draft_len=m.manifest.drafter.draft_slots) for p in prompts]
    assert [r.tokens for r in engine.run(reqs)] == plain, layout


def test_run_needs_no_options(artifact, cli):
    _, art = artifact
    code, out, err = cli("run", art, "--prompt", "def add(a, b):", "--max-new-tokens", "8")
    assert code == 0 and "Traceback" not in err, err


def test_tune_refuses_draft_lengths_past_the_block(artifact, tmp_path):
    """A block drafter drafts at most its draft slots: a longer draft length asked of `tune` would
    measure the same draft again under another name, so it is refused before any measurement, with
    the limit and the flag to change, and the manifest is left as it was."""
    import json

    import specpack
    from specpack.errors import InputError
    from specpack.tuning.tune import tune

    _, art = artifact
    slots = specpack.load(art).manifest.drafter.draft_slots
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    before = (art / "specpack.json").read_bytes()
    with pytest.raises(InputError, match=f"takes at most {slots} draft tokens, not \\[{slots + 1}\\]") as e:
        tune(art, workload, concurrency=[1], draft_lens=[slots + 1], max_new_tokens=4, repeats=1)
    assert "--draft-lens" in e.value.hint
    assert (art / "specpack.json").read_bytes() == before


def test_run_and_serve_refuse_draft_lengths_past_the_block(artifact, cli):
    """`--draft-len` above a block drafter's trained slots would be drafted as the slots in silence
    (the block has no more): `run` and `serve` refuse it with the limit and the flag, and take the
    slots themselves."""
    import specpack
    from specpack.errors import InputError
    from specpack.serving.serve import prepare

    _, art = artifact
    slots = specpack.load(art).manifest.drafter.draft_slots
    code, _, err = cli("run", art, "--prompt", "def add(a, b):", "--max-new-tokens", "4",
                       "--draft-len", str(slots + 1))
    assert code != 0 and f"has {slots} trained draft slots" in err and f"--draft-len {slots}" in err, err
    assert "Traceback" not in err
    code, _, err = cli("run", art, "--prompt", "def add(a, b):", "--max-new-tokens", "4", "--draft-len", str(slots))
    assert code == 0, err
    with pytest.raises(InputError, match=f"has {slots} trained draft slots"):
        prepare(art, draft_len=slots + 1)
