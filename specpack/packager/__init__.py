"""Packaging: build, sign, verify and describe artifacts.

    build(BuildOptions(...))          collect → convert → manifest → hash → sign (atomic)
    verify(path, public_key=...)      signature + every digest; names every bad file
    sign_artifact(path, key)          (re-)sign an artifact after checking its digests
    keygen(prefix)                    an ECDSA P-256 key pair for signing
    describe(path)                    a summary of target, drafter, bindings, memory, files
"""

from __future__ import annotations

from specpack.packager.artifacts import describe, sign_artifact
from specpack.packager.artifact import read_manifest
from specpack.packager.build import BuildOptions, BuildResult, NgramParams, build
from specpack.packager.signing import keygen
from specpack.packager.verify import VerifyReport, verify

__all__ = ["BuildOptions", "BuildResult", "NgramParams", "VerifyReport", "build", "describe",
           "keygen", "read_manifest", "sign_artifact", "verify"]
