"""Weight files specpack writes get the mode the user's umask gives any other file (safetensors'
save_file writes 0600, which a service account or a container running as another user cannot read):
build's drafter weights, import-gguf's output and an engine export's weights (issue 63 item 6)."""

import os
import stat

import pytest

import block_layouts as bl
from specpack.exports import export_engine
from specpack.packager import BuildOptions, build
from test_export_engines import _build, _head
from test_gguf import build_model, gguf_file, tok_dir  # noqa: F401 (tok_dir is a fixture)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_build_writes_the_drafter_weights_readable_by_others(tmp_path, tiny_target, umask_022):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    build(BuildOptions(target=tiny_target, drafter=str(head), out=tmp_path / "art"))
    assert _mode(tmp_path / "art" / "drafter" / "model.safetensors") == umask_022


def test_import_gguf_writes_weights_readable_by_others(tmp_path, tok_dir, umask_022):  # noqa: F811
    from specpack.converters.gguf import import_gguf

    import_gguf(gguf_file(tmp_path, build_model("llama"), tok_dir), tmp_path / "out", progress=False)
    assert _mode(tmp_path / "out" / "model.safetensors") == umask_022


def test_an_engine_export_writes_weights_readable_by_others(tmp_path, tiny_cfg, tiny_target, umask_022):
    art = _build(tmp_path, tiny_target, _head(tmp_path, tiny_cfg, tiny_target))
    export_engine(art, "vllm", tmp_path / "vllm")
    weights = list((tmp_path / "vllm").rglob("*.safetensors"))
    assert weights and all(_mode(w) == umask_022 for w in weights)


def test_a_stricter_umask_is_honoured(tmp_path, tiny_target):
    old = os.umask(0o077)
    try:
        head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
        build(BuildOptions(target=tiny_target, drafter=str(head), out=tmp_path / "art"))
    finally:
        os.umask(old)
    assert _mode(tmp_path / "art" / "drafter" / "model.safetensors") == 0o600
