"""Changing an artifact in place (`export --to onnx|tensorrt`, `tune`, `sign`) as one transaction.

    with update_artifact(ART, key=KEY, what="adding the ONNX export") as u:
        folder = u.stage("exports/onnx")            # fill it; it replaces exports/onnx/ at the end
        u.manifest_update["exports"] = exports      # manifest fields to change
    # the block ended: the new manifest (staged files listed with size and SHA-256) and the new
    # signature are written beside the artifact, then everything is swapped in at once

The key is checked, and a signed artifact without one refused, before anything is written; the
artifact itself changes only in the last step (`specpack._atomic.Transaction`): an error, Ctrl-C or
a killed process leaves it as it was, and the next command on it rolls back what a dead one left.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from specpack._atomic import Transaction, clean_stale, transaction
from specpack._paths import check_relpath
from specpack.errors import InputError
from specpack.packager.artifact import read_manifest, write_manifest
from specpack.packager.hashing import sha256_file
from specpack.packager.signing import check_signing_key, sign
from specpack.schemas import MANIFEST_NAME, SIGNATURE_NAME, FileEntry, Manifest


def recover(artifact: Path) -> None:
    """Roll back what a killed in-place command left beside `artifact`: every command that changes
    an artifact runs this before it reads it."""
    clean_stale(Path(artifact))


class ArtifactUpdate:
    """The pending change: staged paths (replacing what is there) and manifest fields."""

    def __init__(self, artifact: Path, txn: Transaction, manifest: Manifest):
        self.artifact, self.txn, self.manifest = artifact, txn, manifest
        self.manifest_update: dict = {}
        self.paths: list[str] = []

    def stage(self, rel: str) -> Path:
        """Where the new `rel` (a file, or a folder to create and fill) goes until the commit."""
        rel = check_relpath(rel, "artifact update")
        if rel in (MANIFEST_NAME, SIGNATURE_NAME):
            raise ValueError(f"{rel} is written by the update itself")  # a bug in the caller
        self.paths.append(rel)
        return self.txn.stage(rel)

    def finish(self, key: Path | None, drop_signature: bool) -> Manifest:
        """Stage the new manifest and signature (or the signature's removal); return the manifest."""
        manifest = self.manifest
        if self.paths or self.manifest_update:
            manifest = self._new_manifest()
            write_manifest(self.txn.stage(MANIFEST_NAME).parent, manifest)
        if key is not None:
            manifest_path = self.txn.staged(MANIFEST_NAME) if MANIFEST_NAME in self.txn.units \
                else self.artifact / MANIFEST_NAME
            digests = {f.path: f.sha256 for f in manifest.files} | {MANIFEST_NAME: sha256_file(manifest_path)}
            sign(self.txn.stage(SIGNATURE_NAME).parent, digests, key, manifest.name)
        elif drop_signature:
            self.txn.delete(SIGNATURE_NAME)
        return manifest

    def _new_manifest(self) -> Manifest:
        replaced = tuple(self.paths)
        kept = [f for f in self.manifest.files
                if not any(f.path == p or f.path.startswith(p + "/") for p in replaced)]
        data = self.manifest.model_dump(exclude_none=True)
        data.update(self.manifest_update)
        data["files"] = sorted(kept + [e for p in replaced for e in self._entries(p)], key=lambda f: f.path)
        return Manifest.model_validate(data)

    def _entries(self, rel: str) -> list[FileEntry]:
        root = self.txn.staged(rel)
        files = [root] if root.is_file() else sorted(Path(d) / n for d, _, names in os.walk(root) for n in names)
        return [FileEntry(path=(Path(rel) / f.relative_to(root)).as_posix() if f != root else rel,
                          size=f.stat().st_size, sha256=sha256_file(f)) for f in files]


@contextlib.contextmanager
def update_artifact(artifact: Path, key: Path | None = None, drop_signature: bool = False,
                    what: str = "this change", **hint):
    """Yield an `ArtifactUpdate` of `artifact`; when the block ends, re-sign with `key` (or, with
    `drop_signature`, leave it unsigned) and swap everything in at once."""
    artifact = Path(artifact)
    check_update_options(artifact, key, drop_signature, what, **hint)
    with transaction(artifact) as txn:
        update = ArtifactUpdate(artifact, txn, read_manifest(artifact))
        yield update
        update.finish(key, drop_signature and (artifact / SIGNATURE_NAME).is_file())


def check_update_options(artifact: Path, key: Path | None, drop_signature: bool = False,
                         what: str = "this change", hint: str = "pass --key KEY.pem to re-sign it") -> None:
    """Refuse, before any work, a key that cannot sign and a signed artifact without a key (`hint`
    names the command's option)."""
    if key is not None:
        check_signing_key(key)
    elif (Path(artifact) / SIGNATURE_NAME).is_file() and not drop_signature:
        raise InputError(f"'{artifact}' is signed: {what} changes specpack.json, which the signature covers",
                         hint=hint)
