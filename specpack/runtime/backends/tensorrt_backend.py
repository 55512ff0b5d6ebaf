"""TensorRT backend (NVIDIA GPU): engines built from the artifact's ONNX export, run on CUDA buffers.

    engines/<sm_XX>/<role>-<dtype>.plan   the serialized engine (role: target_step | eagle3_step |
                                          draft_model_step | mtp_step.<layer> | block_context |
                                          block_step)
    engines/<sm_XX>/<role>-<dtype>.json   what it was built for: TensorRT version, GPU, dtype,
                                          optimization profiles, digest of the ONNX graph + weights

An engine is reused only when every field of its sidecar equals what this machine and request
need (`rebuild_reasons`); otherwise it is rebuilt, written into the artifact, added to the manifest
and the artifact re-signed (with `key`; an unsigned artifact stays unsigned). A signed artifact
without a key keeps its files: the engine goes to `$SPECPACK_CACHE/engines/` instead.

Two optimization profiles per graph: `decode` (T up to D+1 verified tokens, tuned for `opt_tokens`)
and `prefill` (T up to `prefill_chunk`; longer prompts run in chunks). Precision: the ONNX graph is
fp32; `float16` / `bfloat16` set the builder flag and keep the KV cache in that dtype, logits fp32.

Written against TensorRT 10's Python API (Builder / OnnxParser / IBuilderConfig / Runtime /
IExecutionContext with set_input_shape, set_tensor_address, execute_async_v3). TensorRT 11 removed
the weak-typing flags (BuilderFlag.FP16/BF16): there only `float32` engines build from this export.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from pathlib import Path
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specpack.errors import ConversionError, InputError, MissingDependencyError, UnsupportedError
from specpack.runtime.backends import GraphEagle3, GraphMtp, GraphTarget, cache_layout, eagle3_files, mtp_files
from specpack.runtime.backends.graph_block import GraphBlock, block_files

log = logging.getLogger(__name__)

NAME = "tensorrt"
ENGINE_DIR = "engines"
DTYPES = ("float16", "bfloat16", "float32")
ALIGN = 256  # bytes: every buffer handed to TensorRT starts on this boundary


def import_tensorrt():
    """The `tensorrt` module, or a MissingDependencyError naming the extra to install."""
    try:
        import tensorrt
    except ImportError:
        raise MissingDependencyError(
            "the TensorRT backend needs the 'tensorrt' Python package, which is not installed",
            hint="pip install 'specpack[tensorrt]' (NVIDIA publishes the TensorRT wheels; if pip "
                 "cannot find them, add NVIDIA's package index with --extra-index-url), on a machine "
                 "with an NVIDIA GPU, its driver and a CUDA build of torch") from None
    return tensorrt


# ---- what an engine was built for: its cache key and sidecar ----

class EngineKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = Field(description="Graph role: target_step, eagle3_step, draft_model_step, mtp_step, block_context "
                                  "or block_step.")
    layer: int | None = Field(None, description="mtp_step: the MTP layer of the graph; else None.")
    tensorrt_version: str = Field(description="TensorRT that built the engine (engines do not move across versions).")
    gpu_name: str = Field(description="GPU model the engine was tuned on.")
    gpu_arch: str = Field(description="Compute capability as sm_XY.")
    dtype: str = Field(description="Builder precision: float16, bfloat16 or float32.")
    profiles: list[dict[str, list[list[int]]]] = Field(
        description="Per optimization profile: input name -> [min, opt, max] shapes.")
    onnx_sha256: str = Field(description="Digest of the ONNX graph file and its external data, from the manifest.")


def rebuild_reasons(found: EngineKey | None, wanted: EngineKey) -> list[str]:
    """Why a cached engine cannot be used (empty: use it)."""
    if found is None:
        return ["no engine built yet"]
    return [f"{name} is {getattr(found, name)!r}, needed {getattr(wanted, name)!r}"
            for name in EngineKey.model_fields if getattr(found, name) != getattr(wanted, name)]


def engine_paths(root: Path, key: EngineKey) -> tuple[Path, Path]:
    """(plan, sidecar) for `key` under `root` (the artifact, or the user cache)."""
    role = key.role if key.layer is None else f"{key.role}.{key.layer}"
    stem = Path(root) / ENGINE_DIR / key.gpu_arch / f"{role}-{key.dtype}"
    return stem.with_name(stem.name + ".plan"), stem.with_name(stem.name + ".json")


def onnx_digest(manifest, graph_path: str, data_path: str) -> str:
    """One digest over the graph file's and its weights' manifest digests (no re-hashing)."""
    digests = {f.path: f.sha256 for f in manifest.files}
    missing = [p for p in (graph_path, data_path) if p not in digests]
    if missing:
        raise InputError("the ONNX export is not listed in the manifest", problems=missing,
                         hint="re-export with `specpack export ARTIFACT --to onnx --force`")
    return hashlib.sha256((digests[graph_path] + digests[data_path]).encode()).hexdigest()


# ---- optimization profiles ----

def profile_ranges(role: str, max_verify: int, opt_tokens: int, prefill_chunk: int,
                   max_context: int, block_len: int | None = None,
                   max_sequences: int = 1) -> list[dict[str, tuple[int, int, int]]]:
    """(min, opt, max) of each symbolic dimension, for the decode and the prefill profile.

    T: new tokens; P: cached slots; K: logits rows; R/U: feature/hidden rows of the head (R+U = T).
    The target (a draft model's too), the EAGLE-3 head and the MTP layers run up to `max_sequences`
    sequences a call (B), each of at most Q rows (D+1 verified tokens; a prefill chunk), over the
    whole cache buffer of N rows (`SharedCaches`: every slot's `max_context`, padded for alignment).
    An MTP layer asks for one row's logits per sequence and, after each verification, runs over the
    few newly committed rows (after the prefill: the whole prompt, in the prefill profile). A block drafter's
    context graph runs over the newly committed rows of every sequence too; its step graph has one
    profile: up to `max_sequences` query blocks of `block_len` rows (a fixed size in the graph)."""
    p_max, p_opt = max_context - 1, max_context // 2
    n_max = max_sequences * (max_context + ALIGN)  # every slot's cache, + the alignment padding of each

    def one(t_max, t_opt, k_opt, r_opt, u_opt):
        return {"T": (1, t_opt, t_max), "P": (0, p_opt, p_max), "P+T": (1, p_opt + t_opt, p_max + t_max),
                "K": (1, k_opt, t_max), "R": (0, r_opt, t_max), "U": (0, u_opt, t_max)}

    def many(b_opt, b_max, q_opt, q_max, t_opt, t_max, k_opt, r_opt=0, u_opt=0):
        return {"T": (1, t_opt, t_max), "B": (1, b_opt, b_max), "Q": (1, q_opt, q_max), "P": (0, p_opt, p_max),
                "P+Q": (1, p_opt + q_opt, p_max + q_max), "N": (1, n_max // 2, n_max), "K": (1, k_opt, t_max),
                "R": (0, r_opt, t_max), "U": (0, u_opt, t_max)}

    opt, S = min(opt_tokens, max_verify), max_sequences
    t_decode = max(max_verify, min(S * max_verify, prefill_chunk))  # calls never exceed a prefill chunk
    prefill = many(1, S, prefill_chunk, prefill_chunk, prefill_chunk, prefill_chunk, 1, r_opt=prefill_chunk)
    if role == "eagle3_step":  # drafting: each sequence's own state (a tree: a level's nodes); after a
        # verification, the features of its newly committed rows; a fresh sequence's prompt in chunks
        return [many(S, S, 1, max_verify, S, t_decode, S, u_opt=S), prefill]
    if role == "mtp_step":  # after a verification, each sequence's newly committed rows; drafting, its
        # own chain state; a fresh sequence's prompt in chunks. One logits row per sequence.
        return [many(S, S, opt, max_verify, min(S * opt, t_decode), t_decode, S), prefill]
    if role == "block_context":  # every sequence's newly committed rows (a prompt: in chunks)
        return [one(t_decode, min(S * opt, t_decode), 1, 0, 0), one(prefill_chunk, prefill_chunk, 1, 0, 0)]
    if role == "block_step":  # every sequence's query block of block_len rows
        return [{"T": (block_len, S * block_len, S * block_len), "B": (1, S, S), "P": (0, p_opt, p_max),
                 "N": (1, n_max // 2, n_max), "K": (1, S * min(opt, block_len), S * block_len)}]
    return [many(S, S, opt, max_verify, min(S * opt, t_decode), t_decode, min(S * opt, t_decode)), prefill]


def profile_shapes(inputs, ranges: dict[str, tuple[int, int, int]]) -> dict[str, list[list[int]]]:
    """input name -> [min, opt, max] shapes, from the graph's symbolic input shapes (TensorInfo)."""
    out = {}
    for t in inputs:
        out[t.name] = [[d if isinstance(d, int) else ranges[d][i] for d in t.shape] for i in range(3)]
    return out


# ---- building (needs TensorRT) and caching (does not) ----

def build_engine(onnx_path: Path, key: EngineKey, io_dtypes: dict[str, str]) -> bytes:
    """Parse the ONNX file (external data beside it), set precision and profiles, serialize."""
    trt = import_tensorrt()
    flag = {"float16": "FP16", "bfloat16": "BF16"}.get(key.dtype)
    if flag and not hasattr(trt.BuilderFlag, flag):
        raise UnsupportedError(
            f"TensorRT {trt.__version__} has no BuilderFlag.{flag}: TensorRT 11 removed weakly typed "
            f"reduced precision, and specpack's export is fp32", hint="use TensorRT 10 (the "
            "'specpack[tensorrt]' extra pins tensorrt<11) or --dtype float32")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise ConversionError(f"TensorRT cannot parse {onnx_path.name}",
                              problems=[str(parser.get_error(i)) for i in range(parser.num_errors)])
    config = builder.create_builder_config()
    if key.dtype in ("float16", "bfloat16"):
        config.set_flag(trt.BuilderFlag.FP16 if key.dtype == "float16" else trt.BuilderFlag.BF16)
    trt_types = {"float16": trt.float16, "bfloat16": trt.bfloat16, "float32": trt.float32}
    tensors = [network.get_input(i) for i in range(network.num_inputs)]
    tensors += [network.get_output(i) for i in range(network.num_outputs)]
    for t in tensors:
        if io_dtypes.get(t.name, "float32") != "float32":  # KV cache in the engine's precision
            t.dtype = trt_types[io_dtypes[t.name]]
    for shapes in key.profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ConversionError(f"TensorRT failed to build an engine from {onnx_path.name}",
                              hint="run with SPECPACK_TRT_VERBOSE=1 to see the builder log")
    return bytes(plan)


def ensure_engine(artifact: Path, key: EngineKey, onnx_path: Path, io_dtypes: dict[str, str],
                  sign_key: Path | None = None, build: Callable[..., bytes] = build_engine) -> Path:
    """The plan file for `key`: reused when its sidecar matches, else built (with `build`) and stored
    in the artifact (manifest updated, re-signed with `sign_key`), or in the user cache when the
    artifact is signed and no key was given."""
    from specpack.packager.update import check_update_options, update_artifact
    from specpack.schemas import SIGNATURE_NAME

    artifact = Path(artifact)
    signed = (artifact / SIGNATURE_NAME).is_file()
    root = artifact if sign_key is not None or not signed else _user_cache(artifact)
    for where in dict.fromkeys([artifact, root]):
        plan, sidecar = engine_paths(where, key)
        found = EngineKey.model_validate_json(sidecar.read_text()) if sidecar.is_file() and plan.is_file() else None
        reasons = rebuild_reasons(found, key)
        if not reasons:
            return plan
    if root == artifact:
        check_update_options(artifact, sign_key, what="storing the engine")  # before minutes of building
    log.info("building the TensorRT engine %s (%s)", plan.name, "; ".join(reasons))
    data = build(onnx_path, key, io_dtypes)
    sidecar_text = key.model_dump_json(indent=2) + "\n"
    plan, sidecar = engine_paths(root, key)
    if root == artifact:  # plan, sidecar, manifest and signature in one transaction
        with update_artifact(artifact, sign_key, what="storing the engine") as update:
            update.stage(plan.relative_to(artifact).as_posix()).write_bytes(data)
            update.stage(sidecar.relative_to(artifact).as_posix()).write_text(sidecar_text)
        return plan
    plan.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(plan, data)
    _write_atomic(sidecar, sidecar_text.encode())
    log.warning("'%s' is signed and no key was given: engine kept in %s, not in the artifact "
                "(pass a signing key to store it signed)", artifact, plan.parent)
    return plan


def _user_cache(artifact: Path) -> Path:
    from specpack.schemas import MANIFEST_NAME

    base = Path(os.environ.get("SPECPACK_CACHE") or Path.home() / ".cache" / "specpack")
    digest = hashlib.sha256((Path(artifact) / MANIFEST_NAME).read_bytes()).hexdigest()[:16]
    return base / "engines" / digest


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ---- running ----

def gpu(device: torch.device) -> tuple[str, str]:
    """(GPU name, sm_XY) of `device`."""
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), f"sm_{major}{minor}"


def _padded(n: int, elem_bytes: int, row: int) -> int:
    """n rounded up so that n * row * elem_bytes is a multiple of ALIGN."""
    unit = ALIGN // math.gcd(ALIGN, row * elem_bytes)
    return -(-n // unit) * unit


class _Engine:
    """A deserialized engine with one execution context per optimization profile."""

    def __init__(self, plan: Path, profiles: list[dict[str, list[list[int]]]], device: torch.device):
        trt = import_tensorrt()
        self.trt, self.device = trt, device
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise ConversionError(f"TensorRT could not load {plan}", hint="delete it to rebuild")
        stream = torch.cuda.current_stream(device).cuda_stream
        self.contexts = []
        for i in range(len(profiles)):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(i, stream)
            self.contexts.append(ctx)
        self.profiles = profiles
        self._dummy = torch.empty(ALIGN, dtype=torch.uint8, device=device)  # address for empty tensors

    def run(self, T: int, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """Queue one call on the current stream, in the first profile whose shapes hold every input.
        Inputs are made contiguous here (chunked calls pass slices of the mask); a copy freed on
        return is safe, as the caching allocator hands its memory only to later work on the same stream."""
        ctx = self.contexts[profile_for(self.profiles, {name: t.shape for name, t in inputs.items()})]
        inputs = {name: t.contiguous() for name, t in inputs.items()}
        for name, t in inputs.items():
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr() if t.numel() else self._dummy.data_ptr())
        for name, t in outputs.items():
            ctx.set_tensor_address(name, t.data_ptr())
        if not ctx.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError("TensorRT execution failed")


def profile_for(profiles: list[dict[str, list[list[int]]]], shapes: dict) -> int:
    """The index of the first optimization profile whose [min, max] shapes hold `shapes`."""
    for i, profile in enumerate(profiles):
        if all(all(lo <= d <= hi for d, lo, hi in zip(shape, profile[name][0], profile[name][2]))
               for name, shape in shapes.items() if name in profile):
            return i
    raise InputError(f"no optimization profile of the engine takes inputs of shapes {dict(shapes)}",
                     hint="rebuild the engines with larger limits (--max-context, --max-sequences)")


def _padded_len(max_len: int, graph, dtype: torch.dtype) -> int:
    """`max_len` padded so that every cache entry of `graph` starts its slots ALIGN-aligned."""
    return _padded(max_len, torch.finfo(dtype).bits // 8, math.prod(cache_layout(graph)[1]))


class _Staging:
    """Where an engine writes its new cache slots: an [entries, T, *slot] buffer with aligned rows,
    then copied into the cache buffer in one indexed copy (`SharedCaches.write`: a slot's offset in
    the buffer itself need not be 256-byte aligned)."""

    def __init__(self, cache, t_max: int):
        entries, _, *slot = cache.store.shape
        T = _padded(t_max, cache.store.element_size(), math.prod(slot))
        self.buf = torch.empty(entries, T, *slot, dtype=cache.store.dtype, device=cache.store.device)

    def outputs(self, T: int) -> list[Tensor]:
        return list(self.buf[:, :T].unbind(0))


def check_sequences(engine: _Engine, slots: int) -> None:
    """Refuse more sequence slots than `engine`'s profiles run together."""
    most = max(p["seq_rows"][2][0] for p in engine.profiles)
    if slots > most:
        raise InputError(f"the TensorRT engine runs at most {most} sequences together, not {slots}",
                         hint=f"rebuild it with max_sequences={slots}, or serve fewer slots")


class TrtTarget(GraphTarget):
    """The target step engine, behaving like `Transformer` for the loop (CUDA tensors throughout)."""

    def __init__(self, engine: _Engine, graph, spec, aux_layer_ids, device, kv_dtype, prefill_chunk: int):
        super().__init__(spec, graph, aux_layer_ids, device, kv_dtype)
        self.engine, self.max_tokens_per_call = engine, prefill_chunk

    def setup_cache(self, max_len: int, slots: int = 1) -> None:
        check_sequences(self.engine, slots)
        super().setup_cache(_padded_len(max_len, self.graph, self.dtype), slots)
        self.new_buffer = _Staging(self.caches[0], self.max_tokens_per_call).buf  # each entry's rows aligned

    def _run(self, T, inputs, outputs):
        self.engine.run(T, inputs, outputs)


class TrtEagle3(GraphEagle3):
    """The EAGLE-3 step engine, drafting exactly as `Eagle3Drafter`."""

    def __init__(self, engine: _Engine, graph, spec, d2t, device, kv_dtype, prefill_chunk: int):
        super().__init__(spec, graph, d2t, device, kv_dtype)
        self.engine, self.max_tokens_per_call = engine, prefill_chunk

    def reserve(self, slots: int, max_len: int) -> None:
        check_sequences(self.engine, slots)
        super().reserve(slots, _padded_len(max_len, self.graph, self.dtype))
        self.new_buffer = _Staging(self.caches[0], self.max_tokens_per_call).buf

    def _run(self, T, inputs, outputs):
        self.engine.run(T, inputs, outputs)


class TrtMtp(GraphMtp):
    """The MTP step engines, one per layer, drafting exactly as `MtpDrafter`."""

    def __init__(self, engines: list[_Engine], graphs, spec, target: TrtTarget, device, kv_dtype,
                 prefill_chunk: int):
        super().__init__(spec, target, graphs, device, kv_dtype, [e.run for e in engines])
        self.engines = engines
        for layer in self.layers:
            layer.max_tokens_per_call = prefill_chunk

    def reserve(self, slots: int, max_len: int) -> None:
        for engine in self.engines:
            check_sequences(engine, slots)
        super().reserve(slots, max(_padded_len(max_len, g, self.dtype) for g in self.graphs))
        for layer in self.layers:  # each layer's new rows staged aligned
            layer.new_buffer = _Staging(layer.caches[0], layer.max_tokens_per_call).buf


class TrtBlock(GraphBlock):
    """The block drafter's context and step engines, drafting exactly as `BlockDrafter`."""

    def __init__(self, engines: tuple[_Engine, _Engine], graphs: tuple, spec, heads, device, kv_dtype,
                 prefill_chunk: int):
        super().__init__(spec, heads, *graphs, device, kv_dtype)
        (self.context_engine, self.step_engine), self.max_tokens_per_call = engines, prefill_chunk
        self.staging: _Staging | None = None

    def reserve(self, slots: int, max_len: int) -> None:
        check_sequences(self.step_engine, slots)
        super().reserve(slots, _padded_len(max_len, self.step_graph, self.dtype))
        self.staging = _Staging(self.caches[0], self.max_tokens_per_call)

    def _run_context(self, feats, positions, dest):
        T = feats.shape[0]
        out = torch.empty(T, self.spec.hidden_size, device=self.device)
        self.context_engine.run(T, {"feats": feats.float(), "positions": positions},
                                {"context": out, **dict(zip(self.new_names, self.staging.outputs(T)))})
        self.shared.write(self.staging.buf[:, :T], dest)
        return out

    def _run_step(self, inputs, K):
        outputs = self._step_outputs(inputs["tokens"].shape[0], K)
        self.step_engine.run(inputs["tokens"].shape[0], self._step_inputs(inputs), outputs)
        return outputs


def load(artifact, manifest, device: str = "cuda", dtype: str = "float16", key: Path | None = None,
         max_context: int | None = None, opt_tokens: int = 8, prefill_chunk: int = 256, max_sequences: int = 16):
    """(target, drafter) running TensorRT engines of the verified `artifact` on `device`.

    Engines are built on first use (minutes for a large model) and cached as described above.
    `max_context` bounds the KV length the engines accept (default: the target's context),
    `max_sequences` the sequences the target engine runs together (the engine's slots)."""
    from specpack.runtime.backends.onnxruntime_backend import require_export
    from specpack.runtime.spec_model import load_drafter
    from specpack.runtime.models.weights import target_spec

    import_tensorrt()
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise InputError(f"the tensorrt backend needs a CUDA device, not '{device}'",
                         hint="run on an NVIDIA GPU with a CUDA build of torch (--device cuda)")
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype '{dtype}' for tensorrt", hint="use " + ", ".join(DTYPES))
    artifact = Path(artifact)
    index = require_export(artifact, manifest)
    spec = target_spec(artifact)
    max_context = min(max_context or spec.context_length, spec.context_length)
    kv_dtype = getattr(torch, dtype)

    def engine_for(graph) -> _Engine:
        block_len = graph.inputs[3].shape[1] if graph.role == "block_step" else None  # seq_rows [B, block_len]
        ranges = profile_ranges(graph.role, index.max_verify_tokens, opt_tokens, prefill_chunk, max_context, block_len,
                                max_sequences)
        name, arch = gpu(dev)
        trt = import_tensorrt()
        wanted = EngineKey(role=graph.role, layer=graph.layer, tensorrt_version=trt.__version__, gpu_name=name,
                           gpu_arch=arch, dtype=dtype, profiles=[profile_shapes(graph.inputs, r) for r in ranges],
                           onnx_sha256=onnx_digest(manifest, graph.path, index.data_file))
        io = {t.name: dtype for t in graph.inputs + graph.outputs if t.name.startswith(("past_", "new_"))}
        plan = ensure_engine(artifact, wanted, artifact / graph.path, io, sign_key=key)
        return _Engine(plan, wanted.profiles, dev)

    graph = index.graph("target_step")
    target = TrtTarget(engine_for(graph), graph, spec, index.aux_layer_ids, dev, kv_dtype, prefill_chunk)
    kind = manifest.drafter.kind
    if kind == "eagle3":
        head_spec, d2t = eagle3_files(artifact)
        graph = index.graph("eagle3_step")
        return target, TrtEagle3(engine_for(graph), graph, head_spec, d2t, dev, kv_dtype, prefill_chunk)
    if kind == "draft_model":
        from specpack.runtime.drafters.draft_model import DraftModelDrafter

        graph = index.graph("draft_model_step")
        draft = TrtTarget(engine_for(graph), graph, target_spec(artifact / "drafter"), None, dev, kv_dtype,
                          prefill_chunk)
        return target, DraftModelDrafter(draft, spec.vocab_size)
    if kind == "mtp":
        graphs = index.graphs_of("mtp_step")
        return target, TrtMtp([engine_for(g) for g in graphs], graphs, mtp_files(artifact), target, dev, kv_dtype,
                              prefill_chunk)
    if kind == "block":
        graphs = index.graph("block_context"), index.graph("block_step")
        return target, TrtBlock(tuple(engine_for(g) for g in graphs), graphs, *block_files(artifact / "drafter"), dev,
                                kv_dtype, prefill_chunk)
    return target, load_drafter(kind, manifest.drafter.model_dump(exclude={"kind"}), None, None)


def build_engines(artifact, key: Path | None = None, public_key: Path | None = None, device: str = "cuda",
                  dtype: str = "float16", **options) -> list[Path]:
    """`specpack export ARTIFACT --to tensorrt`: build (or reuse) this GPU's engines for the artifact's
    ONNX export, store them under engines/<sm_XX>/, add them to the manifest and re-sign with `key`."""
    from specpack.packager import verify
    from specpack.packager.signing import check_signing_key
    from specpack.packager.update import recover
    from specpack.schemas import SIGNATURE_NAME

    artifact = Path(artifact)
    if key is not None:
        check_signing_key(key)
    recover(artifact)
    manifest = verify(artifact, public_key).manifest
    if (artifact / SIGNATURE_NAME).is_file() and key is None:
        raise InputError(f"'{artifact}' is signed: storing engines in it needs the signing key",
                         hint="pass --key KEY.pem (without it, `run --backend tensorrt` caches engines "
                              "outside the artifact)")
    load(artifact, manifest, device, dtype, key=key, **options)
    return sorted(p for p in (artifact / ENGINE_DIR).rglob("*") if p.is_file())
