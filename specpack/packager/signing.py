"""Signatures through OpenSSF model-signing (elliptic-curve keys, offline).

The signed payload is model-signing's own in-toto manifest (file serialization, SHA-256), built
from the digests the build already computed, so each byte is hashed once. The result verifies
with the upstream CLI too: `model_signing verify key ARTIFACT --signature ARTIFACT/model.sig
--public_key KEY.pub`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from specpack.errors import InputError, VerificationError
from specpack.schemas import SIGNATURE_NAME


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path


def keygen(out_prefix: Path, force: bool = False) -> KeyPair:
    """Write an ECDSA P-256 key pair: `PREFIX.pem` (private, mode 600) and `PREFIX.pub`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pair = KeyPair(Path(f"{out_prefix}.pem"), Path(f"{out_prefix}.pub"))
    clashes = [str(p) for p in (pair.private, pair.public) if p.exists()]
    if clashes and not force:
        raise InputError("key files already exist", problems=clashes, hint="pass --force to replace them")
    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    pair.private.touch(mode=0o600, exist_ok=True)
    pair.private.write_bytes(private)
    pair.public.write_bytes(public)
    return pair


def sign(artifact: Path, digests: dict[str, str], key: Path, name: str) -> Path:
    """Sign `digests` (relative path -> sha256 hex, every file but the signature) with `key`."""
    from model_signing import manifest as ms_manifest
    from model_signing._hashing import hashing as ms_hashing
    from model_signing._signing import signing as ms_signing

    items = [ms_manifest.FileManifestItem(path=PurePosixPath(p),
                                          digest=ms_hashing.Digest("sha256", bytes.fromhex(d)))
             for p, d in sorted(digests.items())]
    serialization = ms_manifest._FileSerialization("sha256", False, ignore_paths=[SIGNATURE_NAME])
    payload = ms_signing.Payload(ms_manifest.Manifest(name, items, serialization))
    path = Path(artifact) / SIGNATURE_NAME
    check_signing_key(key).sign(payload).write(path)
    return path


def check_signing_key(key: Path):
    """The model-signing signer for the private key at `key`, or an InputError saying why it cannot
    sign (missing, a public key, not elliptic-curve). Commands call it before their first write."""
    from model_signing._signing import sign_ec_key

    try:
        return sign_ec_key.Signer(Path(key))
    except (ValueError, TypeError, OSError) as exc:
        raise InputError(f"cannot sign with '{key}': {exc}",
                         hint="pass the PEM elliptic-curve private key (the .pem of `specpack keygen`, "
                              "not the .pub)") from None


def signed_digests(artifact: Path, public_key: Path) -> dict[str, str]:
    """Check the signature of `artifact` against `public_key`; return the signed digests."""
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    sig_path = Path(artifact) / SIGNATURE_NAME
    try:
        verifier = sign_ec_key.Verifier(Path(public_key))
    except (ValueError, TypeError, OSError) as exc:
        raise InputError(f"cannot use public key '{public_key}': {exc}",
                         hint="pass the PEM public key (.pub) that matches the signing key") from None
    try:
        manifest = verifier.verify(sign_sigstore_pb.Signature.read(sig_path))
    except Exception as exc:  # model-signing raises plain ValueError/crypto errors on bad bundles
        raise VerificationError(f"signature {sig_path} does not verify with '{public_key}': {exc}",
                                hint="the artifact was changed after signing, or signed with another key") \
            from None
    return {rd.identifier: rd.digest.digest_hex for rd in manifest.resource_descriptors()}
