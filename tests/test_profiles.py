"""Validated profiles: tune writes evidence that re-measures, the artifact still verifies, profiles
are judged against the machine, run/serve pick one, and bad workloads get exact errors."""

import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from specpack.errors import InputError
from specpack.packager import BuildOptions, NgramParams, build, sign_artifact, verify
from specpack.packager.artifact import read_manifest
from specpack.tuning.profiles import (INCOMPATIBLE, LOW_MEMORY, RUNNABLE, Machine, check_profile,
                                       list_profiles, select_profile, this_machine)
from specpack.tuning.tune import heuristic_draft_len, remeasure, sweep_draft_len, sweep_tree, tree_start, tune
from specpack.tuning.workload import read_workload
from specpack.schemas.profile import Profile, make_profile, profile_id

WORKLOAD = [
    {"prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):"},
    {"prompt": "The quick brown fox jumps over the lazy dog. The quick brown", "max_tokens": 10},
    {"messages": [{"role": "user", "content": "for i in range(10):\n    print(i * i)\n"}]},
]
TUNE = dict(concurrency=[1, 2], draft_lens=[2, 4], max_new_tokens=16, repeats=1, tree_shapes=[(3, 2, 5)])


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("prof") / "art"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=out, ngram=NgramParams(1, 3, 4)))
    return out


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("wl") / "tiny-code.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in WORKLOAD))
    return path


@pytest.fixture(scope="module")
def tuned(artifact, workload, tmp_path_factory):
    art = tmp_path_factory.mktemp("tuned") / "art"
    shutil.copytree(artifact, art)
    return art, tune(art, workload, **TUNE)


def _machine(**changes) -> Machine:
    here = this_machine(gpus=False)
    return replace(here, **changes)


def test_tune_writes_a_profile_whose_evidence_remeasures(tuned, workload):
    import specpack

    art, result = tuned
    p = result.profile
    stored = read_manifest(art).profiles
    assert len(stored) == 1 and Profile.model_validate(stored[0]) == p
    assert p.id == profile_id(p.model_dump(mode="json"))
    s = p.settings
    tree = f"-t{s.tree_topk}x{s.tree_nodes}" if s.draft_shape == "tree" else ""
    assert p.name == f"torch-cpu-float32-{p.drafter}-d{s.draft_len}{tree}"
    e = p.evidence
    assert e.greedy_equal and e.prompts_checked == 3 and e.workload.name == "tiny-code"
    # the draft lengths, then the tree shapes (the n-gram drafter branches)
    assert [(pt.draft_len, pt.tree_topk, pt.tree_nodes) for pt in e.draft_len_sweep] == [(2, 1, 0), (4, 1, 0),
                                                                                         (3, 2, 5)]
    assert e.hardware.cpu_cores >= 1 and e.software.packages["torch"]
    assert p.memory.required_bytes == p.memory.weights_bytes + p.memory.kv_cache_bytes > 0
    curve = p.settings.cost_curve  # the engine's step-time curve, measured on this machine
    assert curve.rows[0] == 1 and curve.rows == sorted(curve.rows) and len(curve.ms) == len(curve.rows)
    assert all(ms > 0 for ms in curve.ms)
    if p.settings.speculative:
        assert [c.concurrency for c in e.concurrency_sweep] == [1, 2]
        assert 1 <= p.settings.max_concurrency <= 2
        assert all(0 < c.speculative_p50_s <= c.speculative_p95_s and 0 < c.baseline_p50_s <= c.baseline_p95_s
                   for c in e.concurrency_sweep)
    from specpack.tuning.profiles import select_profile

    chosen = select_profile(read_manifest(art))
    assert chosen.profile == p and chosen.cost_curve == curve.model_dump()  # what serve builds its engine with

    again = remeasure(specpack.load(art), p, workload)
    assert again["new_tokens"] == e.workload.new_tokens
    assert again["acceptance_length"] == e.acceptance_length  # deterministic for greedy decoding
    assert again["position_acceptance"] == e.position_acceptance and again["acceptance_matches"]
    ratio = again["speculative_tokens_per_s"] / e.speculative_tokens_per_s
    assert 1 / 50 < ratio < 50  # loose: this is a shared machine, timings are never asserted


def test_a_cost_curve_from_other_kernels_or_hardware_is_measured_again(tuned, monkeypatch):
    """A profile keeps its draft length, tree and concurrency limit anywhere it runs, but its cost
    curve only describes the machine and CPU kernels it was measured with: after a specpack upgrade
    changed the kernels (or on another CPU) run and serve measure a curve instead of cutting drafts
    with an old one, and say so."""
    from specpack.tuning import profiles

    art, result = tuned
    manifest = read_manifest(art)
    assert result.profile.evidence.software.packages[profiles.KERNELS] == profiles.kernels_build()
    here = profiles.select_profile(manifest)
    assert here.cost_curve is not None and "measuring one here" not in here.message
    monkeypatch.setattr(profiles, "kernels_build", lambda: "0123456789abcdef")  # an upgrade's kernels
    upgraded = profiles.select_profile(manifest)
    assert upgraded.profile == result.profile and upgraded.draft_len == here.draft_len
    assert upgraded.cost_curve is None and "measuring one here" in upgraded.message
    monkeypatch.undo()
    elsewhere = profiles.this_machine(gpus=False)
    elsewhere = replace(elsewhere, cpu_model=elsewhere.cpu_model + " (another)")
    assert profiles.select_profile(manifest, machine=elsewhere).cost_curve is None


def test_tuned_artifact_still_verifies_and_loads(tuned):
    import specpack

    art, _ = tuned
    assert verify(art).files == len(read_manifest(art).files)
    assert specpack.load(art).manifest.profiles


def test_signed_artifact_needs_the_key_and_is_resigned(tuned, workload, keypair, tmp_path):
    art = tmp_path / "signed"
    shutil.copytree(tuned[0], art)
    sign_artifact(art, keypair.private)
    with pytest.raises(InputError, match="is signed: writing profiles changes specpack.json"):
        tune(art, workload, **TUNE)
    tune(art, workload, key=keypair.private, **{**TUNE, "concurrency": [1], "draft_lens": [3]})
    report = verify(art, keypair.public, require_signature=True)
    assert report.signature_checked
    assert len(read_manifest(art).profiles) == 1  # same machine and workload: replaced, not added


def test_old_artifacts_without_profiles_still_load(artifact, tmp_path):
    import specpack

    art = tmp_path / "old"
    shutil.copytree(artifact, art)
    manifest = json.loads((art / "specpack.json").read_text())
    del manifest["profiles"]  # written before profiles existed
    (art / "specpack.json").write_text(json.dumps(manifest))
    model = specpack.load(art)
    assert list_profiles(art) == []
    chosen = select_profile(model.manifest)
    assert chosen.profile is None and chosen.speculative and chosen.draft_len == 4
    assert "no validated profiles" in chosen.message


def test_profile_statuses_with_reasons(tuned):
    art, result = tuned
    manifest, raw = read_manifest(art), result.profile.model_dump(mode="json")
    assert check_profile(raw, manifest, _machine()).status == RUNNABLE

    low = check_profile(raw, manifest, _machine(memory_available=1000))
    assert low.status == LOW_MEMORY and "MiB of system memory, 0.0 MiB available" in low.reasons[0]
    no_torch = check_profile(raw, manifest, _machine(backends={}))
    assert no_torch.status == INCOMPATIBLE and "backend torch is not installed" in no_torch.reasons[0]
    edited = {**raw, "settings": {**raw["settings"], "max_concurrency": 64}}
    assert "edited after tuning" in check_profile(edited, manifest, _machine()).reasons[0]
    broken = check_profile({"name": "x", "backend": "torch"}, manifest, _machine())
    assert broken.status == INCOMPATIBLE and broken.reasons[0].startswith("not a valid profile")

    listed = list_profiles(art, _machine(memory_available=1000))
    assert [s.status for s in listed] == [LOW_MEMORY]
    assert listed[0].to_dict()["reasons"] and listed[0].to_dict()["settings"]


def _variant(profile: Profile, **fields) -> dict:
    data = profile.model_dump(mode="json")
    data.update(fields)
    return make_profile(**{k: v for k, v in data.items() if k not in ("id", "name")}).model_dump(mode="json")


def test_backend_not_installed_gpu_missing_or_other_drafter(tuned):
    art, result = tuned
    manifest, p = read_manifest(art), result.profile
    trt = check_profile(_variant(p, backend="tensorrt"), manifest, _machine(backends={"torch": "2"}))
    assert trt.status == INCOMPATIBLE
    assert trt.reasons == ["backend tensorrt is not installed (pip install 'specpack[tensorrt]')"]
    gpu = check_profile(_variant(p, device="cuda"), manifest, _machine(gpus=()))
    assert gpu.reasons == ["it needs a CUDA GPU and none is visible"]
    eagle = check_profile(_variant(p, drafter="eagle3"), manifest, _machine())
    assert eagle.reasons == ["it is for a eagle3 drafter, this artifact has ngram"]


def test_select_profile_for_run_and_serve(tuned):
    art, result = tuned
    manifest, p = read_manifest(art), result.profile
    picked = select_profile(manifest, "cpu", "float32", machine=_machine())
    assert picked.profile == p and picked.message.startswith(f"picked profile {p.name} ({p.id})")
    assert select_profile(manifest, wanted=p.id[:6], machine=_machine()).profile == p
    assert select_profile(manifest, wanted=p.name, machine=_machine()).message.startswith("using profile")
    fallback = select_profile(manifest, "cpu", "bfloat16", machine=_machine())
    assert fallback.profile is None and "no runnable validated profile for torch/cpu/bfloat16" in fallback.message
    with pytest.raises(InputError, match="has no profile named 'nope'"):
        select_profile(manifest, wanted="nope", machine=_machine())
    with pytest.raises(InputError, match="cannot run here: low-memory") as err:
        select_profile(manifest, wanted=p.name, machine=_machine(memory_available=10))
    assert "available" in err.value.problems[0]
    with pytest.raises(InputError, match="is for torch/cpu/float32, this run uses torch/cpu/bfloat16"):
        select_profile(manifest, dtype="bfloat16", wanted=p.name, machine=_machine())


def test_tune_on_onnxruntime_writes_a_profile_that_onnxruntime_runs_pick(artifact, workload, tmp_path):
    """`tune --backend onnxruntime` measures the exported graphs through the same batched engine and
    stores a profile for that backend: ONNX Runtime runs pick it, torch runs do not."""
    from specpack.exports.onnx import export_onnx

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    export_onnx(art, progress=False)
    result = tune(art, workload, backend="onnxruntime", **{**TUNE, "concurrency": [1, 2], "draft_lens": [2]})
    p = result.profile
    assert p.backend == "onnxruntime" and p.evidence.software.packages["onnxruntime"]
    assert [pt.concurrency for pt in p.evidence.concurrency_sweep] == [1, 2]
    manifest = read_manifest(art)
    assert select_profile(manifest, "cpu", "float32", backend="onnxruntime", machine=_machine()).profile == p
    assert select_profile(manifest, "cpu", "float32", backend="torch", machine=_machine()).profile is None
    verify(art)


def test_profiles_are_per_weight_precision(tuned):
    """A profile measured with fp32 weights is not picked for an int8 run, and one measured with
    int8 weights (`tune --weights int8`) only for int8 runs; profiles from before the field stay valid."""
    art, result = tuned
    manifest, p = read_manifest(art), result.profile
    old = {k: v for k, v in p.model_dump(mode="json").items() if k != "weights"}  # as written before the field
    assert p.weights is None and p.id == profile_id(old) and check_profile(old, manifest, _machine()).status == RUNNABLE
    assert select_profile(manifest, "cpu", "float32", machine=_machine(), weights="int8").profile is None
    int8 = _variant(p, weights="int8")
    assert int8["id"] != p.id and check_profile(int8, manifest, _machine()).status == RUNNABLE
    both = manifest.model_copy(update={"profiles": [p.model_dump(mode="json"), int8]})
    assert select_profile(both, "cpu", "float32", machine=_machine(), weights="int8").profile.id == int8["id"]
    assert select_profile(both, "cpu", "float32", machine=_machine()).profile == p
    with pytest.raises(InputError, match="with int8 weights, this run uses torch/cpu/float32"):
        select_profile(both, wanted=int8["id"], machine=_machine())


def test_profiles_are_per_kv_cache(tuned):
    """A profile measured with an fp16 KV cache (`tune --kv-cache fp16`) is picked only for runs with
    one (its cost curve prices keys at half the bytes), and one measured with the model's cache not for
    them; profiles from before the field keep their id."""
    art, result = tuned
    manifest, p = read_manifest(art), result.profile
    assert p.kv_cache is None and "kv_cache" not in {k for k, v in p.model_dump(mode="json").items() if v is not None}
    assert select_profile(manifest, "cpu", "float32", machine=_machine(), kv_cache="fp16").profile is None
    fp16 = _variant(p, kv_cache="fp16")
    assert fp16["id"] != p.id and check_profile(fp16, manifest, _machine()).status == RUNNABLE
    both = manifest.model_copy(update={"profiles": [p.model_dump(mode="json"), fp16]})
    assert select_profile(both, "cpu", "float32", machine=_machine(), kv_cache="fp16").profile.id == fp16["id"]
    assert select_profile(both, "cpu", "float32", machine=_machine()).profile == p
    with pytest.raises(InputError, match="and an fp16 KV cache, this run uses torch/cpu/float32") as err:
        select_profile(both, wanted=fp16["id"], machine=_machine())
    assert "--kv-cache fp16" in err.value.hint


def test_tune_checks_the_kv_cache_option_first(tuned, workload):
    from specpack.tuning.tune import tune

    art, _ = tuned
    with pytest.raises(InputError, match="--kv-cache fp16 narrows"):
        tune(art, workload, backend="onnxruntime", kv_cache="fp16")



@pytest.mark.parametrize("text, message, problems", [
    ("", "is empty: no prompts", []),
    ("\n  \n", "is empty: no prompts", []),
    ('{"prompt": "a"}\n{"prompt": \n[1]\n{"text": "a"}\n{"prompt": "a", "max_tokens": -2}\n'
     '{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}\n{"messages": [{"role": "bot", "content": 1}]}\n',
     r"has 6 bad line\(s\)",
     ["line 2: not valid JSON", "line 3: expected a JSON object, got list", "line 4: ",
      "line 5: max_tokens: Input should be greater than or equal to 1",
      "line 6: give exactly one of 'prompt' or 'messages'", "line 7: messages.0.role"]),
])
def test_bad_workload_files(tmp_path, text, message, problems):
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as err:
        read_workload(path)
    assert len(err.value.problems) == len(problems)
    for got, want in zip(err.value.problems, problems):
        assert got.startswith(want), got


def test_missing_workload_and_directory(tmp_path):
    with pytest.raises(InputError, match="workload file '.*nope.jsonl' does not exist"):
        read_workload(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="is a directory"):
        read_workload(tmp_path)


def test_shipped_workloads_parse():
    root = Path(__file__).parent.parent / "bench" / "workloads"
    files = sorted(root.glob("*.jsonl"))
    assert {f.stem for f in files} >= {"code_edit", "summarise_quotes", "chat"}
    for f in files:
        assert 5 <= len(read_workload(f).items) <= 10, f


def test_bad_tune_inputs_fail_before_measuring(artifact, workload, tmp_path):
    with pytest.raises(InputError, match="has no ONNX export"):  # onnxruntime measures the exported graphs
        tune(artifact, workload, backend="onnxruntime")
    with pytest.raises(InputError, match="invalid tune options") as err:
        tune(artifact, workload, concurrency=[0], draft_lens=[0, 17], max_new_tokens=0, tree_shapes=[(3, 1, 5)])
    assert len(err.value.problems) == 5 and "tree shape (3, 1, 5)" in err.value.problems[1]
    with pytest.raises(InputError, match="does not exist"):
        tune(artifact, tmp_path / "missing.jsonl")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "word " * 600}) + "\n")
    with pytest.raises(InputError, match="does not fit this model") as err:
        tune(artifact, long)
    assert err.value.problems[0].startswith("line 2: ") and "exceed the context of 512" in err.value.problems[0]
    assert read_manifest(artifact).profiles == []


def test_draft_length_heuristic_and_search(artifact):
    manifest = read_manifest(artifact)
    assert heuristic_draft_len(manifest, "cpu") == 4  # the artifact's own default
    for heads, kv, want in [(32, 4, 15), (32, 1, 3), (4, 2, 16)]:  # D = 128 / G - 1, at most 16
        t = manifest.target.model_copy(update={"num_attention_heads": heads, "num_key_value_heads": kv})
        assert heuristic_draft_len(manifest.model_copy(update={"target": t}), "cuda") == want

    class Fake:
        def __init__(self, d):
            self.tokens_per_s = 100 - (d - 7) ** 2  # best at 7

    measured = []
    found = sweep_draft_len(lambda d: measured.append(d) or Fake(d), 4)
    assert max(found, key=lambda d: found[d].tokens_per_s) == 7
    assert len(measured) == len(set(measured))  # each length once
    assert sorted(sweep_draft_len(lambda d: Fake(d), 4, [3, 1, 3])) == [1, 3]
    capped = sweep_draft_len(lambda d: Fake(d), 4, longest=5)  # e.g. MTP with 5 layers, no reuse
    assert max(capped) == 5 and max(capped, key=lambda d: capped[d].tokens_per_s) == 5


def test_tree_shape_search():
    class Fake:
        def __init__(self, s):  # best at depth 6, top-k 4, 32 nodes
            d, k, m = s
            self.tokens_per_s = 100 - (d - 6) ** 2 - 4 * abs(k - 4) - abs(m - 32) / 4

    assert tree_start(4, 16) == (5, 4, 20) and tree_start(16, 5) == (5, 4, 20)
    # where a verify turns compute-bound after 8 rows, the search starts at 7 nodes (never below the depth)
    assert tree_start(4, 16, rows=8) == (5, 4, 7) and tree_start(4, 16, rows=2) == (5, 4, 5)
    assert tree_start(4, 16, rows=64) == (5, 4, 20)
    measured = []
    found = sweep_tree(lambda s: measured.append(s) or Fake(s), (5, 4, 16), limit=20)
    assert max(found, key=lambda s: found[s].tokens_per_s) == (6, 4, 32)
    assert len(measured) == len(set(measured)) and all(1 <= d and 2 <= k <= 8 and d <= m <= 64 for d, k, m in found)
    assert len(sweep_tree(lambda s: Fake(s), (5, 4, 16), limit=3)) == 3  # a bounded search
    assert sorted(sweep_tree(lambda s: Fake(s), (5, 4, 16), [(2, 2, 4), (2, 2, 4)])) == [(2, 2, 4)]


def test_drafter_draft_length_limit():
    from specpack.tuning.tune import max_draft_len

    class TwoLayers:
        def check_draft_len(self, d):
            if d > 2:
                raise InputError(f"{d} draft tokens asked for, but the MTP drafter has 2 layer(s)")

    assert max_draft_len(TwoLayers()) == 2 and max_draft_len(object()) == 16
    assert max_draft_len(type("Block", (), {"max_draft_len": 5})()) == 5  # a block drafter's draft slots


def test_plots_are_optional(tuned, tmp_path):
    from specpack.tuning.report import save_plots, summary

    _, result = tuned
    assert result.profile.name in summary(result) and "draft length 4" in summary(result)
    paths, notes = save_plots(result, tmp_path / "plots")
    if importlib.util.find_spec("matplotlib") is None:
        assert paths == [] and "matplotlib is not installed" in notes[0]
    else:
        assert all(p.is_file() and p.suffix == ".png" for p in paths) and len(paths) == 2


def test_profiles_from_before_lookup_keep_their_id(tuned):
    """`settings.lookup` and the sweep points' `lookup` came later: a profile written without them
    (or with them unset) hashes to the same id, and setting one is a different profile."""
    art, result = tuned
    p = result.profile
    data = p.model_dump(mode="json")
    old = json.loads(json.dumps(data))
    del old["settings"]["lookup"]
    for point in old["evidence"]["draft_len_sweep"]:
        del point["lookup"]
    assert p.settings.lookup is None and profile_id(old) == profile_id(data) == p.id
    assert check_profile(old, read_manifest(art), _machine()).status == RUNNABLE
    if p.settings.speculative:
        with_lookup = make_profile(**{k: v for k, v in data.items() if k not in ("id", "name")}
                                   | {"settings": {**data["settings"], "lookup": 8}})
        assert with_lookup.id != p.id and with_lookup.name == p.name + "-l8"


def test_run_and_serve_apply_the_profiles_lookup_unless_told(tmp_path):
    """A profile that measured prompt lookup beside its drafter has run and serve draft with it; an
    explicit --lookup (0 included) overrides it."""
    from conftest import measured_profile, with_profiles
    from test_engine import artifact as engine_artifact

    from specpack.serving.generate import GenerateRequest, generate_text
    from specpack.serving.serve import prepare

    profile = measured_profile("eagle3", device="cpu", backend="torch", lookup=6)
    assert profile.name.endswith("-d3-l6")
    art = with_profiles(engine_artifact("eagle3"), tmp_path / "art", profile)
    chosen = select_profile(read_manifest(art), machine=_machine())
    assert chosen.profile == profile and chosen.lookup == 6 and "prompt lookup of up to 6 tokens" in chosen.message
    prompt = "a b c d a b c d a b c d a b c"
    ran = generate_text(art, GenerateRequest(prompt, max_new_tokens=12, draft_len=3))  # drafted as given: no timing
    assert ran["profile"] == profile.name and ran["lookup"] == 6 and ran["lookup_steps"] > 0
    off = generate_text(art, GenerateRequest(prompt, max_new_tokens=12, draft_len=3, lookup=0))
    assert off["lookup"] == 0 and off["lookup_steps"] == 0 and off["token_ids"] == ran["token_ids"]
    assert prepare(art, measure_cost=False).scheduler.lookup == 6
    assert prepare(art, lookup=0, measure_cost=False).scheduler.lookup == 0


def test_tune_measures_prompt_lookup_beside_a_model_drafter(workload, tmp_path):
    """For a drafter that is a model (not n-gram lookup), tune measures its best chain and best tree
    again with prompt lookup beside it (every output still checked equal to plain), and the profile
    keeps lookup where it was fastest."""
    from test_engine import artifact as engine_artifact

    art = tmp_path / "art"
    shutil.copytree(engine_artifact("eagle3"), art)
    result = tune(art, workload, **{**TUNE, "concurrency": [1], "draft_lens": [2], "lookups": [4]})
    p = result.profile
    points = [(pt.draft_len, pt.tree_topk, pt.tree_nodes, pt.lookup) for pt in p.evidence.draft_len_sweep]
    assert points == [(2, 1, 0, None), (3, 2, 5, None), (2, 1, 0, 4), (3, 2, 5, 4)]
    from specpack.tuning.report import summary

    assert "draft length 2 + lookup 4" in summary(result) and "tree 3x2x5 + lookup 4" in summary(result)
    if p.settings.speculative:
        best = max(p.evidence.draft_len_sweep, key=lambda pt: pt.tokens_per_s)
        assert (p.settings.draft_len, p.settings.tree_topk, p.settings.lookup) == \
            (best.draft_len, best.tree_topk, best.lookup)
        assert p.name.endswith(f"-l{best.lookup}") == (best.lookup is not None)
    with pytest.raises(InputError, match="lookup length 17 is outside 1..16"):
        tune(art, workload, **{**TUNE, "lookups": [17]})


def test_tune_cli_lookups_option(artifact, workload, cli):
    code, out, err = cli("tune", artifact, "--workload", workload, "--lookups", "4,17")
    assert code == 2 and "lookup length 17 is outside 1..16" in err and "Traceback" not in err, out + err
    code, _, err = cli("tune", artifact, "--workload", workload, "--lookups", "eight")
    assert code == 2 and "--lookups" in err and "comma-separated integers" in err
    assert read_manifest(artifact).profiles == []
