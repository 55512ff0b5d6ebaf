"""llama.cpp's EAGLE-3 drafter GGUFs in (issue 64 item 2): `build --drafter DRAFT.gguf` reads a head as
llama.cpp's converter writes it (gguf_fixtures.write_eagle3_gguf, from the vendored llama.cpp) and binds
the same canonical head as the head's own SGLang layout; every mismatch with the target and every bad
file is refused with exit 2, nothing written."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import eagle_layouts
import gguf_fixtures as gf

AUX_OUT, AUX_IN = [0, 2, 5], [1, 3, 6]  # the same three states in each convention


@pytest.fixture
def head(tiny_cfg):
    return eagle_layouts.random_head(tiny_cfg, draft_vocab=256)


@pytest.fixture
def embed(tiny_target):
    with safe_open(tiny_target / "model.safetensors", "pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def _gguf(tmp_path, head, cfg, **kw):
    return gf.write_eagle3_gguf(tmp_path / "head.gguf", head, cfg, kw.pop("target_layers", AUX_IN), cfg.vocab_size,
                                **kw)


def test_a_llamacpp_eagle3_gguf_binds_the_same_head_as_its_source_layout(tmp_path, tiny_target, tiny_cfg, head, embed,
                                                                         cli):
    sglang = eagle_layouts.write_sglang(tmp_path / "sglang", head, tiny_cfg, embed=embed, aux_ids=AUX_OUT)
    assert cli("build", tiny_target, "--drafter", sglang, "-o", tmp_path / "from-sglang")[0] == 0
    code, out, err = cli("build", tiny_target, "--drafter", _gguf(tmp_path, head, tiny_cfg), "-o", tmp_path / "art")
    assert code == 0, err
    d = json.loads((tmp_path / "art/specpack.json").read_text())["drafter"]
    assert (d["kind"], d["source_layout"]) == ("eagle3", "eagle3-llamacpp")
    assert d["aux_hidden_states"]["layer_ids"] == AUX_IN and d["aux_hidden_states"]["source_convention"] == "input_of_layer"
    assert d["vocab_map"] == "d2t" and d["draft_vocab_size"] == 256
    mine, theirs = (load_file(tmp_path / a / "drafter/model.safetensors") for a in ("art", "from-sglang"))
    assert set(mine) - {"t2d"} == set(theirs) - {"t2d"}
    for name in set(theirs) - {"t2d"}:
        assert torch.equal(mine[name], theirs[name]), name  # q/k un-permuted, d2t back to offsets, bit for bit
    assert cli("verify", tmp_path / "art")[0] == 0


def test_the_gguf_head_runs_losslessly(tmp_path, tiny_target, tiny_cfg, head, cli):
    art = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", _gguf(tmp_path, head, tiny_cfg), "-o", art)[0] == 0
    _, spec, _ = cli("run", art, "--prompt", "hello", "--max-new-tokens", "12", "--draft-len", "3", "--json")
    _, plain, _ = cli("run", art, "--prompt", "hello", "--max-new-tokens", "12", "--no-spec", "--json")
    spec, plain = json.loads(spec), json.loads(plain)
    assert spec["token_ids"] == plain["token_ids"] and spec["drafted_steps"] > 0


def _another_target_width(cfg):
    import copy

    wide = copy.deepcopy(cfg)
    wide.hidden_size, wide.intermediate_size = cfg.hidden_size * 2, cfg.intermediate_size * 2
    return wide


BAD = [
    ("made for a wider target", lambda tmp_path, head, cfg: gf.write_eagle3_gguf(
        tmp_path / "head.gguf", eagle_layouts.random_head(_another_target_width(cfg), draft_vocab=256),
        _another_target_width(cfg), AUX_IN, cfg.vocab_size), "drafter target_hidden_size 128 != target hidden size 64"),
    ("a target layer past the target", lambda tmp_path, head, cfg: _gguf(tmp_path, head, cfg, target_layers=[1, 3, 99]),
     "aux layer id 99"),
    ("norm_before_residual", lambda tmp_path, head, cfg: _gguf(tmp_path, head, cfg,
                                                              metadata={"norm_before_residual": True}),
     "eagle3.norm_before_residual is true"),
    ("a tensor llama.cpp does not write", lambda tmp_path, head, cfg: _gguf(
        tmp_path, head, cfg, extra_tensors=[("blk.0.attn_sinks.weight", np.zeros(4, dtype=np.float32), None)]),
     "tensor blk.0.attn_sinks.weight: not part of"),
    ("a missing layer tensor", lambda tmp_path, head, cfg: _gguf(tmp_path, head, cfg,
                                                                drop=("layers.0.mlp.up_proj.weight",)),
     "missing tensor"),
    ("a target GGUF passed as a drafter", lambda tmp_path, head, cfg: _gguf(tmp_path, head, cfg, arch="llama"),
     "not a drafter GGUF specpack reads"),
]


@pytest.mark.parametrize("case, write, expect", BAD, ids=[b[0] for b in BAD])
def test_a_bad_drafter_gguf_is_refused_naming_why(tmp_path, tiny_target, tiny_cfg, head, cli, case, write, expect):
    path = write(tmp_path, head, tiny_cfg)
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    code, _, err = cli("build", tiny_target, "--drafter", path, "-o", out)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert expect in err and not any(out.parent.iterdir()), err


def test_a_truncated_gguf_is_refused(tmp_path, tiny_target, tiny_cfg, head, cli):
    path = _gguf(tmp_path, head, tiny_cfg)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, _, err = cli("build", tiny_target, "--drafter", path, "-o", tmp_path / "art")
    assert code == 2 and "Traceback" not in err and not (tmp_path / "art").exists(), err
