"""Reading an artifact's manifest and listing its files."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from specpack._paths import IGNORED_NAMES
from specpack.errors import VerificationError
from specpack.schemas import MANIFEST_NAME, SIGNATURE_NAME, Manifest


def read_manifest(artifact: Path) -> Manifest:
    """Parse and validate `ARTIFACT/specpack.json`."""
    path = Path(artifact) / MANIFEST_NAME
    if not Path(artifact).is_dir():
        raise VerificationError(f"'{artifact}' is not a directory", hint="pass an artifact directory")
    if not path.is_file():
        raise VerificationError(f"'{artifact}' has no {MANIFEST_NAME}: not a specpack artifact",
                                hint="build one with `specpack build`")
    try:
        return Manifest.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VerificationError(f"{path} is not valid JSON: {exc}") from None
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise VerificationError(f"{path} does not match the manifest schema", problems=problems,
                                hint="the manifest was edited or written by another tool") from None


def write_manifest(artifact: Path, manifest: Manifest) -> Path:
    path = Path(artifact) / MANIFEST_NAME
    path.write_text(manifest.model_dump_json(indent=2, exclude_none=True) + "\n")
    return path


def list_files(artifact: Path) -> tuple[list[str], list[str]]:
    """(regular files, links or other non-files) under `artifact`, as relative POSIX paths,
    without the manifest, the signature and VCS metadata."""
    files, odd = [], []
    root = Path(artifact)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_NAMES)
        for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if name in IGNORED_NAMES or rel in (MANIFEST_NAME, SIGNATURE_NAME):
                continue
            (odd if path.is_symlink() or not path.is_file() else files).append(rel)
    return files, odd
