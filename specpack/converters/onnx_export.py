"""Export an artifact's target and drafter as the ONNX graphs the speculative loop runs.

    export_onnx(ART, key=...)  ->  ART/exports/onnx/{target.onnx, eagle3.onnx | draft_model.onnx,
                                                     weights.bin, index.json}

Graphs (fp32, opset 17, weights in one external data file shared by both graphs):

- `target_step`: T new tokens (T in [1, D+1] when verifying, any T for a prefill) after P cached
  ones. Inputs `tokens [T]`, `positions [T]`, `mask [T, P+T]` (bool, True = may attend),
  `logits_index [K]` (rows whose logits to compute: all T when verifying, the last one after a
  prefill), `past_key.{i}`, `past_value.{i}` `[P, kv_heads, head_dim]` per layer. Outputs
  `logits [K, V]`, `aux [T, n_aux*H]` (EAGLE-3 only: hidden states entering the aux layers), and
  `new_key.{i}`, `new_value.{i}` `[T, kv_heads, head_dim]`: only the T new slots.
- `eagle3_step`: the head's fc + one layer + norm/lm_head, same cache convention, its own KV.
  Inputs `feats [R, n_aux*Ht]` (target features; fc is applied to them) and `hidden [U, H]` (the
  head's own earlier outputs), whose rows are concatenated in that order, and `tokens [R+U]`;
  outputs `hidden_out [R+U, H]`, `logits [K, draft_vocab]` and the new KV.
- `draft_model_step`: a draft model's own `target_step` graph (no aux). n-gram needs no drafter graph.

Why the cache is slot-major `[slots, kv_heads, head_dim]` per layer with only the new slots out:
the runtime keeps one preallocated buffer per layer, passes its first P slots as `past` (a
contiguous prefix: no copy) and binds `new_*` to slots P..P+T of the same buffer, so the graph
writes the new keys and values in place. Rolling back is lowering P, as in the torch runtime. A
graph returning the whole updated cache would copy every cached slot on every step instead.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpack.errors import InputError, OutputError
from specpack.schemas.exports import Exports, OnnxExport, OnnxGraph, TensorInfo

log = logging.getLogger(__name__)

ONNX_DIR = "exports/onnx"
INDEX_NAME = "index.json"
DATA_NAME = "weights.bin"
OPSET = 17
ALIGN = 1 << 16  # big tensors start on 64 KiB boundaries so ONNX Runtime can map them from the file
STAGING = ".specpack-onnx-export"


# ---- what the graphs are: specpack.schemas.exports (index.json and the manifest's `exports`) ----

def read_index(artifact: Path) -> OnnxExport | None:
    """The export's index (None when the artifact has no ONNX export)."""
    path = Path(artifact) / ONNX_DIR / INDEX_NAME
    if not path.is_file():
        return None
    return OnnxExport.model_validate_json(path.read_text())


# ---- the graphs: functional modules over the runtime's weights, cache in and out explicitly ----

def linear_params(module) -> tuple[Tensor, Tensor | None]:
    """(weight [out, in], bias) of a linear layer of the runtime model, whatever kernel it runs on:
    nn.Linear, or a packed layer keeping K-major panels [ceil(out/16), in, 16] (kernels.linear)."""
    w, b = module.weight, getattr(module, "bias", None)
    if w.dim() == 3:
        w = w.transpose(1, 2).reshape(-1, w.shape[1])[: module.out_features]
    return w.detach(), None if b is None else b.detach()


def _param(t: Tensor | None, seen: dict) -> nn.Parameter | None:
    """A parameter sharing `t`'s storage; the same tensor gives the same parameter (tied weights
    become one initializer)."""
    if t is None:
        return None
    key = (t.data_ptr(), tuple(t.shape), t.dtype)
    if key not in seen:
        seen[key] = nn.Parameter(t.float(), requires_grad=False)
    return seen[key]


def rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, heads, hd]; cos, sin: [T, 1, hd]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    ang = positions.float()[:, None] * inv_freq[None]  # [T, hd/2]
    emb = torch.cat([ang, ang], dim=-1)[:, None]  # [T, 1, hd]
    return emb.cos(), emb.sin()


def attend(q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor) -> Tensor:
    """GQA attention of T new queries over P cached and T new keys, without concatenating the cache.

    q: [T, heads, hd]; k, v: [T, kv, hd]; past_k, past_v: [P, kv, hd]; mask: [T, P+T] -> [T, heads*hd]"""
    T, heads, hd = q.shape
    kv = k.shape[1]
    G = heads // kv
    # query head h uses key head h // G: group the queries as [kv, G*T, hd]
    qg = q.reshape(T, kv, G, hd).permute(1, 2, 0, 3).reshape(kv, G * T, hd) * (1.0 / math.sqrt(hd))
    scores = torch.cat([qg @ past_k.permute(1, 2, 0), qg @ k.permute(1, 2, 0)], dim=-1)  # [kv, G*T, P+T]
    S = scores.shape[-1]
    scores = scores.reshape(kv, G, T, S).masked_fill(~mask, float("-inf"))
    p = scores.softmax(-1).reshape(kv, G * T, S)
    P = past_k.shape[0]
    y = p[..., :P] @ past_v.permute(1, 0, 2) + p[..., P:] @ v.permute(1, 0, 2)  # [kv, G*T, hd]
    return y.reshape(kv, G, T, hd).permute(2, 0, 1, 3).reshape(T, heads * hd)


class _Attention(nn.Module):
    def __init__(self, attn, eps: float, seen: dict):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = attn.heads, attn.kv_heads, attn.head_dim, eps
        w, b = linear_params(attn.qkv_proj)
        self.qkv_w, self.qkv_b = _param(w, seen), _param(b, seen)
        w, b = linear_params(attn.o_proj)
        self.o_w, self.o_b = _param(w, seen), _param(b, seen)
        self.q_norm = _param(attn.q_norm.weight if attn.q_norm is not None else None, seen)
        self.k_norm = _param(attn.k_norm.weight if attn.k_norm is not None else None, seen)

    def forward(self, x, cos, sin, past_k, past_v, mask):
        T, hd = x.shape[0], self.head_dim
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).split(
            [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q, k, v = q.reshape(T, self.heads, hd), k.reshape(T, self.kv_heads, hd), v.reshape(T, self.kv_heads, hd)
        if self.q_norm is not None:
            q, k = rms(q, self.q_norm, self.eps), rms(k, self.k_norm, self.eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = attend(q, k, v, past_k, past_v, mask)
        return F.linear(y, self.o_w, self.o_b), k, v


class _MLP(nn.Module):
    def __init__(self, mlp, seen: dict):
        super().__init__()
        self.gate_up = _param(linear_params(mlp.gate_up_proj)[0], seen)
        self.down = _param(linear_params(mlp.down_proj)[0], seen)

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


class _Block(nn.Module):
    def __init__(self, block, eps: float, seen: dict):
        super().__init__()
        self.eps = eps
        self.ln1 = _param(block.input_layernorm.weight, seen)
        self.attn = _Attention(block.self_attn, eps, seen)
        self.ln2 = _param(block.post_attention_layernorm.weight, seen)
        self.mlp = _MLP(block.mlp, seen)

    def forward(self, x, cos, sin, past_k, past_v, mask):
        a, k, v = self.attn(rms(x, self.ln1, self.eps), cos, sin, past_k, past_v, mask)
        x = x + a
        return x + self.mlp(rms(x, self.ln2, self.eps)), k, v


class TargetStep(nn.Module):
    """The target over T new tokens with the cache passed in and the new slots returned (fp32)."""

    def __init__(self, model, capture: Sequence[int] = ()):
        super().__init__()
        from specpack.runtime.model import rope_inv_freq

        s, seen = model.spec, {}
        self.capture, self.eps = tuple(capture), s.rms_norm_eps
        self.embed = _param(model.embed_tokens.weight, seen)
        self.layers = nn.ModuleList(_Block(b, s.rms_norm_eps, seen) for b in model.layers)
        self.norm = _param(model.norm.weight, seen)
        self.lm_head = _param(linear_params(model.lm_head)[0], seen)
        self.register_buffer("inv_freq", rope_inv_freq(s.head_dim, s.rope_theta, s.rope_scaling))

    def forward(self, tokens, positions, mask, logits_index, *past):
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        x = F.embedding(tokens, self.embed)  # [T, H]
        aux, new = [], []
        for i, layer in enumerate(self.layers):
            if i in self.capture:
                aux.append(x)
            x, k, v = layer(x, cos, sin, past[2 * i], past[2 * i + 1], mask)
            new += [k, v]
        logits = F.linear(rms(x.index_select(0, logits_index), self.norm, self.eps), self.lm_head)
        return (logits, torch.cat(aux, dim=-1), *new) if aux else (logits, *new)


class Eagle3Step(nn.Module):
    """The EAGLE-3 head: fc over target features, its layer over cat(fc(feats), hidden), norm, lm_head."""

    def __init__(self, head):
        super().__init__()
        from specpack.runtime.model import rope_inv_freq

        s, seen = head.spec, {}
        layer = head.layers[0]
        self.eps, self.norm_before_residual = s.rms_norm_eps, s.norm_before_residual
        self.fc = _param(linear_params(head.fc)[0], seen)
        self.embed = _param(head.embed_tokens.weight, seen)
        self.ln_in = _param(layer.input_layernorm.weight, seen)
        self.ln_hidden = _param(layer.hidden_norm.weight, seen)
        self.attn = _Attention(layer.self_attn, s.rms_norm_eps, seen)
        self.ln_post = _param(layer.post_attention_layernorm.weight, seen)
        self.mlp = _MLP(layer.mlp, seen)
        self.norm = _param(head.norm.weight, seen)
        self.lm_head = _param(linear_params(head.lm_head)[0], seen)
        self.register_buffer("inv_freq", rope_inv_freq(s.head_dim, s.rope_theta, s.rope_scaling))

    def forward(self, feats, hidden, tokens, positions, mask, logits_index, past_k, past_v):
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        h = torch.cat([F.linear(feats, self.fc), hidden], dim=0)  # [T, H]
        normed = rms(h, self.ln_hidden, self.eps)
        x = torch.cat([rms(F.embedding(tokens, self.embed), self.ln_in, self.eps), normed], dim=-1)
        a, k, v = self.attn(x, cos, sin, past_k, past_v, mask)
        h = (normed if self.norm_before_residual else h) + a
        h = h + self.mlp(rms(h, self.ln_post, self.eps))
        logits = F.linear(rms(h.index_select(0, logits_index), self.norm, self.eps), self.lm_head)
        return h, logits, k, v


# ---- export: graphs -> one shared external data file -> check -> into the artifact -> manifest -> sign ----

def export_onnx(artifact: Path, key: Path | None = None, public_key: Path | None = None, force: bool = False,
                drop_signature: bool = False, progress: bool = True) -> list[Path]:
    """Export `artifact`'s target (and EAGLE-3 head) as ONNX under `exports/onnx/`, add the files to
    the manifest and re-sign with `key`. Returns the written paths.

    The artifact is verified first (signature too when `public_key` is given). A signed artifact
    needs `key` to stay signed; pass `drop_signature=True` to leave it unsigned (digests still
    checked). Nothing in the artifact changes when the export or a check fails."""
    from specpack.packager import verify
    from specpack.schemas import SIGNATURE_NAME

    artifact = Path(artifact)
    manifest = verify(artifact, public_key, progress=progress).manifest
    signed = (artifact / SIGNATURE_NAME).is_file()
    if signed and key is None and not drop_signature:
        raise InputError(f"'{artifact}' is signed: adding the export would invalidate its signature",
                         hint="pass --key KEY.pem to re-sign it (or --drop-signature to leave it unsigned)")
    dest = artifact / ONNX_DIR
    if dest.exists() and not force:
        raise OutputError(f"'{dest}' already exists", hint="pass --force to replace the export")
    staging = Path(_mkdtemp(artifact))
    try:
        index = _export_graphs(artifact, manifest, staging, progress)
        (staging / INDEX_NAME).write_text(index.model_dump_json(indent=2) + "\n")
        _move_into(staging, dest, artifact)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    written = sorted(dest.iterdir())
    exports = (manifest.exports or Exports()).model_copy(update={"onnx": index})
    add_files(artifact, ONNX_DIR, key, drop_signature=drop_signature and signed, update={"exports": exports})
    log.info("exported %s: %s", artifact, ", ".join(p.name for p in written))
    return written


def _mkdtemp(artifact: Path) -> str:
    import tempfile

    # beside the artifact (same file system, so the final rename is atomic), never inside it
    return tempfile.mkdtemp(prefix=f".{artifact.name}.onnx-", dir=artifact.parent)


def _move_into(staging: Path, dest: Path, artifact: Path) -> None:
    """Rename `staging` to `dest`; an existing `dest` is moved out first and removed after."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    trash = Path(_mkdtemp(artifact))
    if dest.exists():
        dest.rename(trash / "old")
    staging.rename(dest)
    shutil.rmtree(trash, ignore_errors=True)


def _export_graphs(artifact: Path, manifest, out: Path, progress: bool) -> OnnxExport:
    from specpack.errors import UnsupportedError
    from specpack.runtime.model import Transformer
    from specpack.runtime.spec_model import MAX_DRAFT_LEN, load_drafter, load_target

    kind = manifest.drafter.kind
    if kind not in ("eagle3", "ngram", "draft_model"):
        raise UnsupportedError(f"ONNX export does not support drafter kind '{kind}' yet",
                               hint="supported: eagle3, ngram, draft_model")
    target = load_target(artifact)
    draft = load_drafter(kind, None, artifact / "drafter", target).model if kind == "draft_model" else None
    for model in (target, draft):
        if model is not None and not isinstance(model, Transformer):
            raise UnsupportedError(f"ONNX export does not support {model.spec.architecture} models yet",
                                   hint="supported: the dense Llama / Mistral / Qwen2 / Qwen3 families")
    aux = tuple(manifest.drafter.aux_hidden_states.layer_ids) if kind == "eagle3" else ()
    graphs, protos = [], {}
    log.info("exporting the target step graph (%d layers)", target.spec.num_layers)
    protos["target.onnx"], g = _trace(TargetStep(target, aux), target_io(target.spec, aux), out / "raw-target")
    graphs.append(OnnxGraph(role="target_step", path=f"{ONNX_DIR}/target.onnx", num_layers=target.spec.num_layers, **g))
    if kind == "eagle3":
        head = load_drafter("eagle3", None, artifact / "drafter", target)
        log.info("exporting the EAGLE-3 step graph")
        protos["eagle3.onnx"], g = _trace(Eagle3Step(head), eagle3_io(head.spec), out / "raw-eagle3")
        graphs.append(OnnxGraph(role="eagle3_step", path=f"{ONNX_DIR}/eagle3.onnx", num_layers=1, **g))
    if draft is not None:
        log.info("exporting the draft model step graph (%d layers)", draft.spec.num_layers)
        protos["draft_model.onnx"], g = _trace(TargetStep(draft), target_io(draft.spec, ()), out / "raw-draft")
        graphs.append(OnnxGraph(role="draft_model_step", path=f"{ONNX_DIR}/draft_model.onnx",
                                num_layers=draft.spec.num_layers, **g))
    _save_graphs(protos, out, DATA_NAME)
    for name in protos:
        _check(out / name)
    return OnnxExport(opset=OPSET, data_file=f"{ONNX_DIR}/{DATA_NAME}", max_verify_tokens=MAX_DRAFT_LEN + 1,
                      aux_layer_ids=list(aux) or None, drafter_kind=kind,
                      exporter=f"torch.onnx (TorchScript) {torch.__version__}", graphs=graphs)


# ---- graph signatures: (name, dtype, shape) of inputs and outputs, and tracing examples ----

def _kv(prefix: str, layers: int, kv: int, hd: int, dim: str, single: bool = False) -> list[tuple]:
    if single:
        return [(f"{prefix}_key", "float32", [dim, kv, hd]), (f"{prefix}_value", "float32", [dim, kv, hd])]
    return [(f"{prefix}_{kind}.{i}", "float32", [dim, kv, hd]) for i in range(layers) for kind in ("key", "value")]


def target_io(s, aux: Sequence[int]) -> tuple[list[tuple], list[tuple]]:
    """(inputs, outputs) of the target step graph as (name, dtype, shape) with symbolic dims."""
    L, kv, hd = s.num_layers, s.num_kv_heads, s.head_dim
    inputs = [("tokens", "int64", ["T"]), ("positions", "int64", ["T"]), ("mask", "bool", ["T", "P+T"]),
              ("logits_index", "int64", ["K"])] + _kv("past", L, kv, hd, "P")
    outputs = [("logits", "float32", ["K", s.vocab_size])]
    if aux:
        outputs.append(("aux", "float32", ["T", len(aux) * s.hidden_size]))
    return inputs, outputs + _kv("new", L, kv, hd, "T")


def eagle3_io(s) -> tuple[list[tuple], list[tuple]]:
    kv, hd = s.num_kv_heads, s.head_dim
    inputs = [("feats", "float32", ["R", len(s.aux_layer_ids) * s.target_hidden_size]),
              ("hidden", "float32", ["U", s.hidden_size]), ("tokens", "int64", ["T"]),
              ("positions", "int64", ["T"]), ("mask", "bool", ["T", "P+T"]), ("logits_index", "int64", ["K"])]
    outputs = [("hidden_out", "float32", ["T", s.hidden_size]), ("logits", "float32", ["K", s.draft_vocab_size])]
    return inputs + _kv("past", 1, kv, hd, "P", True), outputs + _kv("new", 1, kv, hd, "T", True)


# example sizes for tracing: distinct, so the tracer cannot confuse one symbolic dim with another
_EXAMPLE = {"T": 5, "P": 3, "K": 4, "R": 2, "U": 3, "P+T": 8}
_TORCH = {"int64": torch.long, "bool": torch.bool, "float32": torch.float32}


def _example(name: str, dtype: str, shape: list) -> Tensor:
    dims = [_EXAMPLE.get(d, d) for d in shape]
    if name == "mask":
        return torch.ones(dims, dtype=torch.bool).tril(_EXAMPLE["P"])
    if name == "positions":
        return torch.arange(_EXAMPLE["P"], _EXAMPLE["P"] + dims[0])
    if name == "logits_index":
        return torch.arange(dims[0])
    if dtype == "int64":
        return torch.randint(0, 3, dims)
    return torch.randn(dims)


def _trace(module: nn.Module, io, raw: Path):
    """torch.onnx.export (TorchScript: robust for this static-shape-free code) -> (ModelProto, io dict)."""
    import warnings

    import onnx

    inputs, outputs = io
    args = tuple(_example(*i) for i in inputs)
    dynamic = {n: {k: d for k, d in enumerate(shape) if isinstance(d, str)} for n, _, shape in inputs + outputs}
    raw.mkdir(parents=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
        torch.onnx.export(module.eval(), args, str(raw / "model.onnx"), dynamo=False, opset_version=OPSET,
                          input_names=[i[0] for i in inputs], output_names=[o[0] for o in outputs],
                          dynamic_axes=dynamic, do_constant_folding=False)
    proto = onnx.load(str(raw / "model.onnx"), load_external_data=True)
    shutil.rmtree(raw)
    info = {k: [TensorInfo(name=n, dtype=d, shape=s) for n, d, s in v] for k, v in (("inputs", inputs),
                                                                                    ("outputs", outputs))}
    return proto, info


def _save_graphs(protos: dict, out: Path, data_name: str) -> None:
    """Write every initializer of every graph once into `data_name` (identical tensors, such as a
    drafter's copy of the target's embedding, share their bytes), then each graph without weights."""
    import onnx
    from onnx.external_data_helper import set_external_data

    stored: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)
    with open(out / data_name, "wb") as f:
        for proto in protos.values():
            for t in proto.graph.initializer:
                data = t.raw_data
                if len(data) < 1024:
                    continue  # small tensors stay in the graph
                digest = hashlib.sha256(data).hexdigest()
                if digest not in stored:
                    if len(data) >= ALIGN:
                        f.write(b"\0" * (-f.tell() % ALIGN))
                    stored[digest] = (f.tell(), len(data))
                    f.write(data)
                set_external_data(t, data_name, *stored[digest])
                t.ClearField("raw_data")
                t.data_location = onnx.TensorProto.EXTERNAL
    for name, proto in protos.items():
        onnx.save_model(proto, str(out / name))


def _check(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise RuntimeError(f"the exported graph {path.name} does not pass onnx.checker: {exc}") from exc


# ---- adding exported files to the manifest ----

def add_files(artifact: Path, prefix: str, key: Path | None, drop_signature: bool = False,
              update: dict | None = None) -> None:
    """Replace the manifest's entries under `prefix/` with the files now there (size, sha256), apply
    `update` (manifest fields), write the manifest atomically, and re-sign with `key` (or remove a
    signature that no longer holds)."""
    import tempfile

    from specpack.packager import sign_artifact
    from specpack.packager.artifact import read_manifest, write_manifest
    from specpack.packager.hashing import sha256_file
    from specpack.schemas import SIGNATURE_NAME, FileEntry

    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    root = artifact / prefix
    new = [p for p in sorted(root.rglob("*")) if p.is_file()] if root.is_dir() else []
    entries = [f for f in manifest.files if not f.path.startswith(prefix.rstrip("/") + "/")]
    entries += [FileEntry(path=p.relative_to(artifact).as_posix(), size=p.stat().st_size, sha256=sha256_file(p))
                for p in new]
    updated = manifest.model_copy(update={**(update or {}), "files": sorted(entries, key=lambda f: f.path)})
    with tempfile.TemporaryDirectory(dir=artifact.parent) as tmp:
        os.replace(write_manifest(Path(tmp), updated), artifact / "specpack.json")
    if key is not None:
        sign_artifact(artifact, key)
    elif drop_signature:
        (artifact / SIGNATURE_NAME).unlink(missing_ok=True)
