"""Workloads for `specpack tune`: JSONL files, one request a line.

    {"prompt": "def fib(n):", "max_tokens": 64}
    {"messages": [{"role": "user", "content": "Summarise: ..."}]}

`max_tokens` is optional. Blank lines are skipped. Every bad line is reported at once, by number.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specpack.errors import InputError
from specpack.schemas.openai import ChatMessage

HINT = ('each line must be a JSON object: {"prompt": "..."} or {"messages": [{"role": "user", '
        '"content": "..."}]}, with an optional "max_tokens"')


class WorkloadLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: Optional[str] = Field(None, min_length=1, description="Plain prompt text.")
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1, description="A chat conversation.")
    max_tokens: Optional[int] = Field(None, ge=1, description="New tokens at most for this line.")
    id: Optional[str] = Field(None, description="Free-form label.")

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


@dataclass(frozen=True)
class WorkloadItem:
    line: int  # 1-based line number in the file
    request: WorkloadLine


@dataclass(frozen=True)
class Workload:
    path: Path
    name: str
    sha256: str
    items: list[WorkloadItem]


def read_workload(path) -> Workload:
    """Parse a JSONL workload; InputError names the file and every bad line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"workload file '{path}' does not exist", hint=HINT) from None
    except IsADirectoryError:
        raise InputError(f"workload '{path}' is a directory, not a JSONL file", hint=HINT) from None
    items, problems = [], []
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"workload file '{path}' is not UTF-8 text: {exc.reason}", hint=HINT) from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            item, problem = _parse_line(number, line)
            items.append(item) if item else problems.append(problem)
    if problems:
        raise InputError(f"workload file '{path}' has {len(problems)} bad line(s)", problems=problems, hint=HINT)
    if not items:
        raise InputError(f"workload file '{path}' is empty: no prompts", hint=HINT)
    return Workload(path, path.name.removesuffix(".jsonl"), hashlib.sha256(raw).hexdigest(), items)


def _parse_line(number: int, line: str) -> tuple[Optional[WorkloadItem], Optional[str]]:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"line {number}: not valid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(data, dict):
        return None, f"line {number}: expected a JSON object, got {type(data).__name__}"
    try:
        return WorkloadItem(number, WorkloadLine.model_validate(data)), None
    except ValidationError as exc:
        msgs = "; ".join((".".join(map(str, e["loc"])) + ": " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
                         for e in exc.errors())
        return None, f"line {number}: {msgs}"


def encode_messages(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("chat messages were given, but the artifact's tokenizer has no chat template",
                         hint="send a plain prompt instead")
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_request(tokenizer, request: WorkloadLine) -> list[int]:
    """Token ids of one workload line, encoded as `specpack run` (plain) or `run --chat` would."""
    from specpack.runtime.text import encode_prompt

    if request.messages is not None:
        return encode_messages(tokenizer, request.messages)
    return encode_prompt(tokenizer, request.prompt, chat=False)
