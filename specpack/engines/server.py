"""An engine's OpenAI server as a context manager: started from an `EngineLaunch`, waited for until
it answers /health, asked for greedy completions by token ids, read for its speculative-decoding
counters (vLLM's Prometheus names), stopped on exit. What `tune --engine`, the engine test suite and
`bench/serve.py` drive engines with."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specpack.errors import SpecpackError

SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total", "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted": "vllm:spec_decode_num_accepted_tokens_total"}


class EngineStartError(SpecpackError):
    """The engine exited, or never answered, before it served: `reason` is its own last error line."""

    def __init__(self, message: str, reason: str, log_tail: str, hint: str | None = None):
        super().__init__(message, hint=hint, problems=[reason])
        self.reason, self.log_tail = reason, log_tail


@dataclass(frozen=True)
class SpecCounts:
    """An engine's speculative-decoding counters (cumulative since its start)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0

    def __sub__(self, other: "SpecCounts") -> "SpecCounts":
        return SpecCounts(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                          self.accepted - other.accepted)

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: vLLM counts a draft per verification that carried one, as specpack's
        drafted steps (specpack's definition, docs/running.md)."""
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


class EngineServer:
    """`with EngineServer(launch) as srv: srv.complete(ids, 64)`; the engine's output goes to a log file
    (`log_path`), whose last error line an EngineStartError carries when it does not come up."""

    def __init__(self, launch, start_timeout: float = 600.0, env: dict | None = None):
        self.launch, self.start_timeout = launch, start_timeout
        self.env = {**os.environ, **launch.env, **(env or {})}
        self.url = base_url(launch.argv)
        self.port = int(launch.argv[launch.argv.index("--port") + 1])
        name = "--served-model-name"
        self.model = launch.argv[launch.argv.index(name) + 1] if name in launch.argv else None
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"specpack-{launch.engine}-", suffix=".log")[1])

    def __enter__(self) -> "EngineServer":
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.launch.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._failed(f"{self.launch.engine} exited with code {self.proc.returncode} before it served")
            if healthy(self.url):
                self._recheck()
                return self
            time.sleep(1.0)
        self.__exit__(None, None, None)
        self._failed(f"{self.launch.engine} did not answer /health within {self.start_timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()

    def _recheck(self) -> None:
        """The files it loaded are the files verified (engines.recheck), else it is stopped."""
        from specpack.engines.recheck import recheck

        try:
            recheck(self.launch)
        except SpecpackError:
            self.__exit__(None, None, None)
            raise

    def _failed(self, message: str):
        tail = self.log_path.read_text(errors="replace")[-20000:]
        raise EngineStartError(message, last_error(tail), tail, hint=f"its output is in {self.log_path}")

    def complete(self, prompt_ids: list[int], max_tokens: int, timeout: float = 600.0) -> list[int]:
        """The engine's greedy completion of `prompt_ids` (token ids in, token ids out): exactly
        `max_tokens` of them, past any end-of-sequence token, so runs compare token for token."""
        body = {"prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True, **({"model": self.model} if self.model else {})}
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return list(json.load(r)["choices"][0]["token_ids"])

    def counts(self) -> SpecCounts:
        """The engine's speculative-decoding counters now (zero where it reports none)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        return SpecCounts(**{k: _sum(text, name) for k, name in SPEC_COUNTERS.items()})


def base_url(argv: list[str]) -> str:
    """Where an engine started with `argv` (its --host and --port) answers, from this machine."""
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1]
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def healthy(url: str) -> bool:
    """The engine at `url` answers /health (200)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


_ERROR = re.compile(r"((?:\w+\.)*\w*(?:Error|Exception)\b:.*)")


def last_error(log: str) -> str:
    """The last `SomethingError: message` line of an engine's output, cut of log prefixes (its own
    words for why it stopped); else its last line."""
    lines = log.splitlines()
    found = []
    for i, line in enumerate(lines):
        if m := _ERROR.search(line):
            said = m.group(1).strip()
            if "validation error" in said and i + 1 < len(lines):  # pydantic: the reason is on the next line
                said += ": " + lines[i + 1].strip()
            found.append(said)
    generic = ("EngineDeadError", "Engine core initialization failed", "WorkerProc initialization failed")
    specific = [f for f in found if not any(g in f for g in generic)]
    return (specific or found or [line for line in lines if line.strip()] or ["(no output)"])[-1]
