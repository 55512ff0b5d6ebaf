"""What a release bundles: `inspect DIR` on a model directory lists its MTP modules (layout A), DSpark
stages its config declares (layout B) and drafters in a subfolder (layout C, MiniMax-M3.1's
`dspark/`); `build --drafter bundled` binds the one it ships, and a subfolder drafter is stored once."""

import hashlib
import json
import shutil

import pytest

import block_layouts as bl
import family_fixtures as ff
from conftest import read_json
from specpack.errors import InputError, UnsupportedError
from specpack.packager import BuildOptions, build, verify


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def release(tmp_path, tiny_target):
    """The tiny target with a DSpark drafter in `dspark/`, as MiniMax-M3.1 ships one."""
    root = shutil.copytree(tiny_target, tmp_path / "release")
    bl.write("deepspec-dspark", root / "dspark", tiny_target)
    return root


def _build(tmp_path, target, drafter, name="art"):
    return build(BuildOptions(target=target, drafter=str(drafter), out=tmp_path / name)).out


def test_inspect_lists_a_subfolder_drafter_and_what_bundled_binds(release, cli):
    code, out, _ = cli("inspect", release)
    assert code == 0 and "layout C" in out and "block in dspark/" in out and "deepspec-dspark layout" in out
    code, out, _ = cli("inspect", release, "--json")
    d = json.loads(out)
    assert d["drafter_bundled"] == str(release / "dspark") and [b["layout"] for b in d["bundled"]] == ["C"]


@pytest.mark.parametrize("spec", ["bundled", "path"])
def test_a_subfolder_drafter_is_stored_once_and_the_rest_byte_for_byte(spec, release, tmp_path):
    art = _build(tmp_path, release, "bundled" if spec == "bundled" else release / "dspark")
    m = read_json(art / "specpack.json")
    files = {f["path"]: f["sha256"] for f in m["files"]}
    assert not [f for f in files if f.startswith("dspark/")]  # not carried twice
    for f in (p for p in release.rglob("*") if p.is_file() and "dspark" not in p.parts):
        rel = f.relative_to(release).as_posix()
        assert files[rel if rel != "README.md" else "TARGET_README.md"] == _sha(f), rel
    source = m["drafter"]["source"]
    assert source["subfolder"] == "dspark" and source["path"] == "release"
    assert source["files_sha256"] == {p.name: _sha(p) for p in (release / "dspark").iterdir()}
    assert m["drafter"]["kind"] == "block" and m["drafter"]["source_layout"] == "deepspec-dspark"
    assert "shipped in the target's `dspark/`, stored once" in (art / "README.md").read_text()
    assert verify(art).files == len(files)  # raises on any difference


def test_bundled_refuses_when_the_release_ships_several_or_none(release, tmp_path, tiny_target):
    bl.write("zlab-dflash", release / "dflash", tiny_target)
    with pytest.raises(InputError) as err:
        _build(tmp_path, release, "bundled")
    shown = str(err.value)
    assert "bundles 2 drafters" in shown and "--drafter " + str(release / "dflash") in shown
    assert not (tmp_path / "art").exists()
    with pytest.raises(InputError, match="bundles no drafter"):
        _build(tmp_path, tiny_target, "bundled")


def test_mtp_modules_in_the_weights_are_layout_a(tmp_path, cli):
    target = ff.deepseek_mtp(ff.make("deepseek_v3", tmp_path / "ds"))
    code, out, _ = cli("inspect", target)
    assert code == 0 and "layout A" in out and "mtp in target weights" in out and "--drafter mtp" in out
    entry = read_json(_build(tmp_path, target, "bundled") / "specpack.json")["drafter"]
    assert entry["kind"] == "mtp"


def test_dspark_markers_win_over_the_legacy_mtp_key_and_without_stages_bind_nothing(tmp_path, tiny_target, cli):
    """SGLang's checkpoint_bundles_dspark_draft rule: any dspark_* marker means DSpark stages, even where
    the config keeps num_nextn_predict_layers (DeepSeek-V4-Flash-DSpark's config)"""
    root = shutil.copytree(tiny_target, tmp_path / "v4like")
    cfg = read_json(root / "config.json")
    cfg.update(num_nextn_predict_layers=1, dspark_block_size=5, dspark_noise_token_id=7,
               dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=8)
    (root / "config.json").write_text(json.dumps(cfg))
    code, out, _ = cli("inspect", root, "--json")
    d = json.loads(out)
    assert [(b["layout"], b["kind"]) for b in d["bundled"]] == [("B", "release_dspark")]
    assert "win over num_nextn_predict_layers 1" in d["bundled"][0]["detail"]
    assert "the weights hold no mtp.* tensor" in d["bundled"][0]["detail"]  # this tiny target holds none
    assert d["drafter_bundled"] is None and "no drafter specpack can bind" in d["why_not"]
    assert d["bundled"][0]["why_not"] == "the weights hold no mtp.{k}. tensor"
    with pytest.raises(UnsupportedError, match="no drafter specpack can bind"):
        _build(tmp_path, root, "bundled")


def test_dspark_stages_held_under_mtp_are_counted(tmp_path, tiny_target, cli):
    """DeepSeek-V4-Flash-DSpark keeps its three stages under mtp.{0,1,2}.* (its published index: main_proj
    in mtp.0, the heads in mtp.2); inspect counts the stages the weights hold."""
    import torch

    root = shutil.copytree(tiny_target, tmp_path / "v4like")
    ff.edit(root, add={"mtp.0.main_proj.weight": torch.zeros(4, 12), "mtp.1.attn_norm.weight": torch.ones(4),
                       "mtp.2.norm.weight": torch.ones(4)}, config={"dspark_block_size": 5})
    code, out, _ = cli("inspect", root, "--json")
    assert "stages [0, 1, 2] held under mtp.*" in json.loads(out)["bundled"][0]["detail"]
