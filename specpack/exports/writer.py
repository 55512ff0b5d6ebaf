"""Export an artifact's drafter in the form a distributed serving engine loads.

    export_engine(ART, "vllm" | "sglang" | "trtllm" | "llama.cpp", OUT)

One module per engine, each with the same three names: `NAME`, `limits(manifest, draft_len)` (why
it cannot represent this drafter at this draft length; empty when it can) and `KINDS` (drafter kind
→ writer). A drafter kind is one writer per engine plus its entry in `KINDS`; `export_engine` and the
"which engines can" hint need no change.

With a validated profile (the fastest measured on cuda, or `--profile NAME`), vLLM's and TensorRT-LLM's
batch-size draft-length schedules follow its measured concurrency crossover (_schedule.py).

Every export is written atomically into OUT: the drafter in the engine's layout (aux layer ids in
the engine's own convention; MTP bindings checked, _mtp.py; block drafters, _block.py), the engine
config, and a README with the exact serve command (tensor-parallel flag included). The target is the
artifact directory itself, which every engine loads as the plain model (and, for MTP kept in the
target, as the draft model), except llama.cpp, which loads GGUF files: its export writes the target
too (llamacpp.py); the artifact is verified before anything is exported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from specpack._atomic import staging_dir
from specpack.exports import _schedule, llamacpp, sglang, trtllm, vllm
from specpack.exports._common import ExportContext, load_head, write_readme
from specpack.errors import InputError, UnsupportedError
from specpack.schemas.manifest import check_draft_len

log = logging.getLogger(__name__)

ENGINES = {m.NAME: m for m in (vllm, sglang, trtllm, llamacpp)}


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
    draft_len: int = 0  # draft tokens a step the engine is told (before any batch-size schedule)


def engine_limits(manifest) -> dict[str, list[str]]:
    """Each export engine and why it cannot serve this artifact's drafter at its default draft length
    ([] where it can): what `inspect` states."""
    from specpack.schemas.manifest import default_draft_len

    return {name: _limits(module, manifest, default_draft_len(manifest)) for name, module in ENGINES.items()}


def capable_engines(manifest, draft_len: int = 1) -> list[str]:
    """Engines that can represent this artifact's drafter at `draft_len` tokens per step."""
    return [name for name, module in ENGINES.items() if not _limits(module, manifest, draft_len)]


def _limits(module, manifest, draft_len: int) -> list[str]:
    """The engine's own limits, after the one every engine shares: a target kept as GGUF blocks
    (import-gguf) is specpack's layout, which no engine's safetensors loader reads."""
    q = manifest.target.arch.quantization if manifest.target.arch is not None else None
    if q is not None and q.scheme == "gguf":
        return ["the target's weights are llama.cpp blocks in specpack's layout (import-gguf): engines read them "
                "from the GGUF file itself; import it with --dequantize for an export"]
    return module.limits(manifest, draft_len)


def export_engine(artifact: Path, engine: str, out: Path, draft_len: int | None = None,
                  tensor_parallel: int = 1, force: bool = False, public_key: Path | None = None,
                  progress: bool = False, profile: str | None = None, gguf_type: str = "f32",
                  gguf_pre: str | None = None) -> ExportResult:
    """Verify `artifact`, then write its drafter for `engine` into `out` (atomically). With a
    validated profile (`profile`: a name or id, "none" for no profile; default: the fastest one
    measured on cuda) the engine's batch-size schedule follows its measured concurrency crossover
    (_schedule.py), at the profile's draft length."""
    from specpack.packager.verify import verify

    module = _engine(engine)
    _check_positive(draft_len=draft_len, tensor_parallel=tensor_parallel)
    _check_gguf(engine, gguf_type, gguf_pre, tensor_parallel)
    manifest = verify(artifact, public_key=public_key, progress=progress).manifest
    check_tensor_parallel(manifest, tensor_parallel)
    draft_len, crossover, notes = _draft_len_and_crossover(module, manifest, draft_len, profile)
    check_draft_len(manifest, draft_len)
    _check_representable(module, manifest, draft_len)
    artifact = Path(artifact).absolute()
    _check_target(module, artifact)
    head, tensors = load_head(artifact) if manifest.drafter.kind in ("eagle3", "block") else (None, None)
    with staging_dir(Path(out), force) as tmp:
        ctx = ExportContext(artifact, manifest, tmp, Path(out).absolute(), draft_len, tensor_parallel, crossover,
                            tuple(notes), gguf_type, gguf_pre)
        export = module.KINDS[manifest.drafter.kind](ctx, head, tensors)
        if crossover is not None and not export.schedule:
            export = replace(export, schedule=_schedule.measured_lines(crossover) + [
                f"{module.NAME} has no batch-size draft-length setting: the crossover is not written."])
        write_readme(ctx, engine, export)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    log.info("exported %s for %s into %s", artifact, engine, out)
    return ExportResult(Path(out), engine, manifest.drafter.kind, export.command,
                        export.config_summary, export.aux_layer_ids, export.aux_convention, files, draft_len)


def _draft_len_and_crossover(module, manifest, draft_len: int | None, profile: str | None):
    """(the draft length to export, the profile crossover written with it or None, README lines on a
    profile found but not used). An asked-for profile brings its own draft length; the default one
    is used only when its draft length is the one asked for (or none is) and this export can run it."""
    from specpack.schemas.manifest import default_draft_len
    from specpack.tuning.profiles import profile_for_export

    # MTP: one token per step unless asked, the one setting every engine runs as trained
    default = draft_len or (1 if manifest.drafter.kind == "mtp" else default_draft_len(manifest))
    chosen = profile_for_export(manifest, profile)
    if chosen is None:
        return default, None, []
    c = _schedule.Crossover.of(chosen)
    if profile is not None:
        if draft_len is not None and draft_len != c.draft_len:
            raise InputError(f"--draft-len {draft_len} differs from the {c.draft_len} draft tokens profile {c.profile} "
                             "measured its crossover with", hint="omit --draft-len, or pass --profile none")
        return c.draft_len, c, _lookup_note(chosen, module)
    why = None
    if draft_len is not None and draft_len != c.draft_len:
        why = f"it measured {c.draft_len} draft tokens, not the {draft_len} asked for"
    elif not _runs(module, manifest, c.draft_len):
        why = f"{module.NAME} cannot run this drafter with its {c.draft_len} draft tokens"
    if why:
        return default, None, [f"Validated profile {c.profile} was not used ({why}): no schedule written. "
                               "Pass --profile NAME to use one."]
    return c.draft_len, c, _lookup_note(chosen, module)


def _lookup_note(profile, module) -> list[str]:
    """README lines for a profile that measured its crossover with prompt lookup beside the drafter."""
    n = profile.settings.lookup
    if not n:
        return []
    return [(f"Validated profile {profile.name} measured its crossover with prompt lookup (copies of up to {n} "
             f"tokens where the context repeats) beside the drafter, which this {module.NAME} export does not "
             "configure: the engine's crossover may lie lower. `specpack tune --lookups none` measures one without.")]


def _runs(module, manifest, draft_len: int) -> bool:
    try:
        check_draft_len(manifest, draft_len)
    except InputError:
        return False
    return not _limits(module, manifest, draft_len)


def _engine(engine: str):
    if engine not in ENGINES:
        raise InputError(f"unknown engine '{engine}'", hint="choose one of: " + ", ".join(ENGINES))
    return ENGINES[engine]


def _check_gguf(engine: str, gguf_type: str, gguf_pre: str | None, tensor_parallel: int) -> None:
    from specpack.exports._gguf import GGUF_TYPES

    bad = [f"--gguf-type {gguf_type!r}: not one of {', '.join(GGUF_TYPES)}"] * (gguf_type not in GGUF_TYPES)
    if engine != llamacpp.NAME:
        bad += ["--gguf-type and --gguf-pre are llama.cpp's"] * (gguf_type != "f32" or gguf_pre is not None)
    else:
        bad += ["--tp: llama-server runs one process (its -sm / -ts split layers across local GPUs instead)"] * (
            tensor_parallel != 1)
    if bad:
        raise InputError("invalid export options", problems=bad)


def _check_positive(**values) -> None:
    bad = [f"{k} must be at least 1, got {v}" for k, v in values.items() if v is not None and v < 1]
    if bad:
        raise InputError("invalid export options", problems=bad)


def check_tensor_parallel(manifest, tp: int) -> None:
    """Refuse a tensor-parallel size the engines refuse at start: query heads must divide by it, KV heads
    divide by it or it by them (replicated), and every column-split width (MLP, experts) divide by it
    (vLLM linear.py `divide`, its attention's KV replication rule); the valid sizes are named."""
    if tp == 1:
        return
    problems = _tp_problems(manifest, tp)
    if problems:
        valid = [n for n in range(1, 129) if not _tp_problems(manifest, n)]
        raise InputError(f"--tp {tp} does not split this target", problems=problems,
                         hint=f"valid tensor-parallel sizes: {', '.join(map(str, valid[:12]))}")


def _tp_problems(manifest, tp: int) -> list[str]:
    t, a = manifest.target, manifest.target.arch
    widths = {"num_attention_heads": t.num_attention_heads, "intermediate_size": t.intermediate_size}
    if a is not None and a.experts is not None:
        widths["the experts' width"] = a.experts.size
    out = [f"{k} {v} is not divisible by {tp}" for k, v in widths.items() if v % tp]
    kv = t.num_key_value_heads
    if kv % tp and tp % kv:
        out.append(f"num_key_value_heads {kv}: neither divisible by {tp} nor dividing it (KV heads split or replicate)")
    return out


def _check_target(module, artifact: Path) -> None:
    """Refuse a target whose config.json the engine would read otherwise than specpack does."""
    import json

    problems = getattr(module, "target_problems", lambda config: [])(json.loads((artifact / "config.json").read_text()))
    if problems:
        raise UnsupportedError(f"{module.NAME} would not run this target as it is bound", problems=problems,
                               hint="state the keys in the target's config.json and rebuild the artifact")


def _check_representable(module, manifest, draft_len: int) -> None:
    problems = _limits(module, manifest, draft_len)
    if not problems:
        return
    others = [e for e in capable_engines(manifest, draft_len) if e != module.NAME]
    at_one = capable_engines(manifest, 1) if draft_len > 1 else []
    if others:
        can = ", ".join(others)
    elif at_one:
        can = f"{', '.join(at_one)} with --draft-len 1"
    elif manifest.target.arch is None or manifest.target.arch.runs:
        can = "none of the export engines; serve it with specpack"
    else:  # nor does specpack's own runtime decode this target
        can = "none checked here; bind another drafter (n-gram, MTP in the target, a draft model)"
    raise UnsupportedError(f"{module.NAME} cannot represent this {manifest.drafter.kind} drafter",
                           problems=problems, hint=f"engines that can: {can}")
