"""The `specpack` command line: thin commands that parse, call one library function, print."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from specpack import __version__
from specpack._output import emit, error, progress_enabled, table
from specpack.errors import SpecpackError

JSON = click.option("--json", "json_mode", is_flag=True, help="Print one JSON object for scripts.")
PUBKEY = click.option("--key", "public_key", type=click.Path(path_type=Path),
                      envvar="SPECPACK_PUBLIC_KEY",
                      help="Public key (PEM) to check the signature with [env: SPECPACK_PUBLIC_KEY].")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="specpack")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """Ship an LLM and its speculative-decoding drafter as one signed artifact, and run it.

    \b
    Typical flow:
      specpack keygen signer
      specpack build ./Llama-3.1-8B-Instruct --drafter ./EAGLE3-LLaMA3.1-8B -o llama-eagle3 --key signer.pem
      specpack verify llama-eagle3 --key signer.pub
      specpack run llama-eagle3 --prompt "Write a haiku about caches"

    Set SPECPACK_TRACEBACK=1 to see tracebacks of errors.
    """
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@cli.command()
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--drafter", required=True,
              help="Drafter directory (EAGLE-3: official, SGLang/SpecForge or ModelOpt layout) or 'ngram'.")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="Artifact directory to create.")
@click.option("--key", type=click.Path(path_type=Path), envvar="SPECPACK_SIGNING_KEY",
              help="EC private key (PEM) to sign with [env: SPECPACK_SIGNING_KEY]. Without it the "
                   "artifact is unsigned: digests still guard integrity; sign later with `specpack sign`.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--aux-layer-ids", help="Override EAGLE-3 aux layer ids, e.g. 2,16,29.")
@click.option("--aux-convention", type=click.Choice(["input", "output"]),
              help="How --aux-layer-ids count: 'input' of layer i (EAGLE, vLLM) or 'output' (TRT-LLM, ModelOpt).")
@click.option("--ngram-min", default=1, show_default=True, help="n-gram drafter: shortest suffix.")
@click.option("--ngram-max", default=4, show_default=True, help="n-gram drafter: longest suffix.")
@click.option("--draft-len", default=5, show_default=True, help="n-gram drafter: default tokens proposed.")
@click.option("--copy", "copy_files", is_flag=True, help="Copy target files even where hard links work.")
@JSON
def build(target, drafter, out, key, force, aux_layer_ids, aux_convention, ngram_min, ngram_max,
          draft_len, copy_files, json_mode):
    """Convert TARGET and its drafter into one (signed) artifact at OUT.

    \b
    Examples:
      specpack build ./target --drafter ./eagle3-head -o my-artifact --key signer.pem
      specpack build ./target --drafter ngram --ngram-max 3 --draft-len 6 -o my-artifact
    """
    from specpack.converters.base import AuxOverride
    from specpack.packager import BuildOptions, NgramParams, build as do_build

    opts = BuildOptions(target=target, drafter=drafter, out=out, key=key, force=force,
                        aux=AuxOverride.parse(aux_layer_ids, aux_convention),
                        ngram=NgramParams(ngram_min, ngram_max, draft_len), link=not copy_files,
                        progress=progress_enabled(json_mode))
    result = do_build(opts)
    data = {"artifact": str(result.out), "signed": result.signed, "seconds": round(result.seconds, 3),
            "files": len(result.manifest.files), "drafter": result.manifest.drafter.kind}
    emit(data, json_mode, lambda d: f"built {d['artifact']} ({d['drafter']} drafter, {d['files']} files, "
                                    f"{'signed' if d['signed'] else 'UNSIGNED'}) in {d['seconds']:.2f}s")


@cli.command()
@click.argument("prefix", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace existing key files.")
@JSON
def keygen(prefix, force, json_mode):
    """Write an ECDSA P-256 key pair: PREFIX.pem (private) and PREFIX.pub (public).

    \b
    Example:
      specpack keygen signer      # signer.pem, signer.pub
    """
    from specpack.packager import keygen as do_keygen

    pair = do_keygen(prefix, force)
    emit({"private_key": str(pair.private), "public_key": str(pair.public)}, json_mode,
         lambda d: f"private key: {d['private_key']} (keep it secret)\npublic key:  {d['public_key']}")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--key", required=True, type=click.Path(path_type=Path), envvar="SPECPACK_SIGNING_KEY",
              help="EC private key (PEM) [env: SPECPACK_SIGNING_KEY].")
@JSON
def sign(artifact, key, json_mode):
    """Check ARTIFACT's digests, then sign it (replacing any old signature).

    \b
    Example:
      specpack sign my-artifact --key signer.pem
    """
    from specpack.packager import sign_artifact

    report = sign_artifact(artifact, key, progress=progress_enabled(json_mode))
    emit({"artifact": str(artifact), "files": report.files}, json_mode,
         lambda d: f"signed {d['artifact']} ({d['files']} files)")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@PUBKEY
@click.option("--require-signature", is_flag=True, envvar="SPECPACK_REQUIRE_SIGNATURE",
              help="Fail unless a signature is checked.")
@JSON
def verify(artifact, public_key, require_signature, json_mode):
    """Check ARTIFACT's signature (with --key) and the digest of every file.

    On failure every changed, missing and extra file is listed and the exit code is 3.

    \b
    Examples:
      specpack verify my-artifact --key signer.pub
      specpack verify my-artifact            # digests only
    """
    from specpack.packager import verify as do_verify

    r = do_verify(artifact, public_key, require_signature, progress=progress_enabled(json_mode))
    data = {"artifact": str(artifact), "ok": True, "signed": r.signed,
            "signature_checked": r.signature_checked, "files": r.files, "bytes": r.bytes,
            "trust": r.trust}
    emit(data, json_mode, lambda d: f"OK {d['artifact']}: {d['files']} files, {d['trust']}")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@JSON
def inspect(artifact, json_mode):
    """Summarise ARTIFACT: target, drafter and its bindings, memory, signature, files.

    \b
    Example:
      specpack inspect my-artifact --json | jq .drafter
    """
    from specpack.packager import describe

    emit(describe(artifact), json_mode, _inspect_text)


def _inspect_text(d: dict) -> str:
    t, dr, mem = d["target"], d["drafter"], d["memory"]
    rows = [("artifact", f"{d['name']} (format v{d['format_version']}, specpack {d['specpack_version']}, "
                         f"{d['created']})"),
            ("target", f"{t['architecture']} {t['num_hidden_layers']}L×{t['hidden_size']}, heads "
                       f"{t['num_attention_heads']}/{t['num_key_value_heads']}, vocab {t['vocab_size']}, "
                       f"{t['dtype']}, {t['parameters']:,} params"),
            ("drafter", dr["kind"] + (f" from {dr['source_layout']}" if "source_layout" in dr else ""))]
    if dr["kind"] == "eagle3":
        aux = dr["aux_hidden_states"]
        rows += [("  aux layers", f"{aux['layer_ids']} ({aux['convention']}; source "
                                  f"{aux.get('source_ids', 'defaults')} {aux['source_convention']})"),
                 ("  draft vocab", f"{dr['draft_vocab_size']} (map {dr['vocab_map']}, t2d {dr['t2d_source']})"),
                 ("  embedding/lm_head", f"{dr['embedding_source']} / {dr['lm_head_source']}"),
                 ("  params/dtype", f"{dr['parameters']:,} / {dr['dtype']}")]
    else:
        rows.append(("  lookup", f"n {dr['min_n']}..{dr['max_n']}, draft length {dr['draft_len']}"))
    rows += [("memory", f"target {mem['target_weight_bytes'] / 2**20:,.1f} MiB + drafter "
                        f"{mem['drafter_weight_bytes'] / 2**20:,.1f} MiB; KV/token "
                        f"{mem['target_kv_bytes_per_token']:,} + {mem['drafter_kv_bytes_per_token']:,} B"),
             ("signature", "model.sig (OpenSSF model-signing)" if d["signed"] else "none (unsigned)"),
             ("files", f"{len(d['files'])} files, {d['total_bytes'] / 2**20:,.1f} MiB")]
    return table(rows)


@cli.command("import-gguf")
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="Directory to create.")
@click.option("--dtype", default="float32", show_default=True,
              type=click.Choice(["float32", "float16", "bfloat16"]), help="Dtype of the written weights.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@JSON
def import_gguf(gguf_file, out, dtype, force, json_mode):
    """Convert a GGUF target (llama.cpp) into a Hugging Face model directory.

    Dequantizes F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, K-quants and IQ4 tensors; writes config.json,
    safetensors, tokenizer files and chat template. The result is a target for `specpack build`.

    \b
    Example:
      specpack import-gguf SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2-135m
      specpack build smollm2-135m --drafter ngram -o smollm2-ngram
    """
    from specpack.converters.gguf import import_gguf as do_import

    report = do_import(gguf_file, out, dtype=dtype, progress=progress_enabled(json_mode), force=force)
    emit(report.to_dict(), json_mode,
         lambda d: f"imported {gguf_file} -> {out} ({report.architecture}, {report.n_tensors} tensors, "
                   f"{report.bytes_written / 2**20:,.1f} MiB {dtype})")


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
@click.option("--draft-len", type=int, help="Draft tokens per step [default: the artifact's].")
@click.option("--no-spec", is_flag=True, help="Decode without speculation (the baseline).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "bfloat16"]))
@PUBKEY
@JSON
def run(artifact, prompt, prompt_file, chat, max_new_tokens, temperature, top_k, top_p, seed, draft_len,
        no_spec, stop, device, dtype, public_key, json_mode):
    """Verify ARTIFACT, then generate with single-model speculative decoding.

    Text streams to stdout as it is accepted; the figures (tokens/s, acceptance length, per-position
    acceptance, draft vs verify time) follow on stderr. Greedy output is identical to --no-spec.

    \b
    Examples:
      specpack run my-artifact --prompt "def fib(n):" --max-new-tokens 64
      specpack run my-artifact --chat --prompt "Summarise this: ..." --json
      specpack run my-artifact --prompt-file story.txt --temperature 0.8 --seed 1
    """
    from specpack.runtime.generate import GenerateRequest, generate_text

    text = prompt if prompt is not None else (prompt_file.read() if prompt_file else None)
    if text is None:
        raise click.UsageError("give --prompt TEXT or --prompt-file FILE")
    request = GenerateRequest(prompt=text, chat=chat, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              draft_len=draft_len, speculative=not no_spec, stop=list(stop))
    writer = None if json_mode else (lambda s: click.echo(s, nl=False))
    result = generate_text(artifact, request, public_key=public_key, device=device, dtype=dtype,
                           write=writer, progress=progress_enabled(json_mode))
    if json_mode:
        emit(result, True)
    else:
        click.echo()
        click.echo(_run_summary(result), err=True)


def _run_summary(r: dict) -> str:
    pos = ", ".join(f"{p:.2f}" for p in r["per_position_acceptance"]) or "-"
    mode = f"speculative, draft length {r['draft_len']}" if r["speculative"] else "no speculation"
    return (f"--- {len(r['token_ids'])} tokens in {r['seconds']:.2f}s: {r['tokens_per_s']:.1f} tokens/s "
            f"({mode}); finish: {r['finish_reason']}\n"
            f"    acceptance length {r['acceptance_length']:.2f} over {r['steps']} steps; per position: {pos}\n"
            f"    draft {r['draft_s']:.2f}s, verify {r['verify_s']:.2f}s, prefill {r['prefill_s']:.2f}s")


def main() -> None:
    json_mode = "--json" in sys.argv
    try:
        cli.main(standalone_mode=False)
    except SpecpackError as exc:
        if os.environ.get("SPECPACK_TRACEBACK"):
            raise
        error(exc, json_mode)
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted: nothing was left behind", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
