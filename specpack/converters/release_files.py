"""The files of a release, local or remote, behind one small interface (issue 61 item 3): what every
check of a target reads before it touches a weight.

    files.list()               -> every file, relative, sorted (pickles included: the checks name them)
    files.exists(rel)          -> bool
    files.json(rel, what)      -> a JSON object (an InputError naming `what` otherwise)
    files.header(rel)          -> a safetensors header, every entry checked to lie inside the file
    files.sha256(rel)          -> the file's SHA-256
    files.label(rel)           -> how messages name the file

`LocalFiles` reads a directory; converters/hub_files.HubFiles reads a hub repository at one commit by
range requests. target_hf reads a target's config, index and headers through it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specpack._paths import walk_files
from specpack.converters.safetensors_header import TensorMeta, read_header
from specpack.errors import InputError


class LocalFiles:
    """A directory; `only`: the files of it that count (a hub cache snapshot may hold more than a build fetched)."""

    def __init__(self, root: Path, only: tuple[str, ...] | None = None):
        self.root, self.only = Path(root), None if only is None else frozenset(only)

    def list(self) -> list[str]:
        listed = walk_files(self.root)
        return listed if self.only is None else [f for f in listed if f in self.only]

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def json(self, rel: str, what: str) -> dict:
        return read_json(self.root / rel, what)

    def header(self, rel: str) -> dict[str, TensorMeta]:
        return read_header(self.root / rel)

    def sha256(self, rel: str) -> str:
        return hashlib.sha256((self.root / rel).read_bytes()).hexdigest()

    def label(self, rel: str = "") -> str:
        return str(self.root / rel) if rel else str(self.root)


class SubFiles:
    """The files of a release under `prefix/` (a bundled drafter's folder), as a reader of their own."""

    def __init__(self, reader, prefix: str):
        self.reader, self.prefix = reader, prefix.rstrip("/") + "/"

    def list(self) -> list[str]:
        return [f[len(self.prefix):] for f in self.reader.list() if f.startswith(self.prefix)]

    def exists(self, rel: str) -> bool:
        return self.reader.exists(self.prefix + rel)

    def json(self, rel: str, what: str) -> dict:
        return self.reader.json(self.prefix + rel, what)

    def header(self, rel: str) -> dict[str, TensorMeta]:
        return self.reader.header(self.prefix + rel)

    def sha256(self, rel: str) -> str:
        return self.reader.sha256(self.prefix + rel)

    def label(self, rel: str = "") -> str:
        return self.reader.label(self.prefix + rel).rstrip("/")


def read_json(path: Path, what: str) -> dict:
    """`path` as a JSON object, or an InputError naming `what` and the defect."""
    if not path.is_file():
        raise InputError(f"{what} not found: {path}", hint="is this the right directory?")
    return json_object(path.read_bytes(), what, str(path))


def json_object(raw: bytes, what: str, where: str) -> dict:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{what} {where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InputError(f"{what} {where} is nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise InputError(f"{what} {where} is not a JSON object")
    return data
