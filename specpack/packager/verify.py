"""Verifying an artifact: signature (when a key is given or required), then every digest."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from specpack._atomic import interrupted_updates
from specpack._paths import check_relpath
from specpack.errors import InputError, VerificationError
from specpack.packager.artifact import list_files, read_manifest, read_path_problems
from specpack.packager.hashing import parallel_map, sha256_file
from specpack.packager.progress import byte_bar
from specpack.packager.signing import signed_digests
from specpack.schemas import MANIFEST_NAME, SIGNATURE_NAME, Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyReport:
    artifact: Path
    manifest: Manifest
    signed: bool
    signature_checked: bool
    files: int
    bytes: int

    @property
    def trust(self) -> str:
        if self.signature_checked:
            return "signature and digests verified"
        if self.signed:
            return "digests verified; signature present but not checked (pass --key)"
        return "digests verified; UNSIGNED (integrity only, not authenticity)"


def verify(artifact: Path, public_key: Path | None = None, require_signature: bool = False,
           progress: bool = False) -> VerifyReport:
    """Check `artifact`; raise VerificationError naming every changed, missing and extra file."""
    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    signed = (artifact / SIGNATURE_NAME).is_file()
    problems = _signature_problems(artifact, manifest, public_key, require_signature, signed)
    problems += _file_problems(artifact, manifest, progress)
    if problems:
        raise VerificationError(f"artifact '{artifact}' failed verification", problems=problems,
                                hint=_failure_hint(artifact))
    return VerifyReport(artifact, manifest, signed, public_key is not None, len(manifest.files),
                        sum(f.size for f in manifest.files))


def _failure_hint(artifact: Path) -> str:
    killed = interrupted_updates(artifact)
    if killed:
        return (f"a command changing it was killed midway ({killed[0]} is beside it): run that command "
                "(export, tune or sign) again, it first rolls the half-done change back")
    return "never load it: rebuild it or pull it again from its source"


def check_paths(artifact: Path, manifest: Manifest) -> None:
    """What loading needs even when the digests are not checked (`load(verify=False)`): no links or
    other non-files, and every path the runtime reads through the artifact's files a listed file."""
    artifact = Path(artifact)
    _, odd = list_files(artifact)
    problems = [f"{p}: {what}" for p, what in sorted(odd.items())]
    problems += read_path_problems(artifact, {f.path for f in manifest.files if _plain(f.path)})
    if problems:
        raise VerificationError(f"artifact '{artifact}' cannot be loaded safely", problems=problems,
                                hint="never load it: rebuild it or pull it again from its source")


def _signature_problems(artifact, manifest, public_key, require_signature, signed) -> list[str]:
    if public_key is None:
        if require_signature:
            raise VerificationError("a signature is required but no public key was given",
                                    hint="pass --key PUB.pem (or set SPECPACK_PUBLIC_KEY)")
        return []
    if not signed:
        raise VerificationError(f"artifact '{artifact}' is not signed ({SIGNATURE_NAME} missing)",
                                hint="sign it with `specpack sign ARTIFACT --key KEY.pem`")
    signed_set = signed_digests(artifact, public_key)
    expected = {f.path: f.sha256 for f in manifest.files}
    expected[MANIFEST_NAME] = sha256_file(artifact / MANIFEST_NAME)
    problems = [f"{p}: changed since signing" for p in sorted(expected)
                if p in signed_set and signed_set[p] != expected[p]]
    problems += [f"{p}: not covered by the signature" for p in sorted(set(expected) - set(signed_set))]
    problems += [f"{p}: signed but not in the manifest" for p in sorted(set(signed_set) - set(expected))]
    return problems


def _file_problems(artifact: Path, manifest: Manifest, progress: bool) -> list[str]:
    present, odd = list_files(artifact)
    expected = {f.path: f for f in manifest.files}
    problems = [f"{p}: {what}" for p, what in sorted(odd.items())]
    problems += [f"{p}: not a plain relative path inside the artifact" for p in sorted(expected)
                 if not _plain(p)]
    problems += [f"{p}: missing" for p in sorted(set(expected) - set(present)) if _plain(p)]
    problems += [f"{p}: extra file, not in the manifest" for p in sorted(set(present) - set(expected))]
    common = sorted(set(expected) & set(present))
    with byte_bar(sum(expected[p].size for p in common), "verifying", progress) as bar:
        digests = parallel_map(lambda p: sha256_file(artifact / p, bar.update), common)
    problems += [f"{p}: changed (sha256 {d[:12]}…, expected {expected[p].sha256[:12]}…)"
                 for p, d in zip(common, digests) if d != expected[p].sha256]
    return problems + read_path_problems(artifact, {p for p in expected if _plain(p)})


def _plain(path: str) -> bool:
    try:
        return check_relpath(path, "manifest") == path
    except InputError:
        return False
