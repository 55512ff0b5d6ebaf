import json
import os
import sys
from pathlib import Path

import pytest

import tiny

# Kernel settings stay at their defaults (they change speed, never results): no half-second
# measurement per weight format in a test run. tests/test_kernels.py measures on its own.
os.environ.setdefault("SPECPACK_KERNEL_TUNE", "0")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny 8-layer Llama target (defaults aux ids 2, 4, 5 are distinct)."""
    return tiny.make_target(tmp_path_factory.mktemp("target") / "tiny-llama", "llama",
                            num_hidden_layers=8)


@pytest.fixture(scope="session")
def tiny_cfg(tiny_target):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_target)


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run the real `specpack` entry point; return (exit code, stdout, stderr)."""
    from specpack.cli import main

    def run(*args):
        capsys.readouterr()  # drop what came before (e.g. fixture progress bars)
        monkeypatch.setattr(sys, "argv", ["specpack", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code or 0
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def keypair(tmp_path_factory):
    from specpack.packager import keygen

    return keygen(tmp_path_factory.mktemp("keys") / "signer")


def read_json(path):
    return json.loads(Path(path).read_text())
