"""The export pipeline: graphs -> one shared external data file -> check -> into the artifact ->
manifest -> sign. What the graphs are: the package docstring."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import torch
from torch import Tensor, nn

from specpack.exports.onnx import block, eagle3, mtp, target
from specpack.errors import OutputError
from specpack.schemas.exports import ONNX_DIR, Exports, OnnxExport, OnnxGraph, TensorInfo
from specpack.schemas.exports import ONNX_INDEX_NAME as INDEX_NAME

log = logging.getLogger(__name__)

DATA_NAME = "weights.bin"
OPSET = 17
ALIGN = 1 << 16  # big tensors start on 64 KiB boundaries so ONNX Runtime can map them from the file


# ---- what the graphs are: specpack.schemas.exports (index.json and the manifest's `exports`) ----

# ---- export: graphs -> one shared external data file -> check -> into the artifact -> manifest -> sign ----

def export_onnx(artifact: Path, key: Path | None = None, public_key: Path | None = None, force: bool = False,
                drop_signature: bool = False, progress: bool = True) -> list[Path]:
    """Export `artifact`'s target and drafter as ONNX step graphs under `exports/onnx/`, add the files
    to the manifest and re-sign with `key`. Returns the written paths.

    The artifact is verified first (signature too when `public_key` is given). A signed artifact
    needs `key` to stay signed; pass `drop_signature=True` to leave it unsigned (digests still
    checked). Every option is checked before any work, and the artifact changes in one transaction
    at the end (`specpack.packager.update`): a failed, interrupted or killed export leaves it as it was."""
    from specpack.packager import verify
    from specpack.packager.update import check_update_options, recover, update_artifact

    artifact = Path(artifact)
    what, hint = "adding the ONNX export", "pass --signing-key KEY.pem to re-sign it (or --drop-signature)"
    check_update_options(artifact, key, drop_signature, what, hint)
    recover(artifact)
    manifest = verify(artifact, public_key, progress=progress).manifest
    dest = artifact / ONNX_DIR
    if dest.exists() and not force:
        raise OutputError(f"'{dest}' already exists", hint="pass --force to replace the export")
    with update_artifact(artifact, key, drop_signature, what, hint=hint) as update:
        staging = update.stage(ONNX_DIR)
        staging.mkdir()
        index = _export_graphs(artifact, manifest, staging, progress)
        (staging / INDEX_NAME).write_text(index.model_dump_json(indent=2) + "\n")
        update.manifest_update["exports"] = (manifest.exports or Exports()).model_copy(update={"onnx": index})
    written = sorted(dest.iterdir())
    log.info("exported %s: %s", artifact, ", ".join(p.name for p in written))
    return written


# drafter kind -> its graphs, from the drafter module the runtime loads (n-gram needs none)
DRAFTER_GRAPHS = {"ngram": lambda drafter: [], "eagle3": eagle3.graphs, "draft_model": target.draft_graphs,
                  "mtp": mtp.graphs, "block": block.graphs}


def _aux_layers(drafter) -> tuple[int, ...]:
    """The target layers whose input hidden states the drafter reads (the target graph's `aux`)."""
    if drafter.kind == "eagle3":
        return tuple(drafter.aux_hidden_states.layer_ids)
    if drafter.kind == "block":
        return tuple(drafter.target_features.layer_ids)
    return ()


def _export_graphs(artifact: Path, manifest, out: Path, progress: bool) -> OnnxExport:
    from specpack.errors import UnsupportedError
    from specpack.runtime.spec_model import MAX_DRAFT_LEN, load_drafter, load_target

    kind = manifest.drafter.kind
    if kind not in DRAFTER_GRAPHS:
        raise UnsupportedError(f"ONNX export does not support drafter kind '{kind}' yet",
                               hint="supported: " + ", ".join(DRAFTER_GRAPHS))
    model = load_target(artifact)
    drafter = None if kind == "ngram" else load_drafter(kind, None, artifact / "drafter", model)
    aux = _aux_layers(manifest.drafter)
    hidden = drafter.spec.target_hidden_state if kind == "mtp" else None
    entries = write_graphs([target.graph(model, aux, hidden), *DRAFTER_GRAPHS[kind](drafter)], out)
    return OnnxExport(opset=OPSET, data_file=f"{ONNX_DIR}/{DATA_NAME}", max_verify_tokens=MAX_DRAFT_LEN + 1,
                      aux_layer_ids=list(aux) or None, target_hidden=hidden, drafter_kind=kind,
                      exporter=f"torch.onnx (TorchScript) {torch.__version__}", graphs=entries)


def write_graphs(graphs: list, out: Path, prefix: str = ONNX_DIR) -> list[OnnxGraph]:
    """Trace `graphs` (layers.Graph) into `out` with one shared weights file, check them, and
    return their index entries (paths `prefix/file`)."""
    protos, entries = {}, []
    for g in graphs:
        log.info("exporting the %s graph %s (%d layers)", g.role, g.file, g.num_layers)
        protos[g.file], io = _trace(g.module, g.io, out / f"raw-{g.file}", g.examples)
        entries.append(OnnxGraph(role=g.role, path=f"{prefix}/{g.file}", num_layers=g.num_layers, layer=g.layer,
                                 **io))
    _save_graphs(protos, out, DATA_NAME)
    for name in protos:
        _check(out / name)
    return entries


# ---- tracing ----

# example sizes for tracing: distinct, so the tracer cannot confuse one symbolic dim with another
_EXAMPLE = {"T": 5, "P": 3, "K": 4, "R": 2, "U": 3, "P+T": 8, "B": 2, "Q": 6, "N": 11, "P+Q": 9}
_TORCH = {"int64": torch.long, "bool": torch.bool, "float32": torch.float32}


def _example(name: str, dtype: str, shape: list, sizes: dict) -> Tensor:
    dims = [sizes.get(d, d) for d in shape]
    if name == "mask":
        return torch.ones(dims, dtype=torch.bool).tril(_EXAMPLE["P"])
    if name == "positions":
        return torch.arange(_EXAMPLE["P"], _EXAMPLE["P"] + dims[0])
    if name == "logits_index":
        return torch.arange(dims[0])
    if dtype == "bool":
        return torch.ones(dims, dtype=torch.bool)
    if dtype == "int64":
        return torch.randint(0, 3, dims)
    return torch.randn(dims)


def _trace(module: nn.Module, io, raw: Path, examples: dict | None = None):
    """torch.onnx.export (TorchScript: robust for this static-shape-free code) -> (ModelProto, io dict)."""
    import warnings

    import onnx

    inputs, outputs = io
    sizes = {**_EXAMPLE, **(examples or {})}
    args = tuple(_example(*i, sizes) for i in inputs)
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
