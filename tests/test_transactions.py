"""Commands that write: options are checked before the first write, in-place changes (export --to onnx,
tune, sign) are transactions that a failure, Ctrl-C or a killed process cannot leave half done, and
what dead processes left behind is cleaned up (or rolled back) by the next run, never a live one's."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from specpack import _atomic
from specpack.errors import OutputError
from specpack.packager import BuildOptions, NgramParams, build, sign_artifact, verify


@pytest.fixture
def signed(tmp_path, tiny_target, keypair):
    out = tmp_path / "art"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=out, key=keypair.private,
                       ngram=NgramParams(1, 3, 4)))
    return out


def snapshot(folder):
    """{relative path: bytes} of every file under `folder`, hidden ones included."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder):
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- every option is checked before the first write ----

@pytest.mark.parametrize("command", [
    ["export", "{art}", "--to", "onnx", "--signing-key", "{pub}"],
    ["export", "{art}", "--to", "onnx", "--signing-key", "{missing}"],
    ["tune", "{art}", "--workload", "{workload}", "--key", "{pub}"],
    ["tune", "{art}", "--workload", "{workload}", "--key", "{missing}"],
    ["sign", "{art}", "--key", "{pub}"],
])
def test_a_key_that_cannot_sign_changes_nothing(command, signed, keypair, tmp_path, cli):
    workload = tmp_path / "wl.jsonl"
    workload.write_text('{"prompt": "def add(a, b):"}\n')
    names = dict(art=signed, pub=keypair.public, missing=tmp_path / "nope.pem", workload=workload)
    before = snapshot(signed)
    code, out, err = cli(*[part.format(**names) for part in command])
    assert snapshot(signed) == before and leftovers(signed) == []
    assert code == 2 and "cannot sign with" in err and "Traceback" not in err, out + err
    assert verify(signed, keypair.public, require_signature=True).signature_checked


# ---- in-place changes are transactions ----

def test_interrupted_sign_leaves_the_artifact_as_it_was(signed, keypair, monkeypatch):
    before = snapshot(signed)
    real = _atomic._swap_in

    def interrupted(root, txn, rel, delete):
        real(root, txn, rel, delete)
        raise KeyboardInterrupt  # Ctrl-C right after the new signature was moved in

    monkeypatch.setattr(_atomic, "_swap_in", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sign_artifact(signed, keypair.private)
    assert snapshot(signed) == before and leftovers(signed) == []


KILLED_EXPORT = """
import os, sys
import specpack._atomic as atomic
from specpack.exports.onnx import export_onnx

real = atomic._swap_in

def killed(root, txn, rel, delete):
    real(root, txn, rel, delete)
    if rel == "exports/onnx":  # moved in; the manifest and signature not yet: die as kill -9 would
        os._exit(9)

atomic._swap_in = killed
export_onnx(sys.argv[1], key=sys.argv[2], progress=False)
"""


def test_export_killed_midway_is_rolled_back_by_the_next_run(signed, keypair, cli, caplog):
    before = snapshot(signed)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_EXPORT), signed, keypair.private],
                            stderr=subprocess.PIPE, text=True)
    assert proc.wait(timeout=300) == 9, proc.stderr.read()
    assert (signed / "exports/onnx").is_dir() and leftovers(signed) == [f".art.{proc.pid}.update"]
    code, _, err = cli("verify", signed, "--key", keypair.public)
    assert code == 3 and "exports/onnx/index.json: extra file" in err  # the broken state of the issue
    assert "was killed midway" in err and "run that command" in err

    with caplog.at_level(logging.WARNING, logger=_atomic.__name__):
        code, out, err = cli("sign", signed, "--key", keypair.private)  # any in-place command repairs it
    assert code == 0, out + err
    assert f"rolled back the interrupted change of art in .art.{proc.pid}.update (process {proc.pid} is gone)" \
        in caplog.text
    assert snapshot(signed).keys() == before.keys() and leftovers(signed) == []
    assert snapshot(signed)["specpack.json"] == before["specpack.json"]
    code, out, err = cli("export", signed, "--to", "onnx", "--signing-key", keypair.private)
    assert code == 0, out + err  # and the export runs again
    assert verify(signed, keypair.public, require_signature=True).signature_checked


def test_a_live_update_is_never_touched(signed, keypair):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = signed.with_name(f".{signed.name}.{sleeper.pid}.update")
        busy.mkdir()
        with pytest.raises(OutputError, match=f"being changed by process {sleeper.pid}"):
            sign_artifact(signed, keypair.private)
        assert busy.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    sign_artifact(signed, keypair.private)  # its process is gone now: cleaned up
    assert not busy.exists()


# ---- stale partial outputs ----

PARTIAL = """
import os, sys
from pathlib import Path
from specpack._atomic import staging_dir

staging = staging_dir(Path(sys.argv[1]))
tmp = staging.__enter__()
(tmp / "model.safetensors").write_bytes(b"half a model")
print(tmp.name, flush=True)
os._exit(9)  # killed in the middle of a build or pull
"""


def test_stale_partials_of_dead_processes_are_removed_and_live_ones_kept(tmp_path, tiny_target, caplog):
    out = tmp_path / "art"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PARTIAL), out], stdout=subprocess.PIPE, text=True)
    assert proc.wait(timeout=120) == 9
    dead = tmp_path / proc.stdout.read().strip()
    assert dead.name.startswith(f".art.{proc.pid}.") and dead.name.endswith(".partial") and dead.is_dir()
    live = tmp_path / f".art.{os.getpid()}.abcdefgh.partial"  # this process's: alive
    live.mkdir()
    other = tmp_path / f".other.{dead_pid()}.abcdefgh.partial"  # another output's: not ours to judge
    other.mkdir()
    with caplog.at_level(logging.WARNING, logger=_atomic.__name__):
        build(BuildOptions(target=tiny_target, drafter="ngram", out=out))
    assert not dead.exists() and live.is_dir() and other.is_dir()
    assert f"removed stale partial output {dead.name} (process {proc.pid} is gone)" in caplog.text


def test_output_moved_aside_by_a_dead_process_is_restored(tmp_path, tiny_target):
    out = tmp_path / "art"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=out))
    aside = tmp_path / f".art.old-{dead_pid()}"
    out.rename(aside)  # killed between moving the old output aside and renaming the new one in
    with pytest.raises(OutputError, match="already exists"):
        build(BuildOptions(target=tiny_target, drafter="ngram", out=out))
    assert verify(out) and not aside.exists()


# ---- outputs that are links ----

def test_build_over_a_symlink_is_refused_and_touches_nothing(tmp_path, tiny_target, cli):
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    code, out, err = cli("build", tiny_target, "--drafter", "ngram", "-o", link, "--force")
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, out + err
    assert "is a symbolic link" in err and str(real) in err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert snapshot(real) == {"keep.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_transaction_helper_undoes_a_half_done_change_and_keeps_a_done_one(tmp_path):
    """The journal alone is enough: a change killed after any step is put back, one marked done kept."""
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x").write_text("old x")
    (root / "keep").write_text("keep")
    old, new = {"a/x": b"old x", "keep": b"keep"}, {"a/y": b"new y", "b/c": b"new c"}
    for steps, expected in [(0, old), (1, old), (2, old), (3, old), ("done", new)]:
        txn = _atomic.Transaction(root)
        txn.stage("a").mkdir()
        (txn.staged("a") / "y").write_text("new y")
        txn.stage("b/c").write_text("new c")
        txn.delete("keep")
        _atomic._write_atomic(txn.dir / _atomic.JOURNAL, '{"units": [["a", false], ["b/c", false], ["keep", true]]}')
        for rel, delete in list(txn.units.items())[: 3 if steps == "done" else steps]:
            _atomic._swap_in(root, txn.dir, rel, delete)
        if steps == "done":
            _atomic._write_atomic(txn.dir / _atomic.DONE, "")
        txn.dir.rename(root.with_name(f".root.{dead_pid()}.update"))  # as if its process died here
        _atomic.clean_stale(root)
        assert snapshot(root) == expected, steps
        assert not [p for p in root.rglob("*") if p.is_dir() and not any(p.iterdir())], "empty folder left"
        assert leftovers(root) == []
