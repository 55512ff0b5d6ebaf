"""`keygen` writes the private key with mode 600 from its first byte and never through a link."""

import os
import stat

import pytest

from specpack.errors import InputError, OutputError
from specpack.packager import keygen


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_new_private_key_is_600(tmp_path):
    pair = keygen(tmp_path / "signer")
    assert _mode(pair.private) == 0o600
    assert pair.public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")


def test_force_over_a_world_readable_key_gives_600(tmp_path):
    old = tmp_path / "signer.pem"
    old.write_text("old key")
    old.chmod(0o644)
    pair = keygen(tmp_path / "signer", force=True)
    assert _mode(pair.private) == 0o600 and pair.private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY")
    assert not list(tmp_path.glob(".signer.*")), "a temporary key file was left behind"


def test_force_over_a_symlink_replaces_the_link_not_its_target(tmp_path):
    victim = tmp_path / "elsewhere" / "victim.pem"
    victim.parent.mkdir()
    victim.write_text("not yours")
    victim.chmod(0o644)
    (tmp_path / "signer.pem").symlink_to(victim)
    (tmp_path / "signer.pub").symlink_to(victim)
    pair = keygen(tmp_path / "signer", force=True)
    assert victim.read_text() == "not yours" and _mode(victim) == 0o644
    assert not pair.private.is_symlink() and not pair.public.is_symlink()
    assert _mode(pair.private) == 0o600


def test_dangling_symlink_is_refused_without_force(tmp_path):
    target = tmp_path / "elsewhere.pem"
    (tmp_path / "signer.pem").symlink_to(target)
    with pytest.raises(InputError, match="already exist"):
        keygen(tmp_path / "signer")
    assert not target.exists() and not (tmp_path / "signer.pub").exists()


def test_unwritable_location_is_an_output_error(tmp_path):
    (tmp_path / "signer.pem").mkdir()
    with pytest.raises(OutputError, match="cannot write key file"):
        keygen(tmp_path / "signer", force=True)
    assert not list(tmp_path.glob(".signer.*"))
