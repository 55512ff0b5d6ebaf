"""Verifying an artifact: signature (when a key is given or required), then every digest."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from specpack.errors import VerificationError
from specpack.packager.artifact import list_files, read_manifest
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
                                hint="never load it: rebuild it or pull it again from its source")
    return VerifyReport(artifact, manifest, signed, public_key is not None, len(manifest.files),
                        sum(f.size for f in manifest.files))


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
    problems = [f"{p}: is a link or not a regular file" for p in odd]
    problems += [f"{p}: missing" for p in sorted(set(expected) - set(present))]
    problems += [f"{p}: extra file, not in the manifest" for p in sorted(set(present) - set(expected))]
    common = sorted(set(expected) & set(present))
    with byte_bar(sum(expected[p].size for p in common), "verifying", progress) as bar:
        digests = parallel_map(lambda p: sha256_file(artifact / p, bar.update), common)
    problems += [f"{p}: changed (sha256 {d[:12]}…, expected {expected[p].sha256[:12]}…)"
                 for p, d in zip(common, digests) if d != expected[p].sha256]
    return problems


