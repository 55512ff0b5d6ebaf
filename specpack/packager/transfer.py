"""What hub and OCI transfers share: the files an upload carries (after verifying them), the trust
check a download must pass before it is renamed into place, and the results both return.

A push never publishes an artifact that fails verification. A pull downloads into a hidden
directory beside OUT (`specpack._atomic.staging_dir`), verifies it there, and only then renames
it to OUT; on any failure the partial download is removed and OUT is left as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from specpack.errors import SpecpackError, VerificationError
from specpack.packager.hashing import sha256_file
from specpack.packager.verify import VerifyReport, verify
from specpack.schemas import MANIFEST_NAME, SIGNATURE_NAME

log = logging.getLogger(__name__)

UNSIGNED_HINT = ("pass --key PUB.pem to check the signature, or --allow-unsigned to accept "
                 "digests only (integrity, not authenticity)")


class TransferError(SpecpackError):
    """A registry or hub refused, could not be reached, or does not hold what was asked for."""


@dataclass(frozen=True)
class ArtifactFile:
    path: str  # relative POSIX path inside the artifact
    size: int
    sha256: str


@dataclass(frozen=True)
class PushResult:
    destination: str  # e.g. "hf://org/name@main" or "oci://host/repo:tag"
    revision: str  # hub commit sha, or OCI manifest digest
    files: int
    bytes: int
    url: str | None = None


@dataclass(frozen=True)
class PullResult:
    out: Path
    source: str
    revision: str
    report: VerifyReport

    @property
    def trust(self) -> str:
        return self.report.trust


def files_to_upload(artifact: Path, public_key: Path | None = None,
                    progress: bool = False) -> tuple[VerifyReport, list[ArtifactFile]]:
    """Verify `artifact` (never publish a broken one) and list every file an upload must carry:
    the manifest's files, `specpack.json` and the signature when there is one."""
    artifact = Path(artifact)
    try:
        report = verify(artifact, public_key=public_key, progress=progress)
    except VerificationError as exc:
        raise VerificationError(f"refusing to publish '{artifact}': it does not verify",
                                problems=exc.problems or [exc.message],
                                hint="rebuild it (or fix and re-sign it) and push again") from None
    files = [ArtifactFile(f.path, f.size, f.sha256) for f in report.manifest.files]
    for name in (MANIFEST_NAME, SIGNATURE_NAME):
        if (artifact / name).is_file():
            files.append(ArtifactFile(name, (artifact / name).stat().st_size,
                                      sha256_file(artifact / name)))
    return report, files


def require_trust_choice(public_key: Path | None, allow_unsigned: bool, source: str) -> None:
    """Refuse before downloading anything when the caller gave no way to trust the result."""
    if public_key is None and not allow_unsigned:
        raise VerificationError(f"no public key given to check {source}", hint=UNSIGNED_HINT)


def check_download(tmp: Path, public_key: Path | None, allow_unsigned: bool, source: str,
                   progress: bool = False) -> VerifyReport:
    """Verify a finished download in its staging dir: the signature with `public_key` (given a key,
    a missing signature fails: `allow_unsigned` only stands in for a key, it never lowers one), and
    always every digest."""
    signed = (Path(tmp) / SIGNATURE_NAME).is_file()
    if public_key is not None and not signed:
        raise VerificationError(f"{source} is not signed ({SIGNATURE_NAME} missing), but a key was given "
                                "to check its signature",
                                hint="ask its publisher for a signed artifact; to accept digests only, "
                                     "pull without --key and with --allow-unsigned")
    if public_key is None:
        log.warning("%s: digests only, the signature is not checked", source)
    try:
        return verify(tmp, public_key=public_key, progress=progress)
    except VerificationError as exc:
        raise VerificationError(f"{source} failed verification; the download was removed",
                                problems=exc.problems or [exc.message],
                                hint="the remote copy is corrupt or was tampered with: do not use "
                                     "it; pull again or ask its publisher") from None
