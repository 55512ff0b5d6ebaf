"""The files an engine loaded are the files verified: `recheck` verifies the artifact again once the
engine answers /health, and the export's files against what it wrote (engines/__init__.py, server.py)."""

from __future__ import annotations

from pathlib import Path

from specpack._machine import ENGINES
from specpack.errors import VerificationError


def file_digests(folder: Path) -> tuple[tuple[str, str], ...]:
    from specpack.packager.hashing import sha256_file

    return tuple((str(p.relative_to(folder)), sha256_file(p)) for p in sorted(Path(folder).rglob("*")) if p.is_file())


def recheck(launch) -> None:
    """Raise VerificationError (naming each file) when what the engine may have loaded differs from what
    `prepare` verified: the artifact verified again (its signature too when a key was given), its
    manifest the one verified then, the export's files as the export wrote them."""
    from specpack.packager.hashing import sha256_file
    from specpack.packager.verify import verify
    from specpack.schemas import MANIFEST_NAME

    if launch.artifact is None:
        return
    problems = []
    manifest = launch.artifact / MANIFEST_NAME
    if not manifest.is_file() or sha256_file(manifest) != launch.manifest_sha256:
        problems.append(f"{MANIFEST_NAME}: changed since it was verified")
    try:
        verify(launch.artifact, public_key=launch.public_key)
    except VerificationError as exc:
        problems += exc.problems
    if launch.export_digests:
        was, now = dict(launch.export_digests), dict(file_digests(launch.export_dir))
        problems += [f"{launch.export_dir / p}: changed since the export wrote it" for p in sorted(was.keys() | now.keys())
                     if was.get(p) != now.get(p)]
    if problems:
        raise VerificationError(f"the files {ENGINES[launch.engine].label} loaded from '{launch.artifact}' are not the "
                                "files verified before it started: it was stopped", problems=problems,
                                hint="find what changed the artifact; `specpack verify` it, or pull or rebuild it, "
                                     "then serve again")
