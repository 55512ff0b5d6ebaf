"""The click group and the options the commands share."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import click

from specpack._version import __version__
from specpack.runtime.options import KV_CACHES, WEIGHTS as WEIGHT_CHOICES

JSON = click.option("--json", "json_mode", is_flag=True, help="Print one JSON object for scripts.")


def renamed(old: str, new: str):
    """An option callback: the value as given, with a warning when it came under its old spelling (every
    command names a private key `--signing-key` and a public one `--trust-key`; issue 62)."""
    def warn(ctx, param, value):
        if value is not None and any(a == old or a.startswith(old + "=") for a in sys.argv[1:]):
            click.echo(f"warning: {old} is deprecated for this command; use {new}", err=True)
        return value
    return warn


PUBKEY = click.option("--trust-key", "--key", "public_key", type=click.Path(path_type=Path),
                      envvar="SPECPACK_PUBLIC_KEY", callback=renamed("--key", "--trust-key"),
                      help="Public key (PEM) to check the signature with [env: SPECPACK_PUBLIC_KEY]; "
                           "`--key` is its old name.")


def signing_key(required: bool = False, help: str = "EC private key (PEM) to sign with"):
    """`--signing-key` (old name `--key`) [env: SPECPACK_SIGNING_KEY]."""
    return click.option("--signing-key", "--key", "key", required=required, type=click.Path(path_type=Path),
                        envvar="SPECPACK_SIGNING_KEY", callback=renamed("--key", "--signing-key"),
                        help=f"{help} [env: SPECPACK_SIGNING_KEY]; `--key` is its old name.")


VERBOSE = re.compile(r"-v+|--verbose")


def hoist_verbose(args: list[str]) -> list[str]:
    """`-v` / `-vv` / `--verbose` given after the command name moved before it, where the group reads
    them (`specpack run ART -v` works as `specpack -v run ART`); what follows `--` is an engine's and
    stays where it is."""
    out, hoisted, command_seen = [], [], False
    for i, arg in enumerate(args):
        if arg == "--":
            out += args[i:]
            break
        if command_seen and VERBOSE.fullmatch(arg):
            hoisted.append(arg)
            continue
        command_seen = command_seen or not arg.startswith("-")
        out.append(arg)
    return hoisted + out


class _Group(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_verbose(list(args)))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="specpack")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug); before or after the command.")
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
    from specpack._redact import RedactingFilter

    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # every logger's records pass these: none shows a password
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


DTYPE = click.option("--dtype", default="float32", show_default=True,
                     type=click.Choice(["float32", "float16", "bfloat16"]))
DEVICE = click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
BACKEND = click.option("--backend", default="torch", show_default=True,
                       type=click.Choice(["torch", "onnxruntime", "tensorrt"]),
                       help="torch (cpu/cuda); onnxruntime (cpu, needs `specpack export ART --to onnx`); "
                            "tensorrt (cuda, engines built and cached on first use).")
WEIGHTS = click.option("--weights", default="fp32", show_default=True,
                       type=click.Choice(WEIGHT_CHOICES),
                       help="Precision the CPU kernels keep the linear weights in: fp16/bf16 stream half the bytes "
                            "(exact for a checkpoint stored so), int8 a quarter (per-block scales, like Q8_0) with fp32 "
                            "activations; w8a8 rounds the activations to int8 blocks too (llama.cpp's Q8_0 "
                            "arithmetic: int8 dot products, several rows about the price of one). Speculation "
                            "stays lossless at each (torch backend, cpu, float32). A target imported with its GGUF "
                            "blocks keeps them whatever this says; its drafter is packed in this precision, fp32 "
                            "meaning int8 blocks beside it (docs/running.md, GGUF blocks).")
KV_CACHE = click.option("--kv-cache", default="model", show_default=True, type=click.Choice(KV_CACHES),
                        help="The target's KV cache: the model's dtype, or fp16 (a float32 model's keys and values "
                             "rounded to fp16 as written: half the bytes each step reads per cached position, "
                             "which long contexts and many users are bound by; torch backend, float32).")


def tree_shape(value: str | None, option: str):
    """Parse a draft tree 'KxM' (top-k K, M nodes) into a TreeShape; 'chain' is top-k 1 (chains);
    None stays None (the profile's)."""
    from specpack.runtime.drafters.base import TreeShape

    if value is None:
        return None
    if value.strip().lower() == "chain":
        return TreeShape(1, 1)
    parts = value.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise click.BadParameter(f"expected TOPKxNODES (e.g. 4x24) or 'chain', got {value!r}", param_hint=option)
    return TreeShape(int(parts[0]), int(parts[1]))


def tree_shapes(value: str | None, option: str) -> list[tuple[int, int, int]] | None:
    """Parse 'DxKxM,...' (depth, top-k, nodes) into tuples; 'none' is an empty list (no trees)."""
    if value is None:
        return None
    if value.strip().lower() == "none":
        return []
    shapes = [tuple(v.strip().lower().split("x")) for v in value.split(",") if v.strip()]
    if not all(len(s) == 3 and all(x.isdigit() for x in s) for s in shapes):
        raise click.BadParameter(f"expected DEPTHxTOPKxNODES,... (e.g. 5x4x20) or 'none', got {value!r}",
                                 param_hint=option)
    return [tuple(int(x) for x in s) for s in shapes]


def int_list(value: str | None, option: str) -> list[int] | None:
    """Parse '1,2,4' into [1, 2, 4] (None stays None)."""
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}",
                                 param_hint=option) from None
