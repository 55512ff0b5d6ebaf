"""Signing an existing artifact again, and what `inspect` shows of one."""

from __future__ import annotations

from pathlib import Path

from specpack.packager.artifact import read_manifest
from specpack.packager.verify import VerifyReport, verify
from specpack.schemas import SIGNATURE_NAME
from specpack.schemas.manifest import default_draft_len


def sign_artifact(artifact: Path, key: Path, progress: bool = False) -> VerifyReport:
    """Check every digest of `artifact`, then write (or replace) its signature with `key`, in one
    step: a bad key or an interruption leaves the artifact as it was."""
    from specpack.packager.update import check_update_options, recover, update_artifact

    check_update_options(artifact, key)
    recover(artifact)
    report = verify(artifact, progress=progress)
    with update_artifact(artifact, key=key):
        pass  # nothing but the signature changes
    return report


def describe(artifact: Path) -> dict:
    """What `specpack inspect` shows: the manifest plus signature presence, as plain data."""
    m = read_manifest(artifact)
    data = m.model_dump(mode="json", exclude_none=True)
    data["signed"] = (Path(artifact) / SIGNATURE_NAME).is_file()
    data["total_bytes"] = sum(f.size for f in m.files)
    data["default_draft_len"] = default_draft_len(m)
    return data
