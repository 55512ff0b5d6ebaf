"""`distill`: train a head for a target that has none, on the target's own outputs.

    distill(target_dir, out_dir, self_generate=200)                 the target writes its own training text
    distill(target_dir, out_dir, data="chats.jsonl")                or train on given text
    distill(target_dir, out_dir, self_generate=200, head="dspark")  a DSpark block drafter (default: EAGLE-3)

The pipeline reads as it runs: check inputs -> sequences (given or self-generated, cached) ->
teacher-forced target features (cached) -> draft vocabulary from token frequencies -> train with
the family's objective (EAGLE-3's training-time test, DSpark's anchor blocks; resumable) -> export
in a published layout (SGLang EAGLE-3, DeepSpec DSpark) + training.json. Both families read the
same cached features. The result is a directory `specpack build TARGET --drafter OUT` accepts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from specpack.errors import InputError, UnsupportedError

log = logging.getLogger(__name__)
__all__ = ["distill", "DistillResult"]
DEFAULT_DRAFT_VOCAB = 8192


@dataclass(frozen=True)
class DistillResult:
    out: Path
    finished: bool  # False when stopped early (stop_after): resume to finish
    record: dict  # training.json's content (partial when not finished)


def default_cache() -> Path:
    root = Path(os.environ.get("SPECPACK_CACHE", Path.home() / ".cache" / "specpack"))
    return root / "distill"


def distill(target_dir, out_dir, data=None, self_generate: int | None = None, draft_vocab: int | None = None,
            aux_layer_ids=None, steps: int = 2000, seq_len: int = 256, batch_size: int = 4, lr: float = 2e-3,
            seed: int = 0, ttt_steps: int = 3, gen_tokens: int = 256, samples: int = 1, temperature: float = 0.7,
            resume: bool = True, progress: bool = True,
            dtype: str = "float32", cache_dir=None, checkpoint_every: int = 100, stop_after: int | None = None,
            command: str | None = None, head: str = "eagle3", dspark: dict | None = None,
            **train_options) -> DistillResult:
    """Train a head (`head`: "eagle3" or "dspark", with `dspark` the DSparkOptions fields) for the
    target at `target_dir` and write it to `out_dir`.

    Data: `data` (JSONL of {"text"}, {"messages"} or {"prompt"[, "completion"]} lines) used as is, or,
    with `self_generate=N`, the target's greedy continuations of the first N prompts of `data` (or of
    the built-in open-chat and code prompts, chat-formatted for an instruct model), `gen_tokens` new
    tokens each; `samples` > 1 adds `samples - 1` continuations per prompt sampled at `temperature`
    (the labels stay the target's argmax). Generated text and target features are cached under `cache_dir`. The `draft_vocab`
    target tokens the target predicts most often (default min(8192, target vocab)) form the head's
    output vocabulary. Training checkpoints to `out_dir` every `checkpoint_every` steps and resumes
    from there unless `resume` is false; `stop_after` ends this call after that many steps (the
    checkpoint stays). Other `TrainConfig` fields go in `train_options`. Deterministic for a given
    seed and thread count.
    """
    import torch

    from specpack.distill.data import Sampling
    from specpack.distill.families import FAMILIES
    from specpack.distill.head import default_aux_ids
    from specpack.distill.train import CHECKPOINT, TrainConfig, fingerprint, train
    from specpack.distill.vocab import build_vocab

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    spec = check_target(target_dir)
    draft_vocab = min(DEFAULT_DRAFT_VOCAB, spec.vocab_size) if draft_vocab is None else draft_vocab
    cfg = TrainConfig(steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, seed=seed, ttt_steps=ttt_steps,
                      checkpoint_every=checkpoint_every, **train_options)
    check_options(spec, draft_vocab, self_generate, data, cfg, dtype, gen_tokens, aux_layer_ids, samples, temperature,
                  head, dspark)
    family = FAMILIES[head](dspark)
    capture = tuple(aux_layer_ids or default_aux_ids(spec.num_layers))  # EAGLE-3's by default: one feature cache

    sampling = Sampling(samples, temperature, seed) if self_generate and samples > 1 else Sampling()
    target, feats, data_info = _data(target_dir, spec, data, self_generate, gen_tokens, sampling, capture, cache_dir,
                                     progress)
    vocab = build_vocab(feats.pred, feats.tokens, spec.vocab_size, draft_vocab)
    head_cfg = family.config(spec, draft_vocab, capture, feats)
    objective = family.objective(head_cfg, vocab)
    extra = {"data": data_info["cache_key"], "head": head_cfg.to_dict(), "steps": steps, **objective.extra()}
    fp = fingerprint(cfg, extra)
    done = _finished_record(out_dir, fp) if resume else None
    if done is not None:
        log.info("%s already holds this head (same settings and data): nothing to do", out_dir)
        return DistillResult(out_dir, True, done)

    torch.manual_seed(seed)
    model = family.model(head_cfg, target, vocab, feats)
    teacher_w = target.lm_head.weight[vocab.ids].detach().float()
    out_dir.mkdir(parents=True, exist_ok=True)
    result = train(model, feats, vocab, teacher_w, cfg, out_dir, resume, progress, extra, stop_after, objective)
    record = {
        "specpack_version": _version(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": fp, "command": command,
        "target": {"path": str(target_dir), "architecture": spec.architecture, "digest": data_info.pop("target_digest"),
                   "layers": spec.num_layers, "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size},
        "head": {"family": family.name, **head_cfg.to_dict(), "aux_convention": "input_of_layer",
                 "export_layout": family.layout, "dtype": dtype},
        "data": data_info,
        "vocab": {"size": vocab.size, "coverage": round(vocab.coverage, 4), "built_from": "target argmax frequencies"},
        "training": objective.record(cfg), "result": result,
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads()},
    }
    if result["steps_done"] < steps:
        return DistillResult(out_dir, False, record)
    family.write(out_dir, head_cfg, model.canonical_state(), vocab, record, dtype)
    (out_dir / CHECKPOINT).unlink(missing_ok=True)
    return DistillResult(out_dir, True, record)


def _data(target_dir: Path, spec, data, self_generate, gen_tokens, sampling, capture, cache_dir, progress):
    """(target model, features, what the data is) — from the cache when the same data was made before."""
    from specpack.distill.data import DataSpec, build_features, read_jsonl, target_digest
    from specpack.runtime.models.weights import load_target

    records = read_jsonl(data) if data is not None else None
    t0 = time.perf_counter()
    source = ("self-generate" if data is not None else "self-generate (built-in seeds)") if self_generate else "file"
    data_spec = DataSpec(target_digest=target_digest(target_dir), source=source, data_digest=_file_digest(data),
                         self_generate=self_generate, gen_tokens=gen_tokens if self_generate else 0, capture=capture,
                         sampling=sampling)
    target = load_target(target_dir)
    feats = build_features(target_dir, target, _tokenizer(target_dir), records, self_generate, gen_tokens,
                           Path(cache_dir or default_cache()) / data_spec.key(), capture, progress, sampling)
    info = {"source": source, "file": str(data) if data is not None else None, "file_sha256": data_spec.data_digest,
            "self_generate": self_generate, "gen_tokens": data_spec.gen_tokens, "cache_key": data_spec.key(),
            "samples_per_prompt": sampling.passes, "temperature": sampling.temperature if sampling.passes > 1 else None,
            "sequences": len(feats.starts), "tokens": feats.num_tokens,
            "generated_tokens": feats.num_tokens - int(feats.starts.sum()) if self_generate else 0,
            "seconds_this_run": round(time.perf_counter() - t0, 1), "target_digest": data_spec.target_digest}
    return target, feats, info


def check_target(target_dir: Path):
    """The target's spec, or a clear error for what distill cannot train against."""
    from specpack.families.dense import DEEPSEEK_ARCHITECTURES, load_target_spec
    from specpack.runtime.models.weights import architecture

    if not Path(target_dir).is_dir():
        raise InputError(f"target '{target_dir}' is not a directory", hint="pass a Hugging Face model directory")
    arch = architecture(target_dir)
    if arch in DEEPSEEK_ARCHITECTURES:
        raise UnsupportedError(f"distill does not support {arch} targets (MLA + MoE) yet",
                               hint="distill trains heads for Llama, Mistral, Qwen2 and Qwen3 targets")
    return load_target_spec(target_dir)


def _spread(layers: int) -> list[int]:
    """Three distinct layers spread over a target too shallow for the default (at least 3 layers)."""
    return sorted({1 % layers, layers // 2, layers - 1}) if layers >= 3 else list(range(layers))


def check_options(spec, draft_vocab, self_generate, data, cfg, dtype: str, gen_tokens: int,
                  aux_layer_ids=None, samples: int = 1, temperature: float = 0.7, head: str = "eagle3",
                  dspark: dict | None = None) -> None:
    """Every bad option at once, before any expensive work."""
    from specpack.distill.export import DTYPES
    from specpack.distill.families import FAMILIES
    from specpack.distill.head import default_aux_ids

    vocab_size, L = spec.vocab_size, spec.num_layers
    ids = list(aux_layer_ids) if aux_layer_ids is not None else list(default_aux_ids(L))
    problems = []
    if len(set(ids)) != len(ids) or not ids or any(not 0 <= i < L for i in ids):
        which = "given" if aux_layer_ids is not None else f"default for a {L}-layer target"
        problems.append(f"aux layer ids {ids} ({which}) must be distinct layers in 0..{L - 1}")
    if not isinstance(draft_vocab, int) or draft_vocab <= 0:
        problems.append(f"draft vocab {draft_vocab!r} must be a positive integer")
    elif draft_vocab > vocab_size:
        problems.append(f"draft vocab {draft_vocab} is larger than the target's vocabulary of {vocab_size}")
    if data is None and not self_generate:
        problems.append("no data: pass a JSONL file (--data) or let the target write it (--self-generate N)")
    if self_generate is not None and (not isinstance(self_generate, int) or self_generate <= 0):
        problems.append(f"--self-generate {self_generate!r} must be a positive number of continuations")
    for name in ("steps", "seq_len", "batch_size", "ttt_steps", "checkpoint_every"):
        if getattr(cfg, name) <= 0:
            problems.append(f"{name} {getattr(cfg, name)} must be positive")
    if not cfg.lr > 0:
        problems.append(f"learning rate {cfg.lr} must be positive")
    if self_generate and gen_tokens <= 0:
        problems.append(f"gen_tokens {gen_tokens} must be positive")
    if not isinstance(samples, int) or samples <= 0:
        problems.append(f"samples per prompt {samples!r} must be a positive integer")
    elif samples > 1 and not self_generate:
        problems.append("samples per prompt > 1 needs --self-generate (given text is used as it is)")
    if not temperature > 0:
        problems.append(f"temperature {temperature} must be positive")
    if dtype not in DTYPES:
        problems.append(f"dtype {dtype!r} (use one of {', '.join(DTYPES)})")
    if head not in FAMILIES:
        problems.append(f"head {head!r} (use one of {', '.join(FAMILIES)})")
    else:
        problems += FAMILIES[head](dspark).problems(spec, ids)
    if problems:
        hint = (f"the draft vocab must lie in 1..{vocab_size}" if any("vocab" in p for p in problems) else
                f"pass --aux-layers with distinct layers in 0..{L - 1}, e.g. {','.join(map(str, _spread(L)))}"
                if any("aux layer" in p for p in problems) else None)
        raise InputError("distill options are not usable", problems=problems, hint=hint)


def _file_digest(path) -> str | None:
    if path is None:
        return None
    from specpack.packager.hashing import sha256_file

    return sha256_file(Path(path))


def _tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_dir, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot load the tokenizer of '{target_dir}': {str(exc).splitlines()[0]}",
                         hint="the target directory needs its tokenizer files") from None


def _finished_record(out_dir: Path, fp: str) -> dict | None:
    from specpack.distill.export import RECORD, WEIGHTS

    if not (out_dir / WEIGHTS).is_file():
        return None
    try:
        record = json.loads((out_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("fingerprint") == fp else None


def _version() -> str:
    from specpack._version import __version__

    return __version__
