"""What a release bundles with its target (docs/families.md, the release layouts): MTP modules in the target's weights
(layout A), DSpark stages declared by `dspark_*` keys on the target config (layout B), and drafters in
a subfolder of the model repo with their own config and weights (layout C, MiniMax-M3.1's `dspark/`).

    find(root)   -> every drafter the release at `root` bundles, each with what binds it
    choose(root) -> the `--drafter` spec `build --drafter bundled` binds (refused unless exactly one)

Read from the config, the weight index and the subfolders alone (no tensor data), so it answers for a
release whose target family specpack cannot check too.

Sources: SGLang `checkpoint_bundles_dspark_draft` (dspark_config.py): a target bundles DSpark stages iff
it sets any of dspark_block_size, dspark_markov_rank, dspark_noise_token_id, dspark_target_layer_ids
(or a nested dspark_config), and those markers win over the legacy num_nextn_predict_layers DeepSeek-V4
configs keep (vLLM speculative.py @ 002e77c1: "DeepSeek V4.1 has no classic-MTP draft: its checkpoints
ship DSpark stages under mtp.*"); NeMo AutoModel minimax_m3_vl.dspark: "a target checkpoint that ships
dspark/config.json fixes the draft contract".
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from specpack.converters import release_dspark
from specpack.errors import InputError, UnsupportedError

DSPARK_MARKERS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")
MTP_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")
BUNDLED = "bundled"  # the `--drafter` value that binds what the release bundles
_STAGE = re.compile(r"mtp\.(\d+)\.")


@dataclass(frozen=True)
class Bundled:
    """One drafter a release bundles."""

    kind: str  # mtp | release_dspark | block | eagle3 | draft_model
    layout: str  # the release layout (docs/families.md): A (MTP in the target), B (DSpark stages in the target), C (subfolder)
    where: str  # what holds it: "target weights" or the subfolder
    detail: str  # what it is, in a line
    drafter: str | None  # the `--drafter` spec `build` binds it with; None: specpack cannot bind it yet
    why_not: str | None = None  # why it cannot be bound

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def find(root: Path, target=None) -> list[Bundled]:
    """Every drafter the release at `root` bundles (MTP modules, DSpark stages, subfolder drafters);
    `target`: the release as target_hf.load read it, when the caller has it."""
    from specpack.converters.release_files import LocalFiles

    return find_in(LocalFiles(Path(root)), target, Path(root))


def find_in(reader, target=None, root: Path | None = None) -> list[Bundled]:
    """`find` through a release reader (release_files: a directory, or a hub repository read by range
    requests; `root` None: a remote one, whose `target` the caller has checked)."""
    from specpack.converters.target_hf import checked_config

    config = checked_config(reader.json("config.json", "target config"), "target config", reader.label("config.json"))
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    names = _tensor_names(reader)
    stages = _release_stages(config, text, names, lambda: target or _load(root))
    found = [stages] if stages else [m for m in [_mtp(config, text, names)] if m]
    return found + (_subfolders(root, target) if root is not None else _remote_subfolders(reader, target))


def _load(root: Path):
    from specpack.converters import target_hf

    return target_hf.load(root)


def _tensor_names(reader) -> set[str]:
    """The weights' tensor names, from the index or the one file's header (no tensor data)."""
    from specpack.converters.target_hf import INDEX_NAME, SINGLE_NAME, weight_map_of

    if reader.exists(INDEX_NAME):
        return set(weight_map_of(reader))
    return set(reader.header(SINGLE_NAME)) if reader.exists(SINGLE_NAME) else set()


def _remote_subfolders(reader, target) -> list[Bundled]:
    """Drafter folders in a remote release: MiniMax-M3.1's DSpark folder checked as `build` checks it (its
    config and headers, read by range); any other drafter folder named, and checked once downloaded."""
    from specpack.converters.block.common import WEIGHT_NAMES
    from specpack.converters.release_dspark import minimax_m31
    from specpack.converters.release_files import SubFiles
    from specpack.converters.target_hf import INDEX_NAME

    listed = set(reader.list())
    subs = sorted({f.split("/")[0] for f in listed if f.count("/") == 1 and f.endswith("/config.json")})
    subs = [sub for sub in subs if any(f"{sub}/{w}" in listed for w in (*WEIGHT_NAMES, INDEX_NAME))]  # as has_weights
    out = []
    for sub in (s for s in subs if not s.startswith(".")):
        folder = SubFiles(reader, sub)
        if folder.json("config.json", "drafter config").get("architectures") == [minimax_m31.ARCHITECTURE]:
            try:
                minimax_m31.check(folder, target)
                why = None
            except (InputError, UnsupportedError) as exc:
                why = _summary(exc.message, exc.problems)
            out.append(Bundled(release_dspark.KIND, "C", f"{sub}/", f"{release_dspark.KIND} drafter, "
                               f"{minimax_m31.LAYOUT} layout (checked from its headers)", None if why else f"{sub}/", why))
            continue
        out.append(Bundled("unknown", "C", f"{sub}/", "a subfolder with its own config.json", None,
                           "this subfolder drafter is checked once the release is downloaded (`specpack inspect DIR`), "
                           "not over the network yet"))
    return out


def choose(root: Path, found: list[Bundled] | None = None, target=None) -> str:
    """The `--drafter` spec of the one drafter the release bundles (`found`: what `find` listed for it);
    refused, listing what it holds, when it bundles none, several, or only ones specpack cannot bind."""
    found = find(root, target) if found is None else found
    ready = [b for b in found if b.drafter]
    if len(ready) == 1:
        return ready[0].drafter
    listed = [f"{b.layout}: {b.kind} in {b.where} ({b.detail})" + (f": --drafter {b.drafter}" if b.drafter else
                                                                    f": cannot be bound ({b.why_not})")
              for b in found]
    if not ready:
        raise (UnsupportedError if found else InputError)(
            f"--drafter bundled: the release at '{root}' bundles " + ("no drafter specpack can bind" if found
                                                                      else "no drafter"),
            problems=listed, hint="pass the drafter's directory (or ngram) as --drafter; `specpack inspect DIR` "
                                  "lists what a release bundles")
    raise InputError(f"--drafter bundled: the release at '{root}' bundles {len(ready)} drafters; which one is not "
                     "stated", problems=listed, hint="pass the one you want as --drafter (the value shown)")


def _release_stages(config: dict, text: dict, names: set[str], target) -> Bundled | None:
    """DSpark stages the config declares, and the stages the weights hold under `mtp.{k}.` (where
    vLLM and DeepSeek-V4-Flash-DSpark keep them: the published config and index); `target()`: the
    checked target, read only when the build's own check must run."""
    stated = {k: c[k] for c in (config, text) for k in DSPARK_MARKERS if c.get(k) is not None}
    nested = text.get("dspark_config") if isinstance(text.get("dspark_config"), dict) else None
    if not stated and not nested:
        return None
    keys = ", ".join(f"{k} {_short(v)}" for k, v in stated.items()) or "dspark_config"
    held = sorted({int(m.group(1)) for n in names if (m := _STAGE.match(n)) and len(m.group(1)) <= 6})
    tensors = f"stages {held[:16]} held under mtp.*" if held else "but the weights hold no mtp.* tensor (markers " \
                                                                "without their stages: a re-upload that dropped them?)"
    detail = f"DSpark stages declared by {keys}, {tensors}; the markers win over {_mtp_key(text) or 'any MTP count key'}"
    why = _stages_why_not(held, target)
    return Bundled("release_dspark", "B", "target weights", detail, None if why else release_dspark.SPEC, why)


def _stages_why_not(held: list[int], target) -> str | None:
    """Why `build --drafter dspark-stages` cannot bind the stages: the build's own check, run on the
    release's headers (every tensor, every dspark_* key); `target()` gives the checked target."""
    if not held:
        return "the weights hold no mtp.{k}. tensor"
    try:
        problems = release_dspark.problems(target())
    except (InputError, UnsupportedError) as exc:
        return f"the target does not build: {exc.message}"
    return _summary(f"{len(problems)} problem(s)", problems) if problems else None


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _mtp_key(text: dict) -> str | None:
    return next((f"{k} {text[k]}" for k in MTP_COUNT_KEYS if isinstance(text.get(k), int) and text[k] > 0), None)


def _mtp(config: dict, text: dict, names: set[str]) -> Bundled | None:
    """MTP modules as the target's family reads them (held = what the weights hold)."""
    from specpack import families

    try:
        arch = families.describe(config)
    except (InputError, UnsupportedError) as exc:
        key = _mtp_key(text)
        return Bundled("mtp", "A", "target weights", f"MTP declared by {key}", None,
                       f"the target family is not one specpack reads: {exc.message}") if key else None
    if arch.mtp is None:
        return None
    held = families.mtp_held(arch, dict.fromkeys(names))
    detail = f"{held} module(s) held of {arch.mtp.layers or 'unstated'} ({arch.mtp.count_key}, {arch.mtp.layout})"
    if not held:
        return Bundled("mtp", "A", "target weights", detail, None, "the config states MTP modules but the weights "
                       "hold none (a re-upload that dropped them)")
    return Bundled("mtp", "A", "target weights", detail, "mtp")


def _subfolders(root: Path, target=None) -> list[Bundled]:
    """Drafters in an immediate subfolder of the release (config.json + weights in a known layout); a
    release DSpark folder is checked as `build` checks it (headers only), so what is listed as bound binds."""
    from specpack.converters import detect_drafter
    from specpack.converters.block.common import has_weights

    out = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not (sub / "config.json").is_file() or not has_weights(sub):
            continue
        if subfolder_of(root, str(sub)) is None:  # a link out of the release: its bytes are not the release's
            out.append(Bundled("unknown", "C", f"{sub.name}/", f"a link to {sub.resolve()}, outside the release", None,
                               "a subfolder that resolves outside the release is not bundled with it: pass that "
                               "folder by path to bind it (the manifest then records it as its source)"))
            continue
        try:
            family, layout = detect_drafter(str(sub))
        except InputError as exc:
            out.append(Bundled("unknown", "C", f"{sub.name}/", "a config.json that is no drafter layout specpack "
                               "reads", None, exc.message))
            continue
        why = _release_why_not(root, sub, target) if family == release_dspark.KIND else \
            _copy_why_not(root, sub) if family == "draft_model" else None
        out.append(Bundled(family, "C", f"{sub.name}/", f"{family} drafter, {layout} layout", None if why else str(sub),
                           why))
    return out


def _release_why_not(root: Path, sub: Path, target) -> str | None:
    """Why `build --drafter SUB` refuses a release DSpark folder, or None when it binds it."""
    from specpack.converters import target_hf

    try:
        release_dspark.convert(sub, target or target_hf.load(root))
    except (InputError, UnsupportedError) as exc:
        return _summary(exc.message, exc.problems)
    return None


SAME_SIZES = ("hidden_size", "num_hidden_layers", "vocab_size")  # a draft model shares none of them all


def _copy_why_not(root: Path, sub: Path) -> str | None:
    """A draft model folder that is the target again (a release's `original/` copy), named as such."""
    from specpack.converters.target_hf import read_config

    mine, theirs = (read_config(p / "config.json", "config") for p in (root, sub))
    mine, theirs = (c.get("text_config", c) if isinstance(c.get("text_config"), dict) else c for c in (mine, theirs))
    if all(mine.get(k) == theirs.get(k) for k in SAME_SIZES):
        return "a copy of the target (its architecture and sizes), not a drafter: releases ship the target again " \
               "in original/ or another precision"
    return None


def _summary(message: str, problems: list[str]) -> str:
    return message + (": " + "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "") if problems else "")


def subfolder_of(target_root: Path, drafter: str) -> str | None:
    """The drafter's folder relative to the target's, where it lies inside it (layout C), else None."""
    try:
        rel = Path(drafter).resolve().relative_to(Path(target_root).resolve())
    except ValueError:
        return None
    return rel.as_posix() if rel.parts else None
