"""The part of OpenAI's HTTP API that `specpack serve` speaks: request models, response and chunk
shapes, and the error body. Pydantic only, so workloads can share the message model without FastAPI."""

from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text of this part.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: Union[str, list[TextPart]] = Field(description="Text, or a list of text parts.")

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
    stop: Union[str, list[str], None] = Field(None, description="Up to 4 stop strings.")
    stream: bool = Field(False, description="Send server-sent events.")
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = Field(None, description="Seed for sampling.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
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
            return v[0]
        return v


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
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
