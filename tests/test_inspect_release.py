"""`inspect DIR` on a release checks what it reads as `build` does, bounds what it prints, and never
says `--drafter bundled` binds what `build` refuses (issue 63 item 3)."""

import json
import shutil

import pytest
import torch

import family_fixtures as ff


@pytest.fixture(scope="module")
def v4_dspark(tmp_path_factory):
    return ff.deepseek_v4_dspark(ff.make("deepseek_v4", tmp_path_factory.mktemp("v4") / "r"))


def _index(root, weight_map):
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("weight_map, text", [(5, "'weight_map' is not an object"),
                                              ([1, 2], "'weight_map' is not an object"),
                                              ({"embed.weight": 3}, "weight_map entries that name no file")])
def test_an_index_of_the_wrong_type_is_an_error_not_a_traceback(v4_dspark, tmp_path, cli, weight_map, text):
    r = shutil.copytree(v4_dspark, tmp_path / "r")
    _index(r, weight_map)
    for command in (("inspect", r), ("build", r, "--drafter", "bundled", "-o", tmp_path / "art")):
        code, _, err = cli(*command)
        assert code == 2 and text in err and "Traceback" not in err, err


def test_a_stage_number_of_thousands_of_digits_is_no_stage(v4_dspark, tmp_path, cli):
    r = shutil.copytree(v4_dspark, tmp_path / "r")
    ff.edit(r, add={f"mtp.{'9' * 5000}.x": torch.zeros(1)})
    code, out, err = cli("inspect", r, "--json")
    assert code == 0 and "Traceback" not in err and len(out) < 20_000, err
    assert "stages [0, 1, 2] held" in json.loads(out)["bundled"][0]["detail"]


def test_a_million_layer_ids_are_not_echoed(v4_dspark, tmp_path, cli):
    r = shutil.copytree(v4_dspark, tmp_path / "r")
    ff.edit(r, config={"dspark_target_layer_ids": list(range(1_000_000))})
    code, out, err = cli("inspect", r, "--json")
    assert code == 0 and len(out) < 20_000, len(out)
    shown = json.loads(out)
    assert shown["drafter_bundled"] is None and "dspark_target_layer_ids[4] = 4: not a target layer" in out
    code, _, err = cli("build", r, "--drafter", "bundled", "-o", tmp_path / "art")
    assert code == 2 and len(err) < 20_000 and not (tmp_path / "art").exists()


def test_a_link_to_the_release_itself_is_not_a_bundled_drafter(tmp_path, cli):
    """`dspark -> .` would read the target as its own drafter."""
    r = ff.make("minimax_m3_vl", tmp_path / "m3")
    (r / "dspark").symlink_to(".", target_is_directory=True)
    code, out, _ = cli("inspect", r, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["drafter_bundled"] is None, out
    code, _, err = cli("build", r, "--drafter", "bundled", "-o", tmp_path / "art")
    assert code != 0 and not (tmp_path / "art").exists(), err


def test_an_original_copy_of_the_target_is_not_a_bundled_drafter(tmp_path, cli):
    """Releases ship `original/` (the target again, in its first format): not a draft model."""
    r = ff.make("qwen3_moe", tmp_path / "q")
    shutil.copytree(r, tmp_path / "copy")
    shutil.move(tmp_path / "copy", r / "original")
    code, out, _ = cli("inspect", r, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["drafter_bundled"] is None, out
    assert "a copy of the target" in json.dumps(shown["bundled"]), out
    code, _, err = cli("build", r, "--drafter", "bundled", "-o", tmp_path / "art")
    assert code != 0 and not (tmp_path / "art").exists(), err
