"""Publishing commands: push, pull (Hugging Face hub and OCI registries), export for serving engines."""

from __future__ import annotations

from pathlib import Path

import click

from specpack._output import emit, progress_enabled
from specpack.cli._common import JSON, PUBKEY, cli

ENDPOINT = click.option("--endpoint", envvar="HF_ENDPOINT",
                        help="Hugging Face hub endpoint [env: HF_ENDPOINT].")
PLAIN_HTTP = click.option("--plain-http", is_flag=True,
                          help="OCI registries: plain HTTP instead of HTTPS (e.g. a local registry).")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("destination")
@click.option("--revision", help="Hub branch to commit to (created from main when missing).")
@click.option("--private", is_flag=True, help="Create the hub repo as private.")
@ENDPOINT
@PLAIN_HTTP
@PUBKEY
@JSON
def push(artifact, destination, revision, private, endpoint, plain_http, public_key, json_mode):
    """Verify ARTIFACT, then publish it to a hub repo (ORG/NAME) or an OCI registry (oci://HOST/REPO:TAG).

    A broken artifact is never published. The hub token comes from HF_TOKEN or `hf auth login`;
    OCI credentials from `docker login`.

    \b
    Examples:
      specpack push llama-eagle3 my-org/llama-eagle3 --key signer.pub
      specpack push llama-eagle3 oci://registry.example.com/models/llama-eagle3:v1
    """
    progress = progress_enabled(json_mode)
    if destination.startswith("oci://"):
        from specpack.packager.oci import push_oci

        r = push_oci(artifact, destination, plain_http=plain_http, progress=progress,
                     public_key=public_key)
    else:
        from specpack.packager.hub import push as hub_push

        r = hub_push(artifact, destination, revision=revision, private=private, endpoint=endpoint,
                     progress=progress, public_key=public_key)
    data = {"destination": r.destination, "revision": r.revision, "files": r.files, "bytes": r.bytes,
            "url": r.url}
    emit(data, json_mode, lambda d: f"pushed {d['files']} files ({d['bytes']:,} bytes) to "
                                    f"{d['destination']} at {d['revision']}")


@cli.command()
@click.argument("source")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="Directory to create.")
@click.option("--revision", help="Hub branch, tag or commit (default: main).")
@PUBKEY
@click.option("--allow-unsigned", is_flag=True,
              help="Accept an artifact whose signature is not checked (digests only: integrity, "
                   "not authenticity).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@ENDPOINT
@PLAIN_HTTP
@JSON
def pull(source, out, revision, public_key, allow_unsigned, force, endpoint, plain_http, json_mode):
    """Download SOURCE (ORG/NAME or oci://HOST/REPO:TAG), verify it, then move it to OUT.

    The signature is checked with --key, and then an unsigned download is always refused; without
    --key, only --allow-unsigned accepts it. Every digest is always checked, and only the files
    the manifest lists are kept. On any failure nothing is left behind (exit code 3 when the
    download does not verify).

    \b
    Examples:
      specpack pull my-org/llama-eagle3 -o llama-eagle3 --key signer.pub
      specpack pull oci://registry.example.com/models/llama-eagle3:v1 -o llama-eagle3 --key signer.pub
    """
    progress = progress_enabled(json_mode)
    if source.startswith("oci://"):
        from specpack.packager.oci import pull_oci

        r = pull_oci(source, out, public_key=public_key, allow_unsigned=allow_unsigned,
                     plain_http=plain_http, force=force, progress=progress)
    else:
        from specpack.packager.hub import pull as hub_pull

        r = hub_pull(source, out, revision=revision, public_key=public_key,
                     allow_unsigned=allow_unsigned, endpoint=endpoint, force=force, progress=progress)
    data = {"artifact": str(r.out), "source": r.source, "revision": r.revision,
            "files": r.report.files, "signature_checked": r.report.signature_checked, "trust": r.trust}
    emit(data, json_mode, lambda d: f"pulled {d['source']} ({d['revision']}) into {d['artifact']}: "
                                    f"{d['files']} files, {d['trust']}")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--to", "engine", required=True,
              type=click.Choice(["vllm", "sglang", "trtllm", "llama.cpp", "onnx", "tensorrt"]),
              help="Serving engine to export for, or onnx / tensorrt: graphs or engines stored inside ARTIFACT.")
@click.option("-o", "--out", type=click.Path(path_type=Path),
              help="Directory to create (vllm, sglang, trtllm, llama.cpp).")
@click.option("--tp", "tensor_parallel", default=1, show_default=True,
              help="Tensor-parallel size written into the serve command.")
@click.option("--draft-len", type=int, help="Draft tokens per step [default: the profile's, else the artifact's].")
@click.option("--profile", help="vllm/trtllm: validated profile (name or id) whose measured concurrency crossover "
                                "becomes the engine's batch-size draft-length schedule [default: the fastest measured "
                                "on cuda; `none`: no schedule].")
@click.option("--force", is_flag=True, help="Replace OUT (or an existing ONNX export) if it exists.")
@click.option("--signing-key", type=click.Path(path_type=Path), envvar="SPECPACK_SIGNING_KEY",
              help="onnx/tensorrt: private key (PEM) to re-sign ARTIFACT [env: SPECPACK_SIGNING_KEY].")
@click.option("--drop-signature", is_flag=True, help="onnx: leave a signed ARTIFACT unsigned instead.")
@click.option("--engine-dtype", default="float16", show_default=True,
              type=click.Choice(["float16", "bfloat16", "float32"]), help="tensorrt: engine precision.")
@click.option("--gguf-type", default="f32", show_default=True, type=click.Choice(["f32", "f16", "bf16", "q8_0"]),
              help="llama.cpp: the target GGUF's precision (norms stay f32, as llama.cpp's converter writes them).")
@click.option("--gguf-pre", help="llama.cpp: the tokenizer's pre-tokenizer (gpt-2, llama-bpe, qwen2, smollm, "
                                 "default) when llama.cpp's converter does not know its hash.")
@PUBKEY
@JSON
def export(artifact, engine, out, tensor_parallel, draft_len, profile, force, signing_key, drop_signature,
           engine_dtype, gguf_type, gguf_pre, public_key, json_mode):
    """Write ARTIFACT's drafter in the layout ENGINE loads (with its config and serve command), or
    store ONNX graphs / TensorRT engines of the whole model inside ARTIFACT.

    Aux layer ids are converted to the engine's own convention; a drafter the engine cannot
    represent is refused with the engines that can. OUT/README.md holds the exact command. With a
    validated profile, vLLM and TensorRT-LLM get its measured concurrency crossover as their
    batch-size draft-length schedule.

    \b
    Examples:
      specpack export llama-eagle3 --to vllm -o llama-eagle3-vllm --tp 4
      specpack export llama-eagle3 --to trtllm -o llama-eagle3-trtllm --tp 8 --draft-len 3
      specpack export llama-eagle3 --to vllm -o llama-eagle3-vllm --profile tensorrt-cuda-float16-eagle3-d4
      specpack export llama-eagle3 --to llama.cpp -o llama-eagle3-gguf --gguf-type q8_0
      specpack export llama-eagle3 --to onnx --signing-key signer.pem
    """
    if engine in ("onnx", "tensorrt"):
        _export_inside(artifact, engine, force, signing_key, drop_signature, engine_dtype, public_key,
                       json_mode)
        return
    if out is None:
        raise click.UsageError(f"--to {engine} needs -o/--out")
    from specpack.exports import export_engine

    r = export_engine(artifact, engine, out, draft_len=draft_len, tensor_parallel=tensor_parallel,
                      force=force, public_key=public_key, progress=progress_enabled(json_mode), profile=profile,
                      gguf_type=gguf_type, gguf_pre=gguf_pre)
    data = {"out": str(r.out), "engine": r.engine, "drafter": r.kind, "files": r.files,
            "aux_layer_ids": r.aux_layer_ids, "aux_convention": r.aux_convention,
            "config": r.config, "command": r.command}
    emit(data, json_mode, lambda d: f"exported the {d['drafter']} drafter for {d['engine']} into "
                                    f"{d['out']}\nserve with:\n{d['command']}")


def _export_inside(artifact, engine, force, signing_key, drop_signature, engine_dtype, public_key, json_mode):
    if engine == "onnx":
        from specpack.exports.onnx import export_onnx

        files = export_onnx(artifact, key=signing_key, public_key=public_key, force=force,
                            drop_signature=drop_signature, progress=progress_enabled(json_mode))
    else:
        from specpack.runtime.backends.tensorrt_backend import build_engines

        files = build_engines(artifact, key=signing_key, public_key=public_key, dtype=engine_dtype)
    data = {"artifact": str(artifact), "to": engine,
            "files": [Path(p).relative_to(artifact).as_posix() for p in files]}
    emit(data, json_mode, lambda d: f"exported {d['to']} into {d['artifact']}: " + ", ".join(d["files"]))
