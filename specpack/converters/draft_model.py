"""Draft models: a separate small causal LM of a family our runtime runs, sharing the target's tokenizer.

The draft model is read like a target (configs and safetensors headers; its files are carried into
drafter/ byte for byte) and refused unless it can only mean the same tokens: the same id for every
token string, the same special and added tokens, and embedding rows past the tokenizer only as
padding. A "draft" as large as the target is refused too (engines have loaded the full model as the
draft by mistake).
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters import target_hf
from specpack.converters.base import ConvertedDrafter
from specpack.converters.target_hf import INDEX_NAME, Target, read_config, read_json
from specpack.errors import ConversionError, InputError, UnsupportedError
from specpack.schemas import DraftModelDrafter, Source, TokenizerEvidence

KIND = "draft_model"
LAYOUT = "hf-causal-lm"
_EXAMPLES = 3


def detect(path: Path) -> str | None:
    """'hf-causal-lm' when `path` is a Hugging Face causal LM directory, else None."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return None
    archs = read_config(path / "config.json").get("architectures") or []
    has_weights = any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file()
    return LAYOUT if has_weights and any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) else None


def convert(path: Path, target: Target, source: Source | None = None) -> ConvertedDrafter:
    """Check the draft model at `path` against `target` (family, size, tokenizer) and describe it."""
    path = Path(path)
    _check_family(path)
    draft = target_hf.load(path, source)
    problems = _size_problems(draft, target)
    evidence, tokenizer_problems = tokenizer_evidence(draft, target)
    problems += tokenizer_problems
    if problems:
        raise ConversionError(f"draft model '{path}' cannot draft for target '{target.root}'", problems=problems,
                              hint="a draft model must share the target's tokenizer exactly (e.g. a smaller "
                                   "model of the same release)")
    carried = ["config.json"] + draft.info.weight_files + ([INDEX_NAME] if INDEX_NAME in draft.files else [])
    i = draft.info
    entry = DraftModelDrafter(
        source=i.source, architecture=i.architecture, model_type=i.model_type, weight_files=i.weight_files,
        dtype=i.dtype, parameters=i.parameters, num_layers=i.num_hidden_layers, hidden_size=i.hidden_size,
        tokenizer=evidence)
    return ConvertedDrafter(entry=entry, files={f: path / f for f in carried},
                            kv_bytes_per_token=draft.kv_bytes_per_token(), extra_weight_bytes=draft.weight_bytes)


def _check_family(path: Path) -> None:
    from specpack.families.dense import SUPPORTED_ARCHITECTURES, target_spec_from_config

    config = read_config(path / "config.json", "draft model config")
    try:
        target_spec_from_config(config)
    except UnsupportedError as exc:
        raise UnsupportedError(f"draft model '{path}': {exc.message}", problems=exc.problems,
                               hint="draft models of these families run: " + ", ".join(SUPPORTED_ARCHITECTURES)) \
            from None


def _size_problems(draft: Target, target: Target) -> list[str]:
    """A draft smaller than the target; a quantized target counted in logical weights, not packed ones."""
    theirs = target.info.arch.total_parameters if target.info.arch else target.info.parameters
    if draft.info.parameters < theirs:
        return []
    return [f"the draft model has {draft.info.parameters:,} parameters, the target {theirs:,}: "
            "a draft must be smaller than the target (is this the target itself?)"]


def _load_tokenizer(root: Path, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(root, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(f"cannot load the {what} tokenizer from '{root}': {str(exc).splitlines()[0]}",
                         hint="the draft model directory needs its tokenizer files to prove it shares the "
                              "target's") from None


def tokenizer_evidence(draft: Target, target: Target) -> tuple[TokenizerEvidence | None, list[str]]:
    """Compare the two tokenizers; (evidence, problems): every difference is a problem."""
    mine, theirs = _load_tokenizer(draft.root, "draft model's"), _load_tokenizer(target.root, "target's")
    vd, vt = mine.get_vocab(), theirs.get_vocab()
    problems = _vocab_problems(vd, vt)
    sd, st = _specials(mine), _specials(theirs)
    problems += [f"special token {k}: draft {sd.get(k)!r}, target {st.get(k)!r}" for k in sorted(sd.keys() | st.keys())
                 if sd.get(k) != st.get(k)]
    ad, at = _added(mine), _added(theirs)
    problems += [f"added token id {i}: draft {ad.get(i)}, target {at.get(i)}" for i in sorted(ad.keys() | at.keys())
                 if ad.get(i) != at.get(i)][:_EXAMPLES]
    used = max(vt.values(), default=-1) + 1
    problems += [f"the {who} embedding has {rows} rows, but the tokenizer uses ids up to {used - 1}"
                 for who, rows in (("draft", draft.info.vocab_size), ("target", target.info.vocab_size)) if rows < used]
    if problems:
        return None, problems
    return TokenizerEvidence(
        vocab_tokens=len(vt), special_tokens=st, added_tokens=len(at),
        files_identical=draft.info.tokenizer_sha256 == target.info.tokenizer_sha256,
        target_vocab_size=target.info.vocab_size, draft_vocab_size=draft.info.vocab_size,
        draft_tokenizer_sha256=draft.info.tokenizer_sha256), []


def _vocab_problems(vd: dict, vt: dict) -> list[str]:
    problems = []
    moved = sorted(t for t in vd.keys() & vt.keys() if vd[t] != vt[t])
    if moved:
        problems.append(f"{len(moved)} token strings have other ids in the draft's tokenizer, e.g. " +
                        ", ".join(f"{t!r}: {vd[t]} vs {vt[t]}" for t in moved[:_EXAMPLES]))
    for who, extra in (("draft", vd.keys() - vt.keys()), ("target", vt.keys() - vd.keys())):
        if extra:
            problems.append(f"{len(extra)} tokens are only in the {who}'s tokenizer, e.g. " +
                            ", ".join(repr(t) for t in sorted(extra)[:_EXAMPLES]))
    return problems


def _specials(tok) -> dict[str, str | None]:
    return {k: (str(v) if not isinstance(v, list) else ",".join(map(str, v)))
            for k, v in tok.special_tokens_map.items()}


def _added(tok) -> dict[int, tuple[str, bool]]:
    return {int(i): (str(t.content), bool(t.special)) for i, t in tok.added_tokens_decoder.items()}
