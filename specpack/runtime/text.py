"""Text in, text out: prompts (plain or chat), stop strings, and streaming decoded text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specpack.errors import InputError


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of `text`; with `chat`, wrapped in the artifact's chat template as a user turn."""
    if not text:
        raise InputError("the prompt is empty", hint="pass --prompt TEXT or --prompt-file FILE")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("--chat was asked for, but the artifact's tokenizer has no chat template",
                             hint="drop --chat, or build from a target that ships one")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(text).input_ids


def stop_sequences(tokenizer, stops: list[str]) -> list[list[int]]:
    """Token-id sequences of the stop strings (the text is also cut at the first stop string)."""
    return [tokenizer(s, add_special_tokens=False).input_ids for s in stops if s]


CHEAP_TOKENS, CHEAP_STOP_CHARS = 512, 256  # TextStream.cheap's limits


@dataclass
class TextStream:
    """Decodes the growing token list and hands only new, final text to `write`: an incomplete
    UTF-8 character, or a tail that may be the start of a stop string, waits for the next tokens."""

    tokenizer: object
    write: Callable[[str], None]
    stops: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sent: int = 0

    def __post_init__(self):
        self._tables = [(s, _border_table(s)) for s in self.stops if s]

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        text = self.text()
        if text.endswith("\ufffd"):
            return
        self._send(text[: len(text) - self._held_back(text)])

    def cheap(self) -> bool:
        """Whether the next call is cheap enough to run on an event loop: it decodes every token so
        far (~10 µs at 64 tokens, ~50 at 512 for SmolLM2's tokenizer) and scans the unsent tail
        against each stop string."""
        return len(self.tokens) < CHEAP_TOKENS and sum(len(s) for s in self.stops) <= CHEAP_STOP_CHARS

    def flush(self) -> str:
        """Send the rest; return the whole text."""
        text = self.text()
        self._send(text)
        return text

    def text(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stops if s and s in text]
        return text[: min(cuts)] if cuts else text

    def _held_back(self, text: str) -> int:
        """How much of the unsent tail may be the start of a stop string. Every such start lies
        after `sent` (it was held back before), so only the unsent text, at most one stop long, is
        scanned: linear in the stop's length per call."""
        return max((_partial_match(text[max(self.sent, len(text) - len(s) + 1):], s, table)
                    for s, table in self._tables), default=0)

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            self.write(text[self.sent:])
            self.sent = len(text)


def _border_table(s: str) -> list[int]:
    """Knuth-Morris-Pratt: table[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    table, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table


def _partial_match(text: str, stop: str, table: list[int]) -> int:
    """The longest k < len(stop) such that `text` ends with stop[:k] (one pass over `text`)."""
    k = 0
    for ch in text:
        while k and stop[k] != ch:
            k = table[k - 1]
        if stop[k] == ch:
            k += 1
        if k == len(stop):  # a whole stop string: `text()` cut before it; keep to proper prefixes
            k = table[k - 1]
    return k
