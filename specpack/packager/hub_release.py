"""`build hf://org/name[@rev]`: a release on the hub checked by range requests before anything is downloaded
(the checks `inspect hf://` runs: target_hf.check on converters/hub_files.HubFiles, the drafter's binding),
then only what the artifact carries fetched into the hub cache, each file verified against the hub's
sha256 (issue 61 item 2).

    fetched = fetch_target("hf://org/name@rev", drafter="bundled", say=print)
    build(BuildOptions(target=fetched.root, target_files=fetched.files, target_source=fetched.source, ...))

What a build carries: the weights the index names, the configs, tokenizer, chat template, card, licence and
code at the top of the repository, and the bundled drafter's folder when it is the drafter; not `original/`
copies, other precisions, GGUF or ONNX files, images or pickles (`skipped`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specpack.converters import bundled, remote_code, target_hf
from specpack.converters.hub_files import SCHEME, HubFiles
from specpack.errors import InputError, UnsupportedError
from specpack.schemas import Source

OTHER_FORMATS = (".gguf", ".onnx", ".h5", ".msgpack", ".tflite", ".npz", ".ot", ".png", ".jpg", ".jpeg", ".gif",
                 ".webp", ".svg", ".mp4", ".pdf")  # other runtimes' copies, media
NOT_CARRIED = (".safetensors", *OTHER_FORMATS, *target_hf.PICKLE_SUFFIXES)  # top-level target files


@dataclass(frozen=True)
class Fetched:
    root: Path  # the hub cache's snapshot directory of the commit
    files: tuple[str, ...]  # what was fetched, verified, and is carried
    source: Source  # kind hub: repo id and commit
    skipped: tuple[str, ...] = ()  # files of the repository not fetched
    bytes: int = 0

    @property
    def drafter(self) -> Path:
        """What `--drafter` takes: the fetched directory, or the one drafter GGUF fetched."""
        return self.root / self.files[0] if len(self.files) == 1 and self.files[0].endswith(".gguf") else self.root


def is_hub(spec) -> bool:
    return str(spec).startswith(SCHEME)


def carried(files: HubFiles, target: target_hf.Target, subfolders: tuple[str, ...] = ()) -> list[str]:
    """The files a build of `target` carries: its weights, the top-level files that are not weights of another
    precision or media, and the files of `subfolders` (a bundled drafter's)."""
    weights = set(target.info.weight_files)
    return [rel for rel in files.list()
            if rel in weights or rel.startswith(tuple(f"{s}/" for s in subfolders))
            or ("/" not in rel and not rel.endswith(NOT_CARRIED))]


def fetch_target(spec: str, drafter: str, endpoint: str | None = None, allow_remote_code: bool = False,
                 say=lambda line: None) -> Fetched:
    """Check the release at `spec` by range requests as `build` would check it, refuse it before the first
    weight byte if it would be refused, then fetch what a build with `drafter` carries."""
    files = HubFiles.open(spec, endpoint=endpoint)
    target = remote_code.check(target_hf.check(files, files.source), allow_remote_code)
    say(f"checked {files.label()} by range requests: {target.info.architecture}, "
        f"{len(target.tensors):,} tensors ({files.bytes_read:,} bytes in {files.requests} requests)")
    return _fetch(files, carried(files, target, _drafter_folders(files, target, drafter)), say)


def fetch_drafter(spec: str, endpoint: str | None = None, say=lambda line: None) -> Fetched:
    """A drafter repository (a head, a draft model) at one commit: every file but other formats and media,
    verified (an official EAGLE-3 head is a pytorch_model.bin, which the converter reads without unpickling code);
    or, in a repository of llama.cpp drafter GGUFs (no config.json), its one GGUF file."""
    files = HubFiles.open(spec, endpoint=endpoint)
    ggufs = [r for r in files.list() if r.endswith(".gguf")]
    if not files.exists("config.json") and ggufs:
        if len(ggufs) > 1:
            raise InputError(f"{files.label()} holds {len(ggufs)} GGUF files and no config.json: which one is the "
                             "drafter is not stated", problems=ggufs[:8],
                             hint="download the one you want and pass its path as --drafter")
        return _fetch(files, ggufs, say)
    return _fetch(files, [r for r in files.list() if not r.endswith(OTHER_FORMATS) and not r.startswith(".")], say)


def bundled_folders(found: list[bundled.Bundled]) -> tuple[str, ...]:
    """The subfolders `build --drafter bundled` fetches beside the target: the bindable drafter's, or, where none
    is bindable from headers, every drafter folder the release lists (checked once downloaded)."""
    bindable = [b for b in found if b.drafter]
    return tuple(b.where.rstrip("/") for b in (bindable or found) if b.layout == "C")


def _fetch(files: HubFiles, rels: list[str], say) -> Fetched:
    root, fetched = files.download(rels, say), set(rels)
    skipped = tuple(r for r in files.list() if r not in fetched)
    return Fetched(root, tuple(rels), files.source, skipped, sum(files.size(r) for r in rels))


def _drafter_folders(files: HubFiles, target: target_hf.Target, drafter: str) -> tuple[str, ...]:
    """What the drafter needs fetched beside the target (a bundled subfolder), after the checks the
    headers allow: a release bundling nothing, or an MTP drafter whose layers the weights lack, downloads
    nothing."""
    if drafter == bundled.BUNDLED:
        found = bundled.find_in(files, target)
        if any(b.drafter for b in found) or not any(b.kind == "unknown" for b in found):
            bundled.choose(Path(files.label()), found)  # refuses several bindable, or none, naming what it holds
        return bundled_folders(found)
    if drafter == "mtp":
        arch = target.checked.arch if target.checked else None
        if arch is None or arch.mtp is None or target.checked.mtp_held == 0:
            raise UnsupportedError(f"{files.label()}: the target holds no MTP layers to bind (its config and headers "
                                   "state none)", hint="use another drafter; nothing was downloaded")
    elif is_hub(drafter) or drafter == "ngram" or Path(drafter).exists():
        return ()
    else:
        raise InputError(f"drafter {drafter!r} not found", hint="a drafter directory, hf://org/name, 'ngram', 'mtp' "
                                                                "or 'bundled'; nothing was downloaded")
    return ()
