"""The part of OpenAI's HTTP API that `specpack serve` speaks: request models, response and chunk
shapes, and the error body. Pydantic only, so workloads can share the message model without FastAPI."""

from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024  # a stop string is matched against every new token's text: keep that bounded
SEED_RANGE = (-(2**63), 2**63)  # a 64-bit signed integer, as OpenAI and vLLM take it


def valid_unicode(value):
    """`value` (a string or a list of them) unchanged; a ValueError when a string holds a lone
    surrogate, which JSON's \\uD800-style escapes can carry and no tokenizer (nor UTF-8) takes."""
    for text in [value] if isinstance(value, str) else value:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"contains a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
                             f"{exc.start}; send valid Unicode text") from None
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text of this part.")

    _text = field_validator("text")(valid_unicode)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: Union[str, list[TextPart]] = Field(description="Text, or a list of text parts.")

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return valid_unicode(v) if isinstance(v, str) else v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = Field(False, description="Send a last chunk with token usage.")


class _Request(BaseModel):
    # Clients send fields we do not use (user, logit_bias, ...): accept and ignore them.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="Served model name.")
    max_tokens: Optional[int] = Field(None, ge=1, description="New tokens at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    n: int = Field(1, ge=1, le=1, description="Only one choice per request.")
    stop: Union[str, list[str], None] = Field(None, description=f"Up to {MAX_STOPS} stop strings of up to "
                                                                  f"{MAX_STOP_CHARS} characters each.")
    stream: bool = Field(False, description="Send server-sent events.")
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1], description="Seed for sampling.")

    _model = field_validator("model")(valid_unicode)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = valid_unicode([v] if isinstance(v, str) else list(v or []))
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is longer than {MAX_STOP_CHARS} characters")
        return stops

    def stop_list(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(_Request):
    prompt: Union[str, list[str]] = Field(description="Prompt text (a list must hold exactly one).")
    max_tokens: Optional[int] = Field(16, ge=1, description="New tokens at most (OpenAI's default 16).")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request is supported")
            return valid_unicode(v[0])
        return valid_unicode(v)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="Newer name of max_tokens.")

    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish: Optional[str], use: Optional[dict] = None,
               chunk: bool = False) -> dict:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if not chunk or use is not None:
        body["usage"] = use
    return body


def chat_completion(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: Optional[str] = None,
               use: Optional[dict] = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish}]
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error body. Text from the request (a name, a key) may hold lone surrogates: they
    become '?', so the body always encodes."""
    return {"error": {"message": _encodable(message), "type": type_,
                      "param": None if param is None else _encodable(param), "code": code}}


def _encodable(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")
