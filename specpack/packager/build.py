"""`specpack build`: collect → convert → manifest → hash → sign, into an atomic output dir."""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from specpack._version import __version__
from specpack._atomic import save_safetensors, staging_dir
from specpack.converters import (DRAFTER_FAMILIES, bundled, detect_drafter, eagle3_gguf, gguf, mtp, ngram, release_dspark,
                                 remote_code, target_hf)
from specpack.converters.base import AuxOverride, BlockOverrides, ConvertedDrafter
from specpack.packager import card
from specpack.errors import ConversionError, InputError
from specpack.packager.artifact import read_path_problems, write_manifest
from specpack.packager.hashing import parallel_map, place_file, sha256_file
from specpack.packager.progress import byte_bar
from specpack.packager.signing import check_signing_key, sign
from specpack.schemas import MANIFEST_NAME, FileEntry, Manifest, MemoryInfo, Source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NgramParams:
    min_n: int = 1
    max_n: int = 4
    draft_len: int = 5
    match: str = "latest"  # which earlier occurrence is copied: "latest" or "earliest" (vLLM's rule)


@dataclass(frozen=True)
class BuildOptions:
    target: Path
    drafter: str  # a drafter directory, or "ngram"
    out: Path
    key: Path | None = None
    force: bool = False
    aux: AuxOverride | None = None
    block: BlockOverrides | None = None  # block drafters: what --block-layout/--block-algorithm/--mask-token-id settle
    ngram: NgramParams = field(default_factory=NgramParams)
    mtp_allow_reuse: bool = False  # MTP: allow more draft tokens than layers (step k uses layer k mod n)
    allow_remote_code: bool = False  # carry a target that needs its own code (never run by specpack)
    allow_target_mismatch: bool = False  # build a drafter that states another target (stated in the manifest)
    link: bool = True
    progress: bool = False
    # `build hf://` (packager/hub_release): the files of `target` fetched, and where the target and drafter came from
    target_files: tuple[str, ...] | None = None
    target_source: Source | None = None
    drafter_source: Source | None = None


@dataclass(frozen=True)
class BuildResult:
    out: Path
    manifest: Manifest
    signed: bool
    seconds: float
    notes: list[str] = field(default_factory=list)  # what the build found that the user may want to act on


def build(opts: BuildOptions) -> BuildResult:
    """Build one artifact from a target and its drafter; nothing is left behind on failure."""
    start = time.perf_counter()
    if opts.key:
        check_signing_key(opts.key)  # before minutes of work
    target = remote_code.check(target_hf.load(opts.target, opts.target_source, opts.target_files),
                               opts.allow_remote_code)
    if opts.drafter == bundled.BUNDLED:
        opts = replace(opts, drafter=bundled.choose(target.root, target=target))
    drafter = convert_drafter(opts, target)
    if opts.drafter_source is not None and hasattr(drafter.entry, "source"):
        drafter = replace(drafter, entry=drafter.entry.model_copy(update={"source": opts.drafter_source}))
    target, drafter = _bundled_once(target, drafter, opts.drafter)
    with staging_dir(opts.out, opts.force) as tmp:
        digests = _place_target(target, tmp, opts)
        digests |= _write_drafter(drafter, tmp, opts.link)
        manifest = manifest_of(Path(opts.out).name, target, drafter)
        digests["README.md"] = _write_text(tmp / "README.md", card.render(manifest))
        manifest = manifest.model_copy(update={"files": _file_entries(tmp, digests)})
        write_manifest(tmp, manifest)
        _check_read_paths(tmp, digests)
        if opts.key:
            sign(tmp, {**digests, MANIFEST_NAME: sha256_file(tmp / MANIFEST_NAME)}, opts.key,
                 manifest.name)
    return BuildResult(Path(opts.out), manifest, opts.key is not None, time.perf_counter() - start,
                       _notes(manifest))


def _notes(manifest: Manifest) -> list[str]:
    """MTP modules the target holds that the drafter does not use, or that its config states and its
    weights lack (a quantized re-upload that dropped them)."""
    arch = manifest.target.arch
    mtp = arch.mtp if arch else None
    if mtp is None or manifest.drafter.kind == "mtp":
        return []
    if mtp.held == 0:
        return [f"the target's config states {mtp.stated} MTP module(s) ({mtp.count_key}), but its weights hold none"]
    return [f"the target holds {mtp.held} MTP module(s) ({mtp.layout}): `--drafter mtp` binds them as the drafter"]


def convert_drafter(opts: BuildOptions, target: target_hf.Target) -> ConvertedDrafter:
    family, layout = detect_drafter(opts.drafter)
    log.info("drafter %s: %s (%s)", opts.drafter, family, layout)
    _check_block_flags(opts, family)
    if family == "ngram":
        return ngram.convert(opts.ngram.min_n, opts.ngram.max_n, opts.ngram.draft_len, opts.ngram.match)
    if layout == mtp.IN_TARGET:
        return mtp.convert_in_target(target, allow_reuse=opts.mtp_allow_reuse)
    if layout == eagle3_gguf.LAYOUT:
        return eagle3_gguf.convert(Path(opts.drafter), target, aux=opts.aux, allow_mismatch=opts.allow_target_mismatch)
    if family == release_dspark.KIND and layout == release_dspark.deepseek_v4.LAYOUT:
        return release_dspark.convert_in_target(target)
    module, path = DRAFTER_FAMILIES[family], Path(opts.drafter)
    if layout == gguf.NEXTN_LAYOUT:  # a deepseek2 GGUF's nextn block: read into an MTP head, then as one
        dtype = target.info.dtype if target.info.dtype in gguf.DTYPES else "float32"  # the target's, if a float one
        head = gguf.nextn_head(path, _scratch("mtp-gguf-"), (target.info.num_hidden_layers, target.info.hidden_size),
                               dtype)
        return module.convert(head, target, allow_reuse=opts.mtp_allow_reuse, source=Source.local(path),
                              label=f"the nextn block of '{path}'")
    if family == "mtp":
        return module.convert(path, target, allow_reuse=opts.mtp_allow_reuse)
    if family in ("draft_model", release_dspark.KIND):
        return module.convert(path, target)
    if family == "block":
        return module.convert(path, target, aux=opts.aux, block=opts.block, allow_mismatch=opts.allow_target_mismatch)
    return module.convert(path, target, aux=opts.aux, allow_mismatch=opts.allow_target_mismatch)


def _scratch(prefix: str) -> Path:
    """A directory for files a drafter is read into, removed when the process ends (the build copies them)."""
    import atexit
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=f"specpack-{prefix}"))
    atexit.register(shutil.rmtree, path, True)
    return path


def _bundled_once(target: target_hf.Target, drafter: ConvertedDrafter, spec: str):
    """A drafter read from a subfolder of the target (layout C) is stored once, as the canonical
    drafter: its folder's files leave the target's files, their digests go to the drafter's source."""
    sub = bundled.subfolder_of(target.root, spec) if Path(spec).is_dir() else None
    if sub is None:
        return target, drafter
    inside = [f for f in target.files if f.startswith(sub + "/")]
    digests = {f[len(sub) + 1:]: sha256_file(target.root / f) for f in inside}
    source = target.info.source.model_copy(update={"subfolder": sub, "files_sha256": digests})
    return (replace(target, files=[f for f in target.files if f not in inside]),
            replace(drafter, entry=drafter.entry.model_copy(update={"source": source})))


def _check_block_flags(opts: BuildOptions, family: str) -> None:
    """Block-drafter flags given for another kind of drafter would be ignored silently: refuse them."""
    given = opts.block.given() if opts.block else []
    if given and family != "block":
        raise InputError(f"{', '.join(given)} only apply to block drafters (DFlash, DSpark, LiLiCorr); "
                         f"'{opts.drafter}' is a {family} drafter", hint="drop " + ", ".join(given))


def _place_target(target: target_hf.Target, tmp: Path, opts: BuildOptions) -> dict[str, str]:
    """Carry every target file byte for byte (hard link or copy), hashing each byte once."""
    dest = {rel: (card.TARGET_CARD if rel == "README.md" else rel) for rel in target.files}
    total = sum((target.root / rel).stat().st_size for rel in target.files)
    with byte_bar(total, "target", opts.progress) as bar:
        digests = parallel_map(lambda rel: place_file(target.root / rel, tmp / dest[rel], bar.update,
                                                      opts.link), target.files)
    return {dest[rel]: d for rel, d in zip(target.files, digests)}


def _write_drafter(drafter: ConvertedDrafter, tmp: Path, link: bool = True) -> dict[str, str]:
    """drafter/: files carried byte for byte (a draft model), canonical weights, canonical config."""
    if drafter.config is None and not drafter.files:
        return {}
    import json

    (tmp / "drafter").mkdir()
    digests = {f"drafter/{rel}": place_file(src, tmp / "drafter" / rel, None, link)
               for rel, src in drafter.files.items()}
    if drafter.tensors:
        save_safetensors({k: v.contiguous() for k, v in drafter.tensors.items()}, tmp / "drafter/model.safetensors",
                         metadata={"format": "pt", "specpack": drafter.entry.kind})
        digests["drafter/model.safetensors"] = sha256_file(tmp / "drafter/model.safetensors")
    if drafter.config is not None:
        digests["drafter/config.json"] = _write_text(tmp / "drafter/config.json",
                                                     json.dumps(drafter.config, indent=2) + "\n")
    return digests


def _write_text(path: Path, text: str) -> str:
    path.write_text(text)
    return sha256_file(path)


def manifest_of(name: str, target, drafter: ConvertedDrafter) -> Manifest:
    """The manifest an artifact of `target` and `drafter` states (its file list empty until written)."""
    memory = MemoryInfo(target_weight_bytes=target.weight_bytes,
                        drafter_weight_bytes=drafter.weight_bytes,
                        target_kv_bytes_per_token=target.kv_bytes_per_token(),
                        drafter_kv_bytes_per_token=drafter.kv_bytes_per_token)
    return Manifest(specpack_version=__version__, name=name,
                    created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    target=target.info, drafter=drafter.entry, memory=memory, files=[])


def _check_read_paths(tmp: Path, digests: dict[str, str]) -> None:
    """Never sign an artifact whose files name files outside it (a safetensors index, say)."""
    problems = read_path_problems(tmp, set(digests))
    if problems:
        raise ConversionError("the artifact would read files it does not hold", problems=problems,
                              hint="every file an index names must be inside the target (or drafter) folder")


def _file_entries(tmp: Path, digests: dict[str, str]) -> list[FileEntry]:
    return [FileEntry(path=p, size=(tmp / p).stat().st_size, sha256=d) for p, d in sorted(digests.items())]
