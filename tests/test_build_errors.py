"""Every bad input of the build gets a clear error, a non-zero exit, no traceback, nothing written."""

import errno
import importlib
import json
import shutil

import pytest
import torch

import eagle_layouts
import tiny


@pytest.fixture
def head(tiny_cfg):
    return eagle_layouts.random_head(tiny_cfg, draft_vocab=256)


def _fails(cli, tmp_path, *args, code=2, text=()):
    """Run a build that must fail; check the message, the exit code and that nothing was written."""
    out = tmp_path / "out" / "art"
    out.parent.mkdir(exist_ok=True)
    before = set(out.parent.iterdir())
    rc, stdout, err = cli("build", *args, "-o", out)
    assert rc == code, stdout + err
    assert "Traceback" not in err and err.startswith("error: ")
    for t in text:
        assert t in err, f"{t!r} not in {err}"
    assert set(out.parent.iterdir()) == before, "a failed build left files behind"
    return err


def _official(tmp_path, tiny_cfg, tensors, name="head", **config_updates):
    path = eagle_layouts.write_official(tmp_path / name, tensors, tiny_cfg)
    if config_updates:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config_updates)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_unknown_missing_and_misshapen_tensors_all_listed(tmp_path, tiny_target, tiny_cfg, head, cli):
    head["layers.0.extra_gate.weight"] = torch.zeros(3)
    del head["norm.weight"]
    head["layers.0.mlp.up_proj.weight"] = torch.zeros(7, 64)
    src = _official(tmp_path, tiny_cfg, head)
    _fails(cli, tmp_path, tiny_target, "--drafter", src,
           text=["tensor 'midlayer.extra_gate.weight' maps to no canonical name",
                 "missing tensor 'norm.weight'",
                 "midlayer.mlp.up_proj.weight: shape [7, 64], expected [128, 64]"])


def test_fc_width_not_three_hidden(tmp_path, tiny_target, tiny_cfg, head, cli):
    head["fc.weight"] = torch.zeros(64, 2 * 64 + 5)
    _fails(cli, tmp_path, tiny_target, "--drafter", _official(tmp_path, tiny_cfg, head),
           text=["fc.weight takes 133 inputs, but 3 aux layers × target hidden 64 = 192"])


def test_fc_width_vs_declared_aux_layers(tmp_path, tiny_target, tiny_cfg, head, cli):
    src = eagle_layouts.write_modelopt(tmp_path / "h", head, tiny_cfg, aux_ids=[1, 3])
    _fails(cli, tmp_path, tiny_target, "--drafter", src,
           text=["fc.weight takes 192 inputs, but 2 aux layers × target hidden 64 = 128"])


@pytest.mark.parametrize("ids, text", [
    ([1, 3, 9], "aux layer id 9 (output_of_layer) is out of range [-1, 6]"),
    ([1, 3, 3], "aux layer ids [1, 3, 3] contain duplicates"),
])
def test_bad_aux_ids(tmp_path, tiny_target, tiny_cfg, head, cli, ids, text):
    src = eagle_layouts.write_modelopt(tmp_path / "h", head, tiny_cfg, aux_ids=ids)
    _fails(cli, tmp_path, tiny_target, "--drafter", src, text=[text])


def test_aux_ids_with_no_known_convention(tmp_path, tiny_target, tiny_cfg, head, cli):
    src = _official(tmp_path, tiny_cfg, head, eagle_aux_hidden_state_layer_ids=[1, 3, 5])
    _fails(cli, tmp_path, tiny_target, "--drafter", src,
           text=["defines no aux layer id convention", "--aux-convention input|output"])
    _fails(cli, tmp_path, tiny_target, "--drafter", src, "--aux-layer-ids", "1,3,5",
           text=["--aux-layer-ids needs --aux-convention"])


def test_d2t_missing(tmp_path, tiny_target, tiny_cfg, head, cli):
    del head["d2t"]
    _fails(cli, tmp_path, tiny_target, "--drafter", _official(tmp_path, tiny_cfg, head),
           text=["draft vocab 256 < target vocab 384 but the head has no d2t map"])


def test_d2t_out_of_range(tmp_path, tiny_target, tiny_cfg, head, cli):
    head["d2t"][-1] = 10_000
    _fails(cli, tmp_path, tiny_target, "--drafter", _official(tmp_path, tiny_cfg, head),
           text=["d2t maps draft ids [255] outside the target vocab [0, 384)"])


def test_d2t_not_injective(tmp_path, tiny_target, tiny_cfg, head, cli):
    head["d2t"][1] = head["d2t"][0] - 1  # draft 1 -> the target id of draft 0
    _fails(cli, tmp_path, tiny_target, "--drafter", _official(tmp_path, tiny_cfg, head),
           text=["d2t is not injective"])


def test_t2d_inconsistent(tmp_path, tiny_target, tiny_cfg, head, cli):
    head["t2d"] = head["t2d"].roll(1)
    _fails(cli, tmp_path, tiny_target, "--drafter", _official(tmp_path, tiny_cfg, head),
           text=["t2d disagrees with d2t"])


def test_vocab_and_hidden_mismatch_with_target(tmp_path, tiny_target, tiny_cfg, head, cli):
    src = _official(tmp_path, tiny_cfg, head, vocab_size=500, hidden_size=96)
    _fails(cli, tmp_path, tiny_target, "--drafter", src,
           text=["drafter config vocab_size 500 != target vocab 384",
                 "drafter hidden_size 96 != target hidden size 64"])


def test_narrow_head_without_its_own_embedding(tmp_path, tiny_target, tiny_cfg, cli):
    """Hidden 32 vs the target's 64 and no embed_tokens: nothing could feed its layer (SGLang would keep
    an unloaded embedding, TensorRT-LLM create one), so the build refuses and says why."""
    src = eagle_layouts.write_narrow(tmp_path / "h", tiny_cfg, hidden=32)
    _fails(cli, tmp_path, tiny_target, "--drafter", src,
           text=["the head's hidden size is 32 but the target's is 64, and the head has no embed_tokens",
                 "export the head with its embed_tokens.weight [384, 32]"])
    rc, out, err = cli("build", tiny_target, "--drafter", eagle_layouts.write_narrow(tmp_path / "e", tiny_cfg, 32,
                                                                                      embed=True),
                       "-o", tmp_path / "ok", "--json")
    assert rc == 0, err
    assert json.loads((tmp_path / "ok/specpack.json").read_text())["drafter"]["embedding_source"] == "drafter"


def test_head_geometry_mismatch(tmp_path, tiny_target, tiny_cfg, head, cli):
    src = _official(tmp_path, tiny_cfg, head, num_attention_heads=8, num_key_value_heads=4)
    _fails(cli, tmp_path, tiny_target, "--drafter", src,
           text=["drafter attention geometry (heads 8, KV heads 4, head dim 8) != target's "
                 "(heads 4, KV heads 2, head dim 16)"])


def _target_copy(tiny_target, tmp_path, shards=1):
    if shards == 1:
        dst = tmp_path / "t"
        shutil.copytree(tiny_target, dst)
        return dst
    return tiny.make_target(tmp_path / "t", "llama", shards=shards, num_hidden_layers=8)


def test_missing_shard(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path, shards=3)
    (t / "model-00002-of-00003.safetensors").unlink()
    _fails(cli, tmp_path, t, "--drafter", "ngram",
           text=["model-00002-of-00003.safetensors is named by the index but missing"])


def test_index_naming_absent_file(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path, shards=3)
    index = json.loads((t / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-00009-of-00009.safetensors"
    (t / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(cli, tmp_path, t, "--drafter", "ngram",
           text=["model-00009-of-00009.safetensors is named by the index but missing"])


def test_shards_without_index(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path, shards=3)
    (t / "model.safetensors.index.json").unlink()
    _fails(cli, tmp_path, t, "--drafter", "ngram", text=["sharded weights but no"])


def test_safetensors_header_that_lies(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path)
    data = (t / "model.safetensors").read_bytes()
    (t / "model.safetensors").write_bytes(data[: len(data) - 100])  # truncated
    _fails(cli, tmp_path, t, "--drafter", "ngram",
           text=["safetensors header does not match the file", "truncated?"])


def test_pickle_only_target(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path)
    (t / "model.safetensors").rename(t / "pytorch_model.bin")
    _fails(cli, tmp_path, t, "--drafter", "ngram",
           text=["has no safetensors weights", "found pytorch_model.bin", "safe_serialization=True"])


def test_drafter_in_unknown_format(tmp_path, tiny_target, tiny_cfg, head, cli):
    src = _official(tmp_path, tiny_cfg, head)
    (src / "pytorch_model.bin").rename(src / "weights.pt")
    _fails(cli, tmp_path, tiny_target, "--drafter", src, text=["is not a drafter in any known layout"])


def test_drafter_pickle_with_code_is_refused(tmp_path, tiny_target, tiny_cfg, head, cli):
    src = _official(tmp_path, tiny_cfg, head)
    torch.save({"fc.weight": head["fc.weight"], "evil": shutil.rmtree}, src / "pytorch_model.bin")
    _fails(cli, tmp_path, tiny_target, "--drafter", src, text=["is not a plain tensor checkpoint"])


def test_symlink_pointing_outside_target(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path)
    (tmp_path / "secret.txt").write_text("x")
    (t / "notes.txt").symlink_to(tmp_path / "secret.txt")
    _fails(cli, tmp_path, t, "--drafter", "ngram", text=["notes.txt ->", "points outside"])


def test_index_path_with_dotdot(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path, shards=3)
    index = json.loads((t / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "../model-00001-of-00003.safetensors"
    (t / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(cli, tmp_path, t, "--drafter", "ngram",
           text=["path '../model-00001-of-00003.safetensors' escapes its directory"])


def test_output_exists_without_force(tmp_path, tiny_target, cli):
    out = tmp_path / "out" / "art"
    out.mkdir(parents=True)
    (out / "keep.txt").write_text("mine")
    rc, _, err = cli("build", tiny_target, "--drafter", "ngram", "-o", out)
    assert rc == 2 and "already exists" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", out, "--force")[0] == 0
    assert not (out / "keep.txt").exists() and (out / "specpack.json").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["art"]


def test_unwritable_output(tiny_target, cli):
    rc, _, err = cli("build", tiny_target, "--drafter", "ngram", "-o", "/sys/specpack-test-out")
    assert rc == 2 and "cannot write" in err


@pytest.mark.parametrize("exc, code, text", [
    (OSError(errno.ENOSPC, "No space left on device"), 2, "disk full"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_disk_full_or_ctrl_c_mid_build_leaves_nothing(tmp_path, tiny_target, cli, monkeypatch, exc,
                                                      code, text):
    build_mod = importlib.import_module("specpack.packager.build")

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(build_mod, "_write_text", boom)  # after the target files were placed
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    rc, _, err = cli("build", tiny_target, "--drafter", "ngram", "-o", out)
    assert rc == code and text in err
    assert list(out.parent.iterdir()) == []


def test_bad_ngram_params(tmp_path, tiny_target, cli):
    _fails(cli, tmp_path, tiny_target, "--drafter", "ngram", "--ngram-min", "3", "--ngram-max", "2",
           "--draft-len", "0", text=["need 1 <= min n (3) <= max n (2)", "draft length 0"])
    from specpack.errors import InputError
    from specpack.packager import BuildOptions, NgramParams, build

    with pytest.raises(InputError, match="match rule 'first' is neither"):
        build(BuildOptions(target=tiny_target, drafter="ngram", out=tmp_path / "m", ngram=NgramParams(match="first")))


def test_json_error_output(tmp_path, tiny_target, cli):
    rc, out, _ = cli("build", tiny_target, "--drafter", "nope", "-o", tmp_path / "x", "--json")
    assert rc == 2
    assert json.loads(out)["error"] == "InputError"


# ---- configs and headers that lie: clear errors, bounded in time and memory ----

def _with_config(tiny_target, tmp_path, drop=(), **updates):
    t = _target_copy(tiny_target, tmp_path)
    cfg = json.loads((t / "config.json").read_text())
    cfg.update(updates)
    for key in drop:
        del cfg[key]
    (t / "config.json").write_text(json.dumps(cfg))
    return t


def test_absurd_config_sizes_are_refused_against_the_headers(tmp_path, tiny_target, cli):
    t = _with_config(tiny_target, tmp_path, num_hidden_layers=10**6, hidden_size=10**9, vocab_size=10**12)
    err = _fails(cli, tmp_path, t, "--drafter", "ngram",
                 text=["config.json claims sizes its weights cannot hold",
                       "num_hidden_layers 1,000,000 > the 75 tensors in its weights",
                       "hidden_size 1,000,000,000 > the", "vocab_size 1,000,000,000,000 > the"])
    assert len(err) < 2000


@pytest.mark.parametrize("updates, text", [
    ({"num_hidden_layers": 9}, "the config claims 9 decoder layers, but the weights hold 8"),
    ({"intermediate_size": 100},
     "tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64], expected [100, 64]"),
])
def test_config_checked_against_every_tensor_of_the_headers(tmp_path, tiny_target, cli, updates, text):
    _fails(cli, tmp_path, _with_config(tiny_target, tmp_path, **updates), "--drafter", "ngram",
           text=["does not match its config", text])


@pytest.mark.parametrize("updates, drop, text", [
    ({"num_attention_heads": 0}, (), "num_attention_heads = 0: not a positive integer"),
    ({"num_attention_heads": 0}, ("head_dim",), "num_attention_heads = 0: not a positive integer"),
    ({"hidden_size": -64}, (), "hidden_size = -64: not a positive integer"),
    ({"vocab_size": "384"}, (), "vocab_size = '384': not a positive integer"),
    ({"rope_theta": "fast"}, (), "rope_theta = 'fast': not a finite number above 0"),
])
def test_config_values_that_are_not_sizes(tmp_path, tiny_target, cli, updates, drop, text):
    _fails(cli, tmp_path, _with_config(tiny_target, tmp_path, drop, **updates), "--drafter", "ngram",
           text=[text])


def _header_file(path, header: bytes, data: bytes = b""):
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize("offsets", [["0", "4"], "ab", [0, 4.0], [True, 4], [0]])
def test_safetensors_header_with_offsets_that_are_not_integers(tmp_path, tiny_target, cli, offsets):
    t = _target_copy(tiny_target, tmp_path)
    header = {"model.norm.weight": {"dtype": "F32", "shape": [1], "data_offsets": offsets}}
    _header_file(t / "model.safetensors", json.dumps(header).encode(), b"\0" * 4)
    _fails(cli, tmp_path, t, "--drafter", "ngram",
           text=["safetensors header does not match the file", "model.norm.weight: malformed entry"])


def test_safetensors_header_nested_200k_deep(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path)
    _header_file(t / "model.safetensors", b"[" * 200_000 + b"]" * 200_000)
    _fails(cli, tmp_path, t, "--drafter", "ngram", text=["header is nested too deeply"])


def test_config_nested_200k_deep(tmp_path, tiny_target, cli):
    t = _target_copy(tiny_target, tmp_path)
    (t / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    _fails(cli, tmp_path, t, "--drafter", "ngram", text=["is nested too deeply to be a config"])


@pytest.mark.parametrize("content, text", [
    (5, "it holds a Python int, not a dict of tensors"),
    ([1, 2], "it holds a Python list, not a dict of tensors"),
    ({"fc.weight": 3}, "'fc.weight': int"),
])
def test_drafter_pickle_of_plain_values(tmp_path, tiny_target, tiny_cfg, head, cli, content, text):
    src = _official(tmp_path, tiny_cfg, head)
    torch.save(content, src / "pytorch_model.bin")
    _fails(cli, tmp_path, tiny_target, "--drafter", src, text=["is not a plain tensor checkpoint", text])


@pytest.mark.parametrize("updates, text", [
    ({"num_attention_heads": 0}, "num_attention_heads = 0: not a positive integer"),
    ({"hidden_size": -64}, "hidden_size = -64: not a positive integer"),
    ({"head_dim": 0}, "head_dim = 0: not a positive integer"),
])
def test_drafter_config_values_that_are_not_sizes(tmp_path, tiny_target, tiny_cfg, head, cli, updates, text):
    _fails(cli, tmp_path, tiny_target, "--drafter", _official(tmp_path, tiny_cfg, head, **updates),
           text=["fields of the wrong type or value", text])


def test_a_quantization_scheme_specpack_cannot_check_is_refused(tmp_path, tiny_target, cli):
    """A packed layout specpack has no rules for (GPTQ, AWQ) is refused, naming what it can check: a
    quantized target's tensors are never left unchecked (issue 44). Absurd sizes are refused first."""
    t = _with_config(tiny_target, tmp_path, quantization_config={"quant_method": "gptq"})
    _fails(cli, tmp_path, t, "--drafter", "ngram",
           text=["quant_method 'gptq' is not a scheme specpack can check", "fp8 (block or per-tensor)"])
    shutil.rmtree(tmp_path / "t")
    t = _with_config(tiny_target, tmp_path, num_hidden_layers=10**6, quantization_config={"quant_method": "fp8"})
    _fails(cli, tmp_path, t, "--drafter", "ngram", text=["num_hidden_layers 1,000,000 > the 75 tensors"])




def test_a_folder_inside_a_hub_cache_snapshot_may_link_to_its_blobs(tmp_path):
    """`huggingface-cli download` of MiniMax-M3.1 puts `dspark/` inside the snapshot, its files linking to
    `../../../blobs/`: the bundled drafter's folder is read there as the snapshot itself is; a link out of
    the cache repo is still refused."""
    from specpack._paths import walk_files
    from specpack.errors import InputError

    repo = tmp_path / "models--org--m31"
    sub = repo / "snapshots" / ("a" * 40) / "dspark"
    sub.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "b1").write_text("{}")
    (sub / "config.json").symlink_to("../../../blobs/b1")
    assert walk_files(sub) == ["config.json"] and walk_files(sub.parent) == ["dspark/config.json"]
    (tmp_path / "elsewhere").write_text("x")
    (sub / "stray").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InputError, match="points outside"):
        walk_files(sub)
