"""Runtime commands: run, tune, profiles, serve."""

from __future__ import annotations

from pathlib import Path

import click

from specpack._output import emit, progress_enabled
from specpack.cli._common import (BACKEND, DEVICE, DTYPE, JSON, KV_CACHE, PUBKEY, WEIGHTS, cli, int_list, renamed,
                                  signing_key, tree_shape)
from specpack.cli._common import tree_shapes as parse_tree_shapes


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-file", type=click.File("r"), help="Read the prompt from a file ('-' for stdin).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the artifact's chat template.")
@click.option("--max-new-tokens", default=256, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=int, help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--seed", type=int, help="Seed for sampling (reproducible runs).")
@click.option("--draft-len", type=int, help="Draft this many tokens every step, as given (no cost model, not a "
              "profile's either) [default: up to the profile's, else the artifact's, each step's length from "
              "a cost model measured on this machine, which may draft less or nothing and says so].")
@click.option("--draft-tree", help="Draft trees of TOPKxNODES (e.g. 4x24, draft-len deep) or 'chain' "
                                   "[default: the profile's].")
@click.option("--lookup", type=int, metavar="N",
              help="Where the text so far repeats, draft up to max(draft length, N) tokens copied from what followed "
                   "its last 3-4 tokens before, instead of asking the drafter (free; code and quoting gain most). "
                   "0: off [default: the profile's; else off].")
@click.option("--no-spec", is_flag=True, help="Decode without speculation (the baseline).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--profile", help="Profile name or id [default: the best runnable validated profile].")
@BACKEND
@DEVICE
@DTYPE
@WEIGHTS
@KV_CACHE
@PUBKEY
@JSON
def run(artifact, prompt, prompt_file, chat, max_new_tokens, temperature, top_k, top_p, seed, draft_len,
        draft_tree, lookup, no_spec, stop, profile, backend, device, dtype, weights, kv_cache, public_key, json_mode):
    """Verify ARTIFACT, then generate with single-model speculative decoding.

    Text streams to stdout as it is accepted; the figures (tokens/s, acceptance length, per-position
    acceptance, draft vs verify time) follow on stderr. Greedy output is identical to --no-spec.

    \b
    Examples:
      specpack run my-artifact --prompt "def fib(n):" --max-new-tokens 64
      specpack run my-artifact --chat --prompt "Summarise this: ..." --json
      specpack run my-artifact --prompt-file story.txt --temperature 0.8 --seed 1
      specpack run my-artifact --backend onnxruntime --prompt "def fib(n):"
      specpack run my-artifact --weights bf16 --prompt "def fib(n):"
      specpack run my-artifact --lookup 8 --prompt-file refactor-this.py
      specpack run my-artifact --weights w8a8 --kv-cache fp16 --prompt-file long.txt
    """
    from specpack.serving.generate import GenerateRequest, generate_text

    text = prompt if prompt is not None else (prompt_file.read() if prompt_file else None)
    if text is None:
        raise click.UsageError("give --prompt TEXT or --prompt-file FILE")
    request = GenerateRequest(prompt=text, chat=chat, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              draft_len=draft_len, speculative=not no_spec, stop=list(stop),
                              profile=profile, draft_tree=tree_shape(draft_tree, "--draft-tree"), lookup=lookup)
    writer = None if json_mode else (lambda s: click.echo(s, nl=False))
    chatty = progress_enabled(json_mode)
    result = generate_text(artifact, request, public_key=public_key, device=device, dtype=dtype,
                           write=writer, progress=chatty, backend=backend, weights=weights,
                           kv_cache=kv_cache, phase=_phase_printer() if chatty else None)
    if json_mode:
        emit(result, True)
    else:
        click.echo()
        click.echo(_run_summary(result), err=True)


def _phase_printer():
    """Print each start phase on stderr with the seconds since the command began."""
    import time

    start = time.perf_counter()
    return lambda words: click.echo(f"[{time.perf_counter() - start:5.1f}s] {words}", err=True)


def _run_summary(r: dict) -> str:
    pos = ", ".join(f"{p:.2f}" for p in r["per_position_acceptance"]) or "-"
    tree = f", trees {r['draft_tree'][0]}x{r['draft_tree'][1]}" if r.get("draft_tree") else ""
    lookup = f", lookup {r['lookup']} ({r['lookup_steps']} steps copied)" if r.get("lookup") else ""
    mode = f"speculative, draft length {r['draft_len']}{tree}{lookup}" if r["speculative"] else "no speculation"
    acceptance = (f"    acceptance length {r['acceptance_length']:.2f} over the {r['drafted_steps']} steps that drafted "
                  f"({r['tokens_per_step']:.2f} tokens a step over all {r['steps']}); per position: {pos}\n"
                  if r["speculative"] else "")
    return (f"--- {len(r['token_ids'])} tokens in {r['seconds']:.2f}s: {r['tokens_per_s']:.1f} tokens/s "
            f"({mode}); finish: {r['finish_reason']}\n{acceptance}"
            f"    {r['speculation']['decision']}\n"
            f"    draft {r['draft_s']:.2f}s, verify {r['verify_s']:.2f}s, prefill {r['prefill_s']:.2f}s\n"
            f"    {r['profile_message']}")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--workload", required=True, type=click.Path(path_type=Path),
              help='JSONL, one request a line: {"prompt": ...} or {"messages": [...]}, optional "max_tokens".')
@BACKEND
@DEVICE
@DTYPE
@WEIGHTS
@KV_CACHE
@click.option("--concurrency", default="1,2,4,8,16", show_default=True,
              help="Concurrent clients to measure through the serve queue, comma-separated.")
@click.option("--draft-lens", help="Draft lengths to measure, e.g. 2,4,6 [default: search from the heuristic start].")
@click.option("--tree-shapes", help="Draft trees to measure, DEPTHxTOPKxNODES,... (e.g. 5x4x20) or 'none' "
                                    "[default: search from the best draft length, for drafters that branch].")
@click.option("--lookups", help="Prompt lookup lengths to measure beside the best chain and tree, e.g. 4,8, or "
                                "'none' [default: 8, for model drafters].")
@click.option("--max-new-tokens", default=128, show_default=True, type=int,
              help="New tokens per prompt when a workload line sets no max_tokens.")
@click.option("--repeats", default=2, show_default=True, type=int, help="Passes per setting; the fastest is kept.")
@signing_key(help="EC private key (PEM) to re-sign with; needed if ARTIFACT is signed")
@click.option("--plot", "plot_dir", type=click.Path(path_type=Path),
              help="Save PNG charts (tokens/s vs draft length, acceptance per position) here; needs matplotlib.")
@click.option("--trust-key", "--public-key", "public_key", type=click.Path(path_type=Path), envvar="SPECPACK_PUBLIC_KEY",
              callback=renamed("--public-key", "--trust-key"),
              help="Public key (PEM) to check the signature with before tuning [env: SPECPACK_PUBLIC_KEY]; "
                   "`--public-key` is its old name.")
@click.option("--engine", type=click.Choice(["specpack", "vllm"]), default="specpack", show_default=True,
              help="Measure through specpack's own engine, or through vLLM's server started on the verified artifact "
                   "(SPECPACK_VLLM or PATH); the profile is then for `serve --engine vllm`. Flags after `--` go to vLLM.")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
@JSON
def tune(artifact, workload, backend, device, dtype, weights, kv_cache, concurrency, draft_lens, tree_shapes, lookups,
         max_new_tokens, repeats, key, plot_dir, public_key, engine, engine_args, json_mode):
    """Measure ARTIFACT on a workload and store the best settings as a validated profile.

    Measures tokens/s without speculation, sweeps the draft length (from D = 128/G - 1 on GPUs, the
    artifact's default on CPUs) and, for drafters that branch, draft tree shapes (depth, top-k,
    nodes), then the best of each with prompt lookup beside the drafter (copies of the context where
    it repeats), checks greedy output is identical on every prompt, finds the
    concurrency above which speculation stops paying, and writes the profile with its evidence into
    specpack.json (re-signed with --key).

    \b
    Examples:
      specpack tune my-artifact --workload bench/workloads/code_edit.jsonl --key signer.pem
      specpack tune my-artifact --workload chat.jsonl --draft-lens 2,4,6 --concurrency 1,4 --plot plots/
      specpack tune my-artifact --workload code.jsonl --tree-shapes 5x4x12 --lookups 4,8,16
      specpack tune my-artifact --workload code.jsonl --engine vllm --concurrency 1,4,8 -- --enforce-eager
    """
    if engine != "specpack":
        return _tune_engine(artifact, workload, engine, dtype, device, concurrency, draft_lens, max_new_tokens, key,
                            public_key, engine_args, json_mode)
    if engine_args:
        raise click.UsageError("flags after `--` are for --engine vllm")
    from specpack.tuning.tune import tune as do_tune
    from specpack.tuning.report import summary

    result = do_tune(artifact, workload, backend=backend, device=device, dtype=dtype, weights=weights,
                     kv_cache=kv_cache, concurrency=int_list(concurrency, "--concurrency"),
                     draft_lens=int_list(draft_lens, "--draft-lens"), max_new_tokens=max_new_tokens,
                     repeats=repeats, key=key, public_key=public_key, progress=progress_enabled(json_mode),
                     plot_dir=plot_dir, tree_shapes=parse_tree_shapes(tree_shapes, "--tree-shapes"),
                     lookups=[] if (lookups or "").strip().lower() == "none" else int_list(lookups, "--lookups"))
    emit(result.to_dict(), json_mode, lambda d: summary(result))


def _tune_engine(artifact, workload, engine, dtype, device, concurrency, draft_lens, max_new_tokens, key, public_key,
                 engine_args, json_mode):
    """`tune --engine vllm`: the profile measured through the engine's own server."""
    from specpack.engines.tune import tune_engine

    profile, path, passes = tune_engine(artifact, workload, engine, int_list(draft_lens, "--draft-lens"),
                                        int_list(concurrency, "--concurrency"), max_new_tokens, key, public_key,
                                        tuple(engine_args), dtype, device.split(":")[0])
    e, s = profile.evidence, profile.settings
    found = (f"{e.speedup:.2f}x at one client, acceptance length {e.acceptance_length:.2f}, speculation up to "
             f"{s.max_concurrency} concurrent requests" if s.speculative else
             "speculation did not pay at one client (" + ", ".join(f"D={p.draft_len} {p.speedup:.2f}x" for p in
                                                             e.draft_len_sweep) + f"): `serve --engine {engine}` "
             "starts the target alone")
    emit({"profile": profile.model_dump(mode="json"), "manifest": str(path)}, json_mode, lambda d: (
        f"profile {profile.name} ({profile.id}) measured through {engine} {e.software.packages.get(engine)}: "
        f"{found}; stored in {path}"))


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@JSON
def profiles(artifact, json_mode):
    """List ARTIFACT's validated profiles and whether each can run on this machine.

    runnable: compatible and its memory is free; low-memory: compatible, but the memory it needs is
    not free now; incompatible: wrong drafter, backend not installed, no such device, or edited.

    \b
    Example:
      specpack profiles my-artifact --json | jq '.profiles[] | {name, status, reasons}'
    """
    from specpack.tuning.profiles import format_statuses, list_profiles

    statuses = list_profiles(artifact)
    emit({"artifact": str(artifact), "profiles": [s.to_dict() for s in statuses]}, json_mode,
         lambda d: format_statuses(statuses))


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--profile", help="Profile name or id [default: the best runnable validated profile].")
@click.option("--model-name", help="Model name clients send [default: the artifact's name].")
@click.option("--max-concurrency", type=int,
              help="Requests in flight up to which speculation stays on [default: the profile's; none: no limit].")
@click.option("--draft-len", type=int, help="Draft tokens per step [default: the profile's].")
@click.option("--draft-tree", help="Draft trees of TOPKxNODES (e.g. 4x24, draft-len deep) or 'chain' "
                                   "[default: the profile's].")
@click.option("--lookup", type=int, metavar="N",
              help="Where a request's text repeats, draft up to max(draft length, N) tokens copied from what followed "
                   "its last 3-4 tokens before, instead of asking the drafter. 0: off [default: the profile's; "
                   "else off].")
@click.option("--api-key", envvar="SPECPACK_API_KEY",
              help="Require 'Authorization: Bearer KEY' on every route but /health [env: SPECPACK_API_KEY, which "
                   "keeps the key off this command line].")
@click.option("--max-body-bytes", type=int, default=2**20, show_default=True,
              help="Largest request body accepted; a larger one gets 413 before it is read.")
@click.option("--max-seqs", type=int, default=16, show_default=True,
              help="Requests decoding together (fewer when their KV cache does not fit the memory budget).")
@click.option("--max-model-len", type=int, help="Positions per request, prompt + completion [default: the context].")
@click.option("--max-queue", type=int, help="Requests waiting beyond which new ones get 429 [default: 4 x max-seqs].")
@click.option("--prefill-chunk", type=int, default=64, show_default=True,
              help="Prompt tokens one engine step takes, so long prompts do not stall the others.")
@click.option("--engine", type=click.Choice(["specpack", "vllm", "sglang", "trtllm"]), default="specpack",
              show_default=True, help="Serve with specpack's own engine, or start vLLM / SGLang / TensorRT-LLM on the "
                                      "verified artifact (found through SPECPACK_VLLM / SPECPACK_SGLANG / SPECPACK_TRTLLM "
                                      "or PATH); flags after `--` go to that engine.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size for --engine vllm|sglang|trtllm.")
@click.option("--no-spec", is_flag=True, help="--engine vllm|sglang|trtllm: start the engine on the target alone.")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
@BACKEND
@DEVICE
@DTYPE
@WEIGHTS
@KV_CACHE
@PUBKEY
def serve(artifact, host, port, profile, model_name, max_concurrency, draft_len, draft_tree, lookup, api_key,
          max_body_bytes, max_seqs, max_model_len, max_queue, prefill_chunk, engine, tp, no_spec, engine_args, backend,
          device, dtype, weights, kv_cache, public_key):
    """Serve ARTIFACT over an OpenAI-compatible HTTP API.

    /v1/models, /v1/completions and /v1/chat/completions (streaming or not), /health, and /metrics
    (Prometheus). Continuous batching: up to --max-seqs requests decode together, one target
    forward per step over all of them; past --max-queue waiting requests, new ones get 429. Each
    step drafts what a cost curve measured on this machine says pays (full drafts while a step
    streams weights, none past the compute knee); speculation stops while more requests are in
    flight than the profile's measured limit. With --api-key (or SPECPACK_API_KEY) every route but
    /health needs the key; without one, listening beyond loopback logs a warning. Needs
    `pip install 'specpack[serve]'`.

    With --engine, the key reaches vLLM through VLLM_API_KEY and SGLang inside its process, never on a
    command line; TensorRT-LLM takes none, so it is refused a key and refused beyond loopback. Once the
    engine answers /health the artifact is verified again, and the engine stopped on any difference.

    \b
    Examples:
      specpack serve my-artifact --port 8000
      specpack serve my-artifact --backend onnxruntime   # the exported graphs, every request in one call a step
      curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "my-artifact", "prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}'
      specpack serve my-artifact --engine vllm --tp 4      # vLLM on the verified files, drafter exported
      SPECPACK_VLLM=/opt/vllm/bin/vllm specpack serve my-artifact --engine vllm -- --enforce-eager
    """
    if engine != "specpack":
        return _serve_engine(artifact, engine, host, port, profile, model_name, draft_len, tp, no_spec, engine_args,
                             public_key, api_key)
    if engine_args or no_spec or tp != 1:
        raise click.UsageError("--tp, --no-spec and engine flags after `--` are for --engine vllm|sglang|trtllm")
    from specpack.serving.serve import prepare, run as run_server

    phase = _phase_printer()
    plan = prepare(artifact, profile=profile, backend=backend, device=device, dtype=dtype, weights=weights,
                   kv_cache=kv_cache, public_key=public_key, model_name=model_name, max_concurrency=max_concurrency, draft_len=draft_len,
                   draft_tree=tree_shape(draft_tree, "--draft-tree"), lookup=lookup,
                   progress=progress_enabled(False), api_key=api_key, max_body_bytes=max_body_bytes,
                   max_seqs=max_seqs, max_model_len=max_model_len, max_queue=max_queue, prefill_chunk=prefill_chunk,
                   phase=phase)
    click.echo(plan.selection.message, err=True)
    phase("ready")
    click.echo(f"serving '{plan.model_name}' at http://{host}:{port}/v1 (OpenAI-compatible; also /health, "
               "/metrics)", err=True)
    run_server(plan, host, port)


def _serve_engine(artifact, engine, host, port, profile, model_name, draft_len, tp, no_spec, engine_args, public_key,
                  api_key):
    """`serve --engine vllm|sglang|trtllm`: verify, export, then run the engine in the foreground (the
    key passed where no command line shows it; the artifact verified again once the engine is up)."""
    from specpack import engines
    from specpack.packager.artifact import read_manifest
    from specpack.tuning.profiles import engine_profile

    chosen = None if no_spec else engine_profile(read_manifest(artifact), engine, profile)
    launch = engines.prepare(artifact, engine, host=host, port=port, model_name=model_name, tensor_parallel=tp,
                             draft_len=draft_len, chosen=chosen, public_key=public_key, extra=tuple(engine_args),
                             speculative=not no_spec, api_key=api_key)
    click.echo(launch.message, err=True)
    click.echo(f"starting: {launch.command}", err=True)
    raise SystemExit(engines.run(launch))
