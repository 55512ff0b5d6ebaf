"""Export an artifact's drafter in the form a distributed serving engine loads.

    export_engine(ART, "vllm" | "sglang" | "trtllm", OUT)

One module per engine, each with the same three names: `NAME`, `limits(manifest, draft_len)` (why
it cannot represent this drafter at this draft length; empty when it can) and `KINDS` (drafter kind
→ writer). A drafter kind is one writer per engine plus its entry in `KINDS`; `export_engine` and the
"which engines can" hint need no change.

Every export is written atomically into OUT: the drafter in the engine's layout (aux layer ids in
the engine's own convention; MTP bindings checked, _mtp.py; block drafters, _block.py), the engine
config, and a README with the exact serve command (tensor-parallel flag included). The target is the
artifact directory itself, which every engine loads as the plain model (and, for MTP kept in the
target, as the draft model); the artifact is verified before anything is exported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from specpack._atomic import staging_dir
from specpack.converters.export import _block, _mtp, sglang, trtllm, vllm
from specpack.converters.export._common import ExportContext, load_head, write_readme
from specpack.errors import InputError, UnsupportedError

log = logging.getLogger(__name__)

ENGINES = {m.NAME: m for m in (vllm, sglang, trtllm)}


@dataclass(frozen=True)
class ExportResult:
    out: Path
    engine: str
    kind: str
    command: str
    config: dict
    aux_layer_ids: list[int] | None
    aux_convention: str | None
    files: list[str]


def capable_engines(manifest, draft_len: int = 1) -> list[str]:
    """Engines that can represent this artifact's drafter at `draft_len` tokens per step."""
    return [name for name, module in ENGINES.items() if not module.limits(manifest, draft_len)]


def export_engine(artifact: Path, engine: str, out: Path, draft_len: int | None = None,
                  tensor_parallel: int = 1, force: bool = False, public_key: Path | None = None,
                  progress: bool = False) -> ExportResult:
    """Verify `artifact`, then write its drafter for `engine` into `out` (atomically)."""
    from specpack.packager.verify import verify
    from specpack.schemas.manifest import default_draft_len

    module = _engine(engine)
    _check_positive(draft_len=draft_len, tensor_parallel=tensor_parallel)
    manifest = verify(artifact, public_key=public_key, progress=progress).manifest
    # MTP: one token per step unless asked, the one setting every engine runs as trained
    draft_len = draft_len or (1 if manifest.drafter.kind == "mtp" else default_draft_len(manifest))
    _mtp.check_draft_len(manifest, draft_len)
    _block.check_draft_len(manifest, draft_len)
    _check_representable(module, manifest, draft_len)
    artifact = Path(artifact).absolute()
    head, tensors = load_head(artifact) if manifest.drafter.kind in ("eagle3", "block") else (None, None)
    with staging_dir(Path(out), force) as tmp:
        ctx = ExportContext(artifact, manifest, tmp, Path(out).absolute(), draft_len, tensor_parallel)
        export = module.KINDS[manifest.drafter.kind](ctx, head, tensors)
        write_readme(ctx, engine, export)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    log.info("exported %s for %s into %s", artifact, engine, out)
    return ExportResult(Path(out), engine, manifest.drafter.kind, export.command,
                        export.config_summary, export.aux_layer_ids, export.aux_convention, files)


def _engine(engine: str):
    if engine not in ENGINES:
        raise InputError(f"unknown engine '{engine}'", hint="choose one of: " + ", ".join(ENGINES))
    return ENGINES[engine]


def _check_positive(**values) -> None:
    bad = [f"{k} must be at least 1, got {v}" for k, v in values.items() if v is not None and v < 1]
    if bad:
        raise InputError("invalid export options", problems=bad)


def _check_representable(module, manifest, draft_len: int) -> None:
    problems = module.limits(manifest, draft_len)
    if not problems:
        return
    others = [e for e in capable_engines(manifest, draft_len) if e != module.NAME]
    at_one = capable_engines(manifest, 1) if draft_len > 1 else []
    if others:
        can = ", ".join(others)
    elif at_one:
        can = f"{', '.join(at_one)} with --draft-len 1"
    else:
        can = "none of the export engines; serve it with specpack"
    raise UnsupportedError(f"{module.NAME} cannot represent this {manifest.drafter.kind} drafter",
                           problems=problems, hint=f"engines that can: {can}")
