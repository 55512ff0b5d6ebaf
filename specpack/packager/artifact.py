"""Reading an artifact's manifest and listing its files."""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

from pydantic import ValidationError

from specpack._paths import check_relpath
from specpack.converters.target_hf import INDEX_NAME as SAFETENSORS_INDEX
from specpack.errors import InputError, VerificationError
from specpack.schemas import MANIFEST_NAME, SIGNATURE_NAME, Manifest
from specpack.schemas.exports import ONNX_DIR, ONNX_INDEX_NAME, OnnxExport


def read_manifest(artifact: Path) -> Manifest:
    """Parse and validate `ARTIFACT/specpack.json`."""
    path = Path(artifact) / MANIFEST_NAME
    # a path that is no artifact is the user's mistake (exit 2); exit 3 is kept for an artifact that fails
    if not Path(artifact).is_dir():
        raise InputError(f"'{artifact}' is not a directory", hint="pass an artifact directory (`specpack build` "
                                                                 "makes one)")
    if not path.is_file():
        raise InputError(f"'{artifact}' has no {MANIFEST_NAME}: not a specpack artifact",
                         hint="build one with `specpack build TARGET --drafter ... -o ART`; `specpack inspect DIR` "
                              "lists what a model directory bundles")
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


def list_files(artifact: Path) -> tuple[list[str], dict[str, str]]:
    """(regular files, {path: what else it is}) under `artifact`, as relative POSIX paths, without
    the manifest and the signature. Every name at any depth counts, hidden ones too (`.git/`,
    `.cache/`): links, empty folders, unreadable folders and other non-files are in the second part."""
    files, odd = [], {}
    root = Path(artifact)

    def unreadable(exc: OSError) -> None:
        odd[Path(exc.filename).relative_to(root).as_posix() + "/"] = f"cannot be read ({exc.strerror})"

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        here = Path(dirpath)
        if here != root and not dirnames and not filenames:
            odd[here.relative_to(root).as_posix() + "/"] = "is an empty folder, not in the manifest"
        for name in sorted(filenames + [d for d in dirnames if (here / d).is_symlink()]):
            path = here / name
            rel = path.relative_to(root).as_posix()
            if rel in (MANIFEST_NAME, SIGNATURE_NAME):
                continue
            if path.is_symlink() or not path.is_file():
                odd[rel] = "is a link" if path.is_symlink() else "is not a regular file"
            else:
                files.append(rel)
    return files, odd


# ---- what the runtime reads through the artifact's own files ----

def read_path_problems(artifact: Path, listed: set[str]) -> list[str]:
    """Paths named inside the artifact's files that the runtime opens (safetensors index weight maps,
    at any depth; the ONNX export's graphs, weights file and external data) that are not a plain
    relative path to a file in `listed`: each would let a signed artifact read a file outside it."""
    artifact, problems = Path(artifact), []
    readable = {p for p in listed if (artifact / p).is_file() and not (artifact / p).is_symlink()}
    for rel in sorted(p for p in readable if PurePosixPath(p).name == SAFETENSORS_INDEX):
        problems += _weight_map_problems(artifact, rel, listed)
    if f"{ONNX_DIR}/{ONNX_INDEX_NAME}" in readable:
        problems += _onnx_problems(artifact, listed, readable)
    return problems


def _named_problems(name, where: str, folder: PurePosixPath, listed: set[str]) -> list[str]:
    """`name`, as written in the file `where`, relative to `folder`: a listed file, or a problem."""
    try:
        rel = (folder / check_relpath(name, where)).as_posix() if isinstance(name, str) else None
    except InputError:
        return [f"{where}: names '{name}', a path outside its folder"]
    if rel is None:
        return [f"{where}: names {name!r}, which is not a path"]
    return [] if rel in listed else [f"{where}: names '{name}', which is not a file listed in the manifest"]


def _weight_map_problems(artifact: Path, rel: str, listed: set[str]) -> list[str]:
    try:
        weight_map = json.loads((artifact / rel).read_text())["weight_map"]
        names = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [f"{rel}: not a safetensors index with a weight_map"]
    folder = PurePosixPath(rel).parent
    return [p for name in sorted(names, key=str) for p in _named_problems(name, rel, folder, listed)]


def _onnx_problems(artifact: Path, listed: set[str], readable: set[str]) -> list[str]:
    from specpack.schemas.exports import OnnxExport

    where = f"{ONNX_DIR}/{ONNX_INDEX_NAME}"
    try:
        index = OnnxExport.model_validate_json((artifact / where).read_text())
    except (OSError, ValueError):
        return [f"{where}: not a valid ONNX export index"]
    problems = [p for name in [index.data_file] + [g.path for g in index.graphs]
                for p in _named_problems(name, where, PurePosixPath("."), listed)]
    for graph in sorted({g.path for g in index.graphs} & readable):
        folder = PurePosixPath(graph).parent
        problems += [p for name in _external_data(artifact / graph, graph, problems)
                     for p in _named_problems(name, graph, folder, listed)]
    return problems


def _external_data(path: Path, rel: str, problems: list[str]) -> list[str]:
    """The external data locations an ONNX graph file names (its weights file)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (OSError, ValueError, DecodeError):
        problems.append(f"{rel}: not a valid ONNX graph")
        return []
    return sorted({entry.value for t in _tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL
                   for entry in t.external_data if entry.key == "location"})


def _tensors(graph):
    """Every tensor of an ONNX graph, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _tensors(sub)


def read_onnx_index(artifact: Path):
    """The artifact's ONNX export index (schemas.exports.OnnxExport), None when it has no ONNX export."""
    path = Path(artifact) / ONNX_DIR / ONNX_INDEX_NAME
    if not path.is_file():
        return None
    return OnnxExport.model_validate_json(path.read_text())
