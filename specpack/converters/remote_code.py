"""Targets that need code of their own (what transformers calls `trust_remote_code`).

specpack never runs a model's code: every tokenizer and config is loaded with
`trust_remote_code=False`. A target that needs code a loader would execute (an `auto_map` in its
configs, a tokenizer class transformers does not have) is refused by `build` unless the user allows it
(`--allow-remote-code`); the manifest then records it (`target.remote_code`, with the `.py` files the
release ships) and `inspect` shows it. Even then `run` and `serve` do not execute it: only engines the
artifact is exported to may. Python files that nothing names (DeepSeek's `inference/` reference code
beside its config, a training script) are not what a loader runs: they are carried as files.
"""

from __future__ import annotations

import dataclasses

from specpack.converters.target_hf import Target
from specpack.errors import InputError
from specpack.schemas import RemoteCode

# the configs transformers' Auto* classes read an `auto_map` from
CONFIG_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def detect(reader, files: list[str]) -> RemoteCode | None:
    """What in a release (`reader`: release_files, a directory or a hub repository; holding `files`) names
    or is code; None when nothing."""
    configs = {name: reader.json(name, name) for name in CONFIG_FILES if name in files}
    reasons = [reason for name, cfg in configs.items() for reason in _auto_map(name, cfg)]
    reasons += _unknown_tokenizer_classes(configs)
    code = [f for f in files if f.endswith(".py")]
    return RemoteCode(allowed=False, files=code, reasons=reasons) if reasons else None


def check(target: Target, allow: bool) -> Target:
    """`target`, its manifest entry recording its code when `allow`; refused when it needs code and not `allow`."""
    found = detect(target.files_reader, target.files)
    if found is None:
        return target
    if not allow:
        raise InputError(f"target '{target.files_reader.label()}' needs code of its own (trust_remote_code), which specpack "
                         "does not run", problems=found.reasons,
                         hint="use a target that transformers loads without custom code, or pass "
                              "--allow-remote-code to carry the code into the artifact anyway (the manifest "
                              "records it; `run` and `serve` still never execute it)")
    info = target.info.model_copy(update={"remote_code": found.model_copy(update={"allowed": True})})
    return dataclasses.replace(target, info=info)


def _auto_map(name: str, cfg: dict) -> list[str]:
    text = cfg.get("text_config")
    maps = [cfg.get("auto_map"), text.get("auto_map") if isinstance(text, dict) else None]
    reasons = []
    for auto_map in (m for m in maps if m):
        entries = auto_map.items() if isinstance(auto_map, dict) else [("auto_map", auto_map)]
        reasons += [f"{name}: auto_map {key} -> {value}" for key, value in entries]
    return reasons


def _unknown_tokenizer_classes(configs: dict[str, dict]) -> list[str]:
    named = {(name, cfg["tokenizer_class"]) for name, cfg in configs.items()
             if isinstance(cfg.get("tokenizer_class"), str)}
    if not named:
        return []
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    def known(cls: str) -> bool:
        return any(tokenizer_class_from_name(c) is not None for c in (cls, cls.removesuffix("Fast"), cls + "Fast"))

    return [f"{name}: tokenizer_class {cls} is not a transformers class" for name, cls in sorted(named)
            if not known(cls)]
