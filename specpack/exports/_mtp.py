"""What the MTP exports share: how an engine runs a published MTP layout, the checks that refuse
what it cannot represent, the canonical tensors with the file and byte range each lies at, and a
writer that copies those byte ranges into a new safetensors file (weights are never decoded, so a
written tensor is the canonical one byte for byte).

An artifact's MTP drafter fixes four bindings (manifest `MtpDrafter`): the concatenation order, the
target hidden state feeding layer 0, what step k hands step k + 1 (`chain_hidden_state`), and which
layer step k runs (k, or k mod n with `allow_layer_reuse`). Aux-layer ids do not apply. An engine
that computes any of them differently would draft other tokens than the ones specpack validated, so
the export is refused; the chained state only matters from the second draft token on.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# the converter's canonical fusion names and safetensors data offset: this module inverts its mapping
from specpack.converters.mtp import _FUSION, LAYOUTS, _data_start
from specpack.converters.safetensors_header import TensorMeta, read_header
from specpack.errors import ConversionError
from specpack.exports._common import target_tensors

FAMILIES = {"mtp-deepseek": "DeepSeek-V3/GLM-4.5", "mtp-mimo": "MiMo", "mtp-qwen3-next": "Qwen3-Next/Qwen3.5",
            "mtp-nemotron-h": "Nemotron 3"}
_WORDS = {
    "embedding_first": "cat(norm(embedding), norm(hidden)), embedding first",
    "hidden_first": "cat(norm(hidden), norm(embedding)), hidden state first",
    "final_norm_output": "the target's final-norm output",
    "last_layer_output": "the target's last layer output before the final norm",
    "pre_norm": "its block output before the MTP final norm",
    "post_norm": "its output after the MTP final norm",
}


@dataclass(frozen=True)
class EngineMtp:
    """How one engine runs one published MTP layout (read from its source; cited per engine)."""

    concat_order: str
    target_hidden_state: str
    chain_hidden_state: str  # what draft step k hands step k + 1
    layer_per_step: str  # "first": every step runs MTP layer 0; "mod": step k runs layer k mod n
    max_layers: int | None = None  # MTP layers its loader takes (None: any number)
    separate_weights: bool = False  # the export writes the MTP layer as its own draft checkpoint


def problems(engine: str, table: dict, manifest, draft_len: int) -> list[str]:
    """Why `engine` (whose layouts are `table`: layout -> EngineMtp, or the reason it has none)
    cannot run this MTP drafter for `draft_len` tokens as the artifact binds it."""
    d = manifest.drafter
    how = table.get(d.source_layout, f"{engine} has no MTP support for this layout")
    if isinstance(how, str):
        return [f"{FAMILIES[d.source_layout]} MTP ({d.source_layout}): {how}"]
    out = []
    if d.location == "drafter" and not how.separate_weights:
        out.append(f"{engine} reads the MTP layers from the target checkpoint, but this artifact's target "
                   "lacks them (they are in drafter/model.safetensors)")
    for field, what in (("concat_order", "concatenates"), ("target_hidden_state", "feeds MTP layer 0")):
        if getattr(how, field) != getattr(d, field):
            out.append(f"{engine} {what} {_WORDS[getattr(how, field)]}, but this artifact's drafter uses "
                       f"{_WORDS[getattr(d, field)]}")
    if how.max_layers is not None and d.num_layers > how.max_layers:
        out.append(f"{engine}'s loader takes {how.max_layers} MTP layer(s); this drafter has {d.num_layers}")
    if draft_len > 1 and how.chain_hidden_state != d.chain_hidden_state:
        out.append(f"{engine} hands the next draft step {_WORDS[how.chain_hidden_state]}, this drafter "
                   f"{_WORDS[d.chain_hidden_state]}: draft tokens 2..{draft_len} would differ "
                   "(--draft-len 1 is unaffected)")
    if draft_len > 1 and how.layer_per_step == "first" and d.num_layers > 1:
        out.append(f"{engine} runs MTP layer 0 at every draft step, but this drafter's step k runs "
                   "layer k (--draft-len 1 is unaffected)")
    return out


def bindings(ctx, engine: str, how: EngineMtp, reads: str) -> list[str]:
    """README lines stating what the engine will do, in the artifact's terms."""
    d, D = ctx.manifest.drafter, ctx.draft_len
    if D == 1:
        steps = "1: MTP layer 0 only, so no hidden state is chained between draft steps"
    else:
        which = "layer 0" if how.layer_per_step == "first" or d.num_layers == 1 else "layer k mod n"
        reuse = " (layer reuse, as the artifact allows)" if D > d.num_layers else ""
        steps = (f"{D}: every draft step runs {which}{reuse} and hands the next one "
                 f"{_WORDS[d.chain_hidden_state]}")
    return [f"Layout: {d.source_layout} ({FAMILIES[d.source_layout]}), {d.num_layers} MTP layer(s); "
            f"{engine} reads {reads}.",
            f"Concatenation: {_WORDS[d.concat_order]}.",
            f"Hidden state feeding MTP layer 0: {_WORDS[d.target_hidden_state]}.",
            f"Draft tokens per step: {steps}.",
            "No aux hidden states: aux-layer conventions do not apply to MTP."]


# ---- canonical tensors, where they lie, and byte-for-byte copies ----

Located = tuple[Path, TensorMeta]  # (safetensors file, the tensor's entry in its header)


def canonical_tensors(ctx) -> dict[str, Located]:
    """Canonical MTP name -> where its bytes are: the target shard the drafter config maps it to, or
    drafter/model.safetensors when the artifact stores the layers itself."""
    d = ctx.manifest.drafter
    if d.location == "drafter":
        path = ctx.artifact / d.weights
        return {n: (path, m) for n, m in read_header(path).items()}
    mapping = json.loads((ctx.artifact / d.config).read_text())["tensors"]
    index = target_tensors(ctx)
    return {c: index[s] for c, s in mapping.items()}


def layout_names(layout: str, canonical: list[str], prefix) -> dict[str, str]:
    """Canonical name -> the layout's own name, with MTP layer k under `prefix(k)` (the inverse of
    converters/mtp.py's mapping)."""
    fusion = dict(zip(_FUSION, LAYOUTS[layout].fusion))
    out = {}
    for name in canonical:
        _, k, rest = name.split(".", 2)
        p = prefix(int(k))
        out[name] = p + rest.removeprefix("block.") if rest.startswith("block.") else fusion[rest].format(p=p)
    return out


def check_reads(ctx, engine: str, extra: list[str] = ()) -> str:
    """Check that every target tensor `engine` reads (the MTP layers the drafter config maps, the
    shared embedding / head / norm, and `extra`) is in the artifact's shards; a short summary."""
    d, L = ctx.manifest.drafter, ctx.manifest.target.num_hidden_layers
    mapping = json.loads((ctx.artifact / d.config).read_text())["tensors"]
    names = sorted({*mapping.values(), *d.shared_tensors, *extra})
    index = target_tensors(ctx)
    missing = [n for n in names if n not in index]
    if missing:
        raise ConversionError(f"the artifact's target lacks tensors {engine} reads for MTP", problems=missing,
                              hint="rebuild the artifact from the original checkpoint")
    prefixes = (["mtp."] if d.source_layout == "mtp-qwen3-next"
                else [LAYOUTS[d.source_layout].prefix(k, L) for k in range(d.num_layers)])
    parts = [f"`{p}*` ({sum(n.startswith(p) for n in names)} tensors)" for p in prefixes]
    parts += [f"`{n}`" for n in names if not n.startswith(tuple(prefixes))]
    return "from the target: " + ", ".join(parts)


def copy_tensors(path: Path, sources: dict[str, Located]) -> None:
    """Write a safetensors file with each source tensor's bytes, unchanged, under its new name;
    streamed in chunks, so memory does not grow with the layer."""
    header, offset = {}, 0
    for name in sorted(sources):
        meta = sources[name][1]
        header[name] = {"dtype": meta.dtype, "shape": list(meta.shape),
                        "data_offsets": [offset, offset + meta.end - meta.start]}
        offset += meta.end - meta.start
    raw = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the safetensors writer pads it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(sources):
            src, meta = sources[name]
            _copy_range(src, _data_start(src) + meta.start, meta.end - meta.start, out)


def _copy_range(src: Path, start: int, size: int, out, chunk: int = 1 << 24) -> None:
    with open(src, "rb") as f:
        f.seek(start)
        while size:
            data = f.read(min(chunk, size))
            if not data:
                raise ConversionError(f"{src} ends before the tensor it lists", hint="verify the artifact")
            out.write(data)
            size -= len(data)


def remote_code(ctx) -> bool:
    """The target's config names its own modelling code (`auto_map`): engines need trust-remote-code."""
    return "auto_map" in json.loads((ctx.artifact / "config.json").read_text())
