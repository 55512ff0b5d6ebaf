"""The README's five-minute tour runs as written (issue 52): every `$ specpack ...` line between the
`<!-- tour -->` markers, on a tiny GGUF model put where the tour's file name says, and `serve` with the
tour's `curl` request. Each command's first line of output keeps the shape the README shows (numbers,
paths and dates aside), so the README cannot drift from what the commands print."""

import json
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from test_gguf import build_model, gguf_file, tok_dir  # noqa: F401 (tok_dir is a fixture)

README = Path(__file__).parent.parent / "README.md"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tour() -> list[tuple[str, list[str]]]:
    """(command, the output lines the README shows under it) for each `$ ` line of the tour."""
    text = README.read_text()
    block = text[text.index("<!-- tour -->"):text.index("<!-- /tour -->")]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines()[2:]:
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and line and not line.startswith("```"):
            steps[-1][1].append(line)
    return steps


def shape(line: str) -> str:
    """A line without what changes from run to run: numbers, dates, paths, the generated text."""
    line = re.sub(r"\S*/\S*", "PATH", line)
    line = re.sub(r"\d[\d,.:T+-]*", "N", line)
    return " ".join(line.split())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_tour_has_every_step():
    words = [shlex.split(c)[1] for c, _ in tour() if c.startswith("specpack ")]
    assert words == ["keygen", "import-gguf", "build", "inspect", "verify", "run", "serve", "export"]


def test_the_tour_runs_as_written(tmp_path, tok_dir, cli, monkeypatch):  # noqa: F811
    gguf = gguf_file(tmp_path, build_model("llama"), tok_dir)
    gguf.rename(tmp_path / GGUF_NAME)
    monkeypatch.chdir(tmp_path)
    server = None
    try:
        for command, shown in tour():
            args = shlex.split(command.rstrip("& "))
            if args[0] == "curl":
                _completion(port, json.loads(args[args.index("-d") + 1]))
                continue
            if args[1] == "serve":
                port = _port()
                args[args.index("--port") + 1] = str(port)
                server = _serve(args[1:], port)
                continue
            code, out, err = cli(*args[1:])
            assert code == 0, f"{command}\n{out}{err}"
            if shown and args[1] != "run":  # run's first line is the model's text
                assert shape(out.splitlines()[0]) == shape(shown[0]), (command, out)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


def _serve(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "specpack", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
    proc.terminate()
    pytest.fail("serve did not answer /health in 120 s")


def _completion(port: int, body: dict) -> None:
    """The tour's curl: the model it names answers with text."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert reply["choices"][0]["finish_reason"] in ("length", "stop") and reply["usage"]["completion_tokens"] > 0
