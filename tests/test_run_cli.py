"""`specpack run`: verified load, streaming text, --json figures, lossless greedy, clear errors."""

import json

import pytest

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"


@pytest.fixture(scope="module")
def ngram_artifact(tmp_path_factory, tiny_target):
    from specpack.packager import BuildOptions, NgramParams, build

    out = tmp_path_factory.mktemp("run") / "art"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=out, ngram=NgramParams(1, 3, 4)))
    return out


def _run_json(cli, *args):
    code, out, err = cli("run", *args, "--json")
    assert code == 0, out + err
    return json.loads(out)


def test_run_json_greedy_equals_no_spec(ngram_artifact, cli):
    spec = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "40")
    plain = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "40", "--no-spec")
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    for key in ("text", "token_ids", "acceptance_length", "per_position_acceptance", "tokens_per_s",
                "draft_len", "steps"):
        assert key in spec
    assert spec["draft_len"] == 4 and spec["speculative"] is True
    drafted = spec["accepted"] - spec["lookup_accepted"]
    assert spec["acceptance_length"] == (1 + drafted / spec["drafted_steps"] if spec["drafted_steps"] else 1.0)
    assert spec["tokens_per_step"] == 1 + spec["accepted"] / spec["steps"]
    assert spec["drafted_steps"] + spec["undrafted_steps"] + spec["lookup_steps"] == spec["steps"]
    assert spec["speculation"]["mode"] == "cost model" and str(spec["drafted_steps"]) in spec["speculation"]["decision"]
    assert plain["acceptance_length"] == 1.0


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_run_weights_speculative_equals_plain(ngram_artifact, cli, weights):
    spec = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "30", "--weights", weights)
    plain = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "30", "--no-spec",
                      "--weights", weights)
    assert spec["token_ids"] == plain["token_ids"] and spec["weights"] == weights


def test_run_kv_cache_fp16_speculative_equals_plain(ngram_artifact, cli):
    spec = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "30", "--kv-cache", "fp16")
    plain = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "30", "--no-spec",
                      "--kv-cache", "fp16")
    assert spec["token_ids"] == plain["token_ids"] and spec["kv_cache"] == "fp16"


def test_run_kv_cache_needs_the_torch_backend(ngram_artifact, cli):
    code, out, err = cli("run", ngram_artifact, "--prompt", "x", "--kv-cache", "fp16", "--backend", "onnxruntime")
    assert code == 2 and "--kv-cache fp16 narrows" in err and "backend onnxruntime" in err and "Traceback" not in err


def test_run_weights_needs_the_torch_cpu_path(ngram_artifact, cli):
    code, out, err = cli("run", ngram_artifact, "--prompt", "x", "--weights", "int8", "--dtype", "bfloat16")
    assert code == 2 and "--weights int8 needs the torch backend on the CPU in float32" in err
    assert "dtype bfloat16" in err and "Traceback" not in err



def test_run_without_a_profile_measures_a_cost_curve_once_per_model(ngram_artifact, monkeypatch):
    """No profile brings a curve: speculation still follows a cost model, measured on this machine
    once per loaded model (the demo and `run` call generate many times on one model)."""
    from specpack.runtime import spec_model
    from specpack.runtime.api import load
    from specpack.runtime.engine import cost
    from specpack.serving.generate import GenerateRequest, generate_text

    calls = []
    measure = cost.measure
    monkeypatch.setattr(cost, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    model = load(ngram_artifact)
    plain = generate_text(None, GenerateRequest(PROMPT, max_new_tokens=24, speculative=False), model=model)
    assert plain["cost_curve"] is None and not calls
    for _ in range(2):
        spec = generate_text(None, GenerateRequest(PROMPT, max_new_tokens=24), model=model)
        assert spec["token_ids"] == plain["token_ids"] and spec["cost_curve"]["rows"] == [1, 2, 4, 8]
    assert len(calls) == 1 and isinstance(model, spec_model.SpecModel)

def test_run_says_each_start_phase_before_the_first_token(ngram_artifact):
    """Startup that says what it does: loading, then measuring the cost curve (only when one is
    measured), then generating; nothing is said for an already loaded model's load."""
    from specpack.serving.generate import GenerateRequest, generate_text

    said = []
    generate_text(ngram_artifact, GenerateRequest(PROMPT, max_new_tokens=4), phase=said.append)
    assert said[0].startswith(f"verifying and loading {ngram_artifact}") and "torch, fp32 weights" in said[0]
    assert said[1].startswith("pricing drafts with this machine's cost curve") and said[2:] == ["generating"]
    fixed = []
    generate_text(ngram_artifact, GenerateRequest(PROMPT, max_new_tokens=4, draft_len=2), phase=fixed.append)
    assert len(fixed) == 2 and fixed[1] == "generating"  # drafted as given: nothing measured


def test_run_with_draft_trees_equals_no_spec(ngram_artifact, cli):
    tree = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "40", "--draft-tree", "3x8")
    plain = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "40", "--no-spec")
    assert tree["token_ids"] == plain["token_ids"] and tree["draft_tree"] == [3, 8]
    assert sum(tree["accepted_depth_steps"]) == tree["steps"]
    assert sum(d * n for d, n in enumerate(tree["accepted_depth_steps"])) == tree["accepted"]
    chain = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "8", "--draft-tree", "chain")
    assert chain["draft_tree"] is None and chain["token_ids"] == plain["token_ids"][:8]


def test_run_streams_text_and_reports_figures(ngram_artifact, cli):
    code, out, err = cli("run", ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "12")
    assert code == 0, err
    data = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "12")
    assert out.rstrip("\n") == data["text"]
    assert "tokens/s" in err and "acceptance length" in err and "per position" in err and "verify" in err


def test_run_chat_and_prompt_file(ngram_artifact, cli, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("hello")
    a = _run_json(cli, ngram_artifact, "--prompt-file", f, "--chat", "--max-new-tokens", "5")
    b = _run_json(cli, ngram_artifact, "--prompt", "hello", "--chat", "--max-new-tokens", "5")
    assert a["token_ids"] == b["token_ids"] and a["prompt_tokens"] > 3


def test_stop_string_cuts_text(ngram_artifact, cli):
    full = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "30", "--no-spec")
    stop = full["text"][5:8]
    cut = _run_json(cli, ngram_artifact, "--prompt", PROMPT, "--max-new-tokens", "30", "--stop", stop)
    assert cut["text"] == full["text"][: full["text"].find(stop)]


@pytest.mark.parametrize("args, text", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x", "--draft-len", "0"], "draft length 0"),
    (["--prompt", "x", "--draft-len", "99"], "draft length 99"),
    (["--prompt", "x", "--temperature", "-1"], "temperature -1.0 is negative"),
    (["--prompt", "x", "--draft-tree", "4x99"], "draft tree of top-k 4 with 99 nodes is out of range"),
    (["--prompt", "x", "--draft-tree", "four"], "expected TOPKxNODES"),
    (["--prompt", "x", "--lookup", "17"], "lookup draft length 17 is out of range"),
    (["--prompt", "word " * 600], "but the context holds 512"),
])
def test_bad_run_inputs(ngram_artifact, cli, args, text):
    code, out, err = cli("run", ngram_artifact, *args)
    assert code == 2, out + err
    assert text in err and "Traceback" not in err


def test_tampered_artifact_is_never_loaded(ngram_artifact, cli, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(ngram_artifact, art)
    cfg = json.loads((art / "config.json").read_text())
    cfg["num_hidden_layers"] = 7
    (art / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("run", art, "--prompt", "x")
    assert code == 3 and "config.json: changed" in err


def _hand_edited(ngram_artifact, tmp_path, **config_updates):
    """A copy whose config.json is edited and re-digested: an artifact built before build checked configs."""
    import shutil

    from specpack.packager.hashing import sha256_file

    art = tmp_path / "art"
    shutil.copytree(ngram_artifact, art)  # copies: never write through the build's hard links
    path = art / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_updates}))
    manifest = json.loads((art / "specpack.json").read_text())
    for f in manifest["files"]:
        if f["path"] == "config.json":
            f.update(size=path.stat().st_size, sha256=sha256_file(path))
    (art / "specpack.json").write_text(json.dumps(manifest))
    return art


@pytest.mark.parametrize("updates, text", [
    ({"num_hidden_layers": 10**6, "hidden_size": 10**9, "vocab_size": 10**12},
     "the config claims 1000000 decoder layers, but the weights hold 8"),
    ({"num_hidden_layers": 2000}, "the config claims 2000 decoder layers, but the weights hold 8"),
    ({"hidden_size": 10**9}, "tensor model.embed_tokens.weight has shape [384, 64], expected [384, 1000000000]"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0: not a positive integer"),
    ({"hidden_size": -64}, "hidden_size = -64: not a positive integer"),
])
def test_run_refuses_a_config_its_weights_cannot_hold(ngram_artifact, cli, tmp_path, updates, text):
    code, out, err = cli("run", _hand_edited(ngram_artifact, tmp_path, **updates), "--prompt", "x")
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, out + err
    assert text in err and len(err) < 10_000


# ---- defaults: every drafter kind runs with no options at all ----

@pytest.fixture(scope="module")
def every_kind(tmp_path_factory, tiny_target, tiny_cfg):
    """kind -> (artifact, the draft length it must default to). MTP with one layer is what
    DeepSeek-V3, GLM and MiMo publish: its default is 1, not the generic 4."""
    from safetensors import safe_open

    import eagle_layouts
    import mtp_layouts as ml
    from specpack.packager import BuildOptions, NgramParams, build
    from test_draft_model import make_draft

    tmp = tmp_path_factory.mktemp("kinds")
    with safe_open(tiny_target / "model.safetensors", "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    head = eagle_layouts.write_sglang(tmp / "head", eagle_layouts.random_head(tiny_cfg, 256), tiny_cfg, embed=embed)
    drafters = {"ngram": (tiny_target, "ngram", 3), "eagle3": (tiny_target, str(head), 4),
                "draft_model": (tiny_target, str(make_draft(tmp / "draft", tiny_target, layers=2)), 4),
                "mtp-1": (ml.make_target(tmp / "mtp1", "mtp-deepseek", 1).path, "mtp", 1),
                "mtp-2": (ml.make_target(tmp / "mtp2", "mtp-mimo", 2).path, "mtp", 2)}
    return {name: (build(BuildOptions(target=t, drafter=d, out=tmp / f"art-{name}",
                                      ngram=NgramParams(1, 3, 3))).out, want)
            for name, (t, d, want) in drafters.items()}


@pytest.mark.parametrize("kind", ["ngram", "eagle3", "draft_model", "mtp-1", "mtp-2"])
def test_every_drafter_kind_runs_with_no_options(every_kind, cli, kind):
    art, want = every_kind[kind]
    code, out, err = cli("run", art, "--prompt", "def add(a, b):")
    assert code == 0, err
    assert f"speculative, draft length {want}" in err and "Traceback" not in err
    spec = _run_json(cli, art, "--prompt", "def add(a, b):", "--max-new-tokens", "12")
    plain = _run_json(cli, art, "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--no-spec")
    assert spec["draft_len"] == want and spec["token_ids"] == plain["token_ids"]


def test_run_with_lookup_copies_where_the_text_repeats_and_equals_no_spec(every_kind, cli):
    art, _ = every_kind["eagle3"]
    prompt = PROMPT + "\n" + PROMPT
    plain = _run_json(cli, art, "--prompt", prompt, "--max-new-tokens", "24", "--no-spec")
    spec = _run_json(cli, art, "--prompt", prompt, "--max-new-tokens", "24", "--lookup", "8")
    assert spec["token_ids"] == plain["token_ids"] and spec["lookup"] == 8
    assert 0 <= spec["lookup_accepted"] <= spec["accepted"] and spec["lookup_steps"] <= spec["steps"]
    code, _, err = cli("run", art, "--prompt", prompt, "--max-new-tokens", "24", "--lookup", "8")
    assert code == 0 and ", lookup 8 (" in err, err


def test_serve_and_tune_start_from_a_draft_length_the_drafter_runs(every_kind):
    from specpack.errors import InputError
    from specpack.packager.artifact import read_manifest
    from specpack.tuning.tune import heuristic_draft_len

    art, _ = every_kind["mtp-1"]
    assert heuristic_draft_len(read_manifest(art), "cpu") == 1
    pytest.importorskip("fastapi")
    from specpack.serving.serve import prepare

    assert prepare(art).selection.draft_len == 1
    with pytest.raises(InputError, match="4 draft tokens asked for, but the MTP drafter has 1 layer"):
        prepare(art, draft_len=4)  # an explicit override it cannot run is refused at start, not per request


def test_the_demo_counts_what_it_shows_the_same_way(ngram_artifact):
    """The demo's speed sits beside tokens per step, which every step counts (lookup copies too), and the
    drafter's acceptance length is named for what it counts (issue 62 point 5)."""
    from specpack import demo
    from specpack.runtime.api import load

    model, said = load(ngram_artifact), []
    demo.compare({"n-gram": (model, 0), "n-gram + lookup": (model, 8)}, "add", PROMPT, 24, said.append, text=False)
    rows = [line for line in "\n".join(said).splitlines() if "tokens/s" in line]
    assert len(rows) == 3 and all("tokens/step" in row for row in rows)
    assert "drafter's acceptance length" in rows[1] and "drafted steps" in rows[2]
