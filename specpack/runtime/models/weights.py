"""Load safetensors checkpoints (single file or sharded) by memory-mapping them, and check every tensor.

Only fused matrices (q/k/v, gate/up) and dtype or device changes make copies; everything else stays
a view of the mapped file until used. Where the CPU kernels will run the model, each decoder layer's linear
layers are packed as the layer is read and its pages of the mapping are handed back (`Checkpoint.release`):
loading holds the packed weights plus one layer, never the file and the packed copy side by side.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from pathlib import Path

import torch
from torch import Tensor

from specpack.errors import InputError
from specpack.families.dense import DEEPSEEK_ARCHITECTURES, load_target_spec, target_tensor_shapes
from specpack.families.checks import checked_tensor_shapes, shape_problems

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (from the index when sharded)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        weight_map = json.loads((model_dir / INDEX).read_text()).get("weight_map", {})
        files = _shard_paths(model_dir, weight_map)
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise InputError(f"{model_dir / INDEX} names shard files that are missing", problems=missing,
                             hint="download the complete checkpoint")
        return files
    if (model_dir / SINGLE).is_file():
        with safe_open(model_dir / SINGLE, framework="pt") as f:
            return {name: model_dir / SINGLE for name in f.keys()}
    hint = ("convert pytorch_model.bin to safetensors first" if (model_dir / "pytorch_model.bin").exists()
            else "expected model.safetensors or model.safetensors.index.json")
    raise InputError(f"no safetensors checkpoint in {model_dir}", hint=hint)


def _shard_paths(model_dir: Path, weight_map: dict) -> dict[str, Path]:
    """tensor name -> shard path; every shard inside `model_dir` (no `..`, absolute path or link
    out of it), or one InputError naming each that is not."""
    from specpack._paths import check_relpath

    inside, files, problems = model_dir.resolve(), {}, set()
    for name, rel in weight_map.items():
        try:
            path = model_dir / check_relpath(rel if isinstance(rel, str) else "", f"{model_dir / INDEX}")
        except InputError:
            problems.add(f"{rel!r} is not a path inside {model_dir}")
            continue
        if not path.resolve().is_relative_to(inside):
            problems.add(f"'{rel}' leads outside {model_dir} (through a link)")
        files[name] = path
    if problems:
        raise InputError(f"{model_dir / INDEX} names weight files outside the model", problems=sorted(problems),
                         hint="never load it: a checkpoint must only name files inside its own folder")
    return files


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Shapes from the safetensors headers, without reading any data."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if files.get(k) == path})
    return shapes


def check_shapes(found: dict[str, tuple], expected: dict[str, tuple], what: str) -> None:
    """Raise one InputError naming every missing tensor and every shape mismatch."""
    problems = shape_problems(found, expected)
    if problems:
        raise InputError(f"{what} does not match its config ({len(problems)} problems)", problems=problems,
                         hint="the checkpoint and config.json must come from the same model")


class Checkpoint:
    """A checkpoint's safetensors files, each mapped once, copy-on-write and never written: `read(names)` gives
    views of the mappings (a page is read from the file when first touched), `release(tensors)` hands their
    pages back to the kernel once a packed copy exists. A released page that is touched again is read from the
    file again: nothing is lost, only the memory while it is not used."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._maps: dict[Path, tuple] = {}  # path -> (mmap, its address, data start, header)

    def _mapped(self, path: Path) -> tuple:
        if path not in self._maps:
            from specpack.converters.safetensors_header import read_header

            header = read_header(path)  # checked: every tensor inside the file
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            start = 8 + struct.unpack("<Q", mm[:8])[0]  # the data after the header
            self._maps[path] = (mm, torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr(), start, header)
        return self._maps[path]

    def tensor(self, name: str) -> Tensor:
        from specpack.converters.safetensors_header import TORCH_NAMES

        path = self.files[name]
        mm, _, start, header = self._mapped(path)
        meta = header[name]
        dtype = getattr(torch, TORCH_NAMES.get(meta.dtype, ""), None)
        if not isinstance(dtype, torch.dtype):
            raise InputError(f"{name} in {path} is stored as {meta.dtype}, which specpack's runtime does not read",
                             hint="store the checkpoint's tensors as F32, F16, BF16 or U8")
        if meta.numel == 0:
            return torch.empty(meta.shape, dtype=dtype)
        offset = start + meta.start
        if offset % dtype.itemsize:  # a misaligned tensor (no writer makes one): a copy of its own
            return torch.frombuffer(mm, dtype=torch.uint8, count=meta.end - meta.start, offset=offset).clone() \
                .view(dtype).view(meta.shape)
        return torch.frombuffer(mm, dtype=dtype, count=meta.numel, offset=offset).view(meta.shape)

    def read(self, names, blocks: dict[str, tuple[str, int]] | None = None) -> dict:
        """The named tensors as views of the mappings; those in `blocks` (name -> (GGML type, columns)) as
        kernels.gguf.Blocks over their mapped bytes."""
        from specpack.runtime.kernels.gguf import Blocks

        blocks = blocks or {}
        return {n: Blocks.of(blocks[n][0], self.tensor(n), blocks[n][1]) if n in blocks else self.tensor(n)
                for n in names}

    def release(self, tensors) -> None:
        """Hand back the pages of each tensor (or Blocks) that is a view of a mapping here; others are left."""
        from specpack.runtime.kernels.gguf import Blocks

        for t in tensors:
            for raw in [r for _, r in t.parts] if isinstance(t, Blocks) else [t]:
                if isinstance(raw, Tensor) and raw.is_contiguous() and raw.numel():
                    self._release(raw.data_ptr(), raw.numel() * raw.element_size())

    def _release(self, address: int, size: int) -> None:
        found = self._find(address, size)
        if found and hasattr(mmap, "MADV_DONTNEED"):  # (no such advice on Windows: the pages stay until unmapped)
            mm, offset = self._maps[found[0]][0], found[1]
            start = offset - offset % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, start, offset + size - start)

    def _find(self, address: int, size: int) -> tuple[Path, int] | None:
        """(file, byte offset) of `size` bytes at `address` inside a mapping here, else None."""
        for path, (mm, base, _, _) in self._maps.items():
            offset = address - base
            if 0 <= offset and offset + size <= len(mm):
                return path, offset
        return None

    def embedding(self, table: Tensor) -> "FileEmbedding | None":
        """A FileEmbedding over `table` where it is a float32 view of a mapping here, else None."""
        found = table.dtype == torch.float32 and table.is_contiguous() and table.dim() == 2 and \
            self._find(table.data_ptr(), table.numel() * 4)
        return FileEmbedding(*found, table) if found else None


class FileEmbedding(torch.nn.Module):
    """An fp32 embedding table left in its checkpoint file: a lookup reads its rows with pread (the page cache's
    memory, not this process's: a fault on the mapping would bring in the page cache's whole folio, up to 2 MiB
    a row). `weight` is the table as a view of the mapped file, for the kernels that read it whole."""

    def __init__(self, path: Path, offset: int, table: Tensor):
        super().__init__()
        self.file, self.offset, self.table = open(path, "rb", buffering=0), offset, table
        self.num_embeddings, self.embedding_dim = table.shape
        self.row_bytes = self.embedding_dim * 4

    @property
    def weight(self) -> Tensor:
        return self.table

    @property
    def pread_source(self) -> tuple[int, int]:
        """(file descriptor, byte offset of row 0): where the kernels read rows with pread too (kernels/layers.py)."""
        return self.file.fileno(), self.offset

    def forward(self, ids: Tensor) -> Tensor:
        rows, size = ids.reshape(-1).tolist(), self.row_bytes
        out = torch.empty(len(rows), self.embedding_dim)
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
        for i, row in enumerate(rows):
            if not 0 <= row < self.num_embeddings:
                raise IndexError(f"index {row} is out of range for {self.num_embeddings} embeddings")
            if os.preadv(self.file.fileno(), [buffer[i * size: (i + 1) * size]], self.offset + row * size) != size:
                raise OSError(f"{self.file.name} ended inside embedding row {row}: the file changed after loading")
        return out.view(*ids.shape, self.embedding_dim)


def read_tensors(files: dict[str, Path], names, blocks: dict[str, tuple[str, int]] | None = None) -> dict[str, Tensor]:
    """The named tensors, views of the memory-mapped files (nothing copied); those in `blocks` (name -> (GGML
    type, columns)) as kernels.gguf.Blocks over their mapped bytes."""
    return Checkpoint(files).read(names, blocks)


def gguf_types(model_dir) -> dict[str, str]:
    """tensor name -> GGML type of the tensors a checkpoint keeps as GGUF blocks (import-gguf), {} for none."""
    try:
        qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(qc, dict) or qc.get("quant_method") != "gguf":
        return {}
    from specpack.families.quant import scheme

    return dict(scheme({"quantization_config": qc}).layers)


def _block_shapes(found: dict[str, tuple], types: dict[str, str]) -> tuple[dict, dict]:
    """(the shapes with every GGUF block tensor's logical one, name -> (type, columns) of those tensors)."""
    from specpack.families.gguf_blocks import columns

    shapes, blocks = dict(found), {}
    for name, kind in types.items():
        if name in found and len(found[name]) == 2:
            cols = columns(kind, found[name][1])
            shapes[name], blocks[name] = (found[name][0], cols), (kind, cols)
    return shapes, blocks


def fuse_layer(t: dict[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
    """One decoder layer's tensors `src*` (transformers names) as our fused `dst*` parameters."""
    from specpack.runtime.kernels.gguf import cat

    out = {}
    for kind in ("weight", "bias"):
        qkv = [t.get(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv"]
        if qkv[0] is not None:
            out[f"{dst}self_attn.qkv_proj.{kind}"] = cat(qkv)
    if f"{src}mlp.gate.weight" in t:  # Qwen3-MoE: the router, and each expert's gate and up fused
        out[f"{dst}mlp.gate.weight"] = t[f"{src}mlp.gate.weight"]
        for e in range(t[f"{src}mlp.gate.weight"].shape[0]):
            p, q = f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.{e}."
            out[q + "gate_up_proj.weight"] = cat([t[p + "gate_proj.weight"], t[p + "up_proj.weight"]])
            out[q + "down_proj.weight"] = t[p + "down_proj.weight"]
    else:
        out[f"{dst}mlp.gate_up_proj.weight"] = cat([t[f"{src}mlp.gate_proj.weight"], t[f"{src}mlp.up_proj.weight"]])
    plain = ["self_attn.o_proj.weight", "self_attn.o_proj.bias", "self_attn.q_norm.weight",
             "self_attn.k_norm.weight", "mlp.down_proj.weight", "input_layernorm.weight",
             "post_attention_layernorm.weight", "hidden_norm.weight"]
    out.update({dst + name: t[src + name] for name in plain if src + name in t})
    return out


def assign_weights(model: torch.nn.Module, state: dict[str, Tensor], device, dtype) -> torch.nn.Module:
    """Move each tensor to device/dtype (no copy when they already match) and assign it in place of
    the module's meta parameters; integer/bool buffers keep their dtype."""
    moved = {}  # by id, so a tied embedding/lm_head stays one tensor on the device
    for v in state.values():
        if id(v) not in moved:
            moved[id(v)] = v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
    state = {k: moved[id(v)] for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def architecture(model_dir) -> str | None:
    """config.json's first `architectures` entry, or None when there is none (or no readable config)."""
    try:
        return (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError):
        return None  # load_target_spec reports what is wrong with the config


def target_spec(model_dir):
    """The spec `load_target` builds its model from (`DeepseekSpec` or `TargetSpec`), reading no weights."""
    if architecture(model_dir) in DEEPSEEK_ARCHITECTURES:
        from specpack.families.deepseek import load_deepseek_spec

        return load_deepseek_spec(model_dir)
    return load_target_spec(model_dir)


def load_target(model_dir, device="cpu", dtype=torch.float32, weights: str | None = None):
    """Build our decoder from a transformers model directory (config.json + safetensors): a
    `DeepseekTransformer` for DeepSeek-V3-style architectures, else our `Transformer`. `weights`: the format the
    CPU kernels will keep a dense decoder's linear layers in (fp32, fp16, bf16, int8, w8a8), packed as each layer is
    read (`pack_at_load`); None leaves them nn.Linear over the mapped file (`use_cpu_kernels` may pack them later,
    with the file and the packed copy both resident meanwhile)."""
    from specpack.runtime.models.dense import Transformer
    from specpack.runtime.models.moe import keep_routers_fp32

    if architecture(model_dir) in DEEPSEEK_ARCHITECTURES:
        return load_deepseek(model_dir, device, dtype)
    spec = load_target_spec(model_dir)
    return keep_routers_fp32(build_decoder(model_dir, spec, target_tensor_shapes, fuse_layer, Transformer, device,
                                           dtype, weights))


def load_deepseek(model_dir, device="cpu", dtype=torch.float32):
    """Build a `DeepseekTransformer` from a transformers model directory (config.json + safetensors)."""
    from specpack.families import deepseek as family
    from specpack.runtime.models.deepseek import DeepseekTransformer, layer_state
    from specpack.runtime.models.moe import keep_routers_fp32

    spec = family.load_deepseek_spec(model_dir)
    return keep_routers_fp32(build_decoder(model_dir, spec, family.target_tensor_shapes, layer_state,
                                           DeepseekTransformer, device, dtype))


# where a checkpoint keeps its decoder and head: causal LMs; multimodal wrappers as published
# (Mistral 3, Kimi-K2.5: `language_model.model.`), and as transformers v5 re-saves them
DECODER_NAMES = (("model.", "lm_head.weight"), ("language_model.model.", "language_model.lm_head.weight"),
                 ("model.language_model.", "lm_head.weight"))


def decoder_names(files) -> tuple[str, str]:
    """(decoder prefix, head tensor) of a checkpoint: the first of DECODER_NAMES whose embedding it
    holds (else a causal LM's, whose missing tensors the shape check then lists); a wrapper's head
    may also sit at the top (`lm_head.weight`, as transformers saves Mistral 3)."""
    prefix, head = next(((p, h) for p, h in DECODER_NAMES if p + "embed_tokens.weight" in files), DECODER_NAMES[0])
    return prefix, head if head in files or "lm_head.weight" not in files else "lm_head.weight"


def _named(shapes: dict, prefix: str, head: str) -> dict:
    """A causal LM's tensor names (`model.*`, `lm_head.weight`) at the checkpoint's own places."""
    return {(head if n == "lm_head.weight" else prefix + n[len("model."):] if n.startswith("model.") else n): v
            for n, v in shapes.items()}


def build_decoder(model_dir, spec, shapes, layer_state, decoder_cls, device, dtype, weights: str | None = None
                  ) -> torch.nn.Module:
    """Check a checkpoint's tensors against `shapes(spec)`, map them into `decoder_cls(spec)`'s names
    (`layer_state` per layer) and assign them: the loading every target family shares. GGUF blocks are packed as
    each layer is read, and so are float linear layers where `weights` says the CPU kernels will run them
    (`pack_at_load`); each layer's pages of the mapped file are handed back once it is packed."""
    files = checkpoint_files(Path(model_dir))
    prefix, head = decoder_names(files)
    found, blocks = _block_shapes(tensor_shapes(files), gguf_types(model_dir))
    expected = checked_tensor_shapes(spec, found, lambda s: _named(shapes(s), prefix, head),
                                     f"target checkpoint {model_dir}")
    unused = sorted(set(files) - set(expected) - {head})
    if unused:
        log.info("ignoring %d tensors not used by %s: %s", len(unused), decoder_cls.__name__, unused[:5])
    if blocks and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise InputError(f"this target keeps GGUF blocks (import-gguf), which run on the CPU in float32, not "
                         f"{device} {str(dtype).removeprefix('torch.')}",
                         hint="use --device cpu --dtype float32, or import the GGUF with --dequantize")
    checkpoint = Checkpoint(files)
    t = checkpoint.read(expected, blocks)
    with torch.device("meta"):
        model = decoder_cls(spec)
    packer = _Packer(model, weights if pack_at_load(device, dtype, weights) else None, checkpoint)
    state = {}
    for i in range(spec.num_layers):
        src = f"{prefix}layers.{i}."
        state.update(packer.bind(layer_state(t, src, f"layers.{i}.")))
        if packer.packed:
            checkpoint.release(v for k, v in t.items() if k.startswith(src))
    state.update(packer.bind({"embed_tokens.weight": t[prefix + "embed_tokens.weight"],
                              "norm.weight": t[prefix + "norm.weight"],
                              "lm_head.weight": t[prefix + "embed_tokens.weight" if spec.tie_word_embeddings else head]}))
    if packer.packed:  # the vectors left (norms) in memory of their own, so nothing faults the file in again
        state = {k: v.clone() if isinstance(v, Tensor) and v.dim() == 1 else v for k, v in state.items()}
        checkpoint.release(t.values())
        trim_heap()  # packing's freed temporaries, before the next phase allocates past them
    packer.done()
    return assign_weights(model, state, device, dtype)


def pack_at_load(device, dtype, weights: str | None) -> bool:
    """Whether float linear layers are packed as the checkpoint is read: `weights` given (the format the CPU
    kernels keep them in, as `use_cpu_kernels` would), a float32 model on the CPU, and the kernels there
    (or `weights` other than fp32: their torch fallback keeps that format's values too)."""
    from specpack.runtime.kernels import available

    return (weights is not None and torch.device(device).type == "cpu" and dtype == torch.float32
            and (weights != "fp32" or available()))


class _Packer:
    """Replaces `model`'s linear layers by packed ones as their weights are read (`bind`): GGUF blocks always
    (kernels/gguf.py), float weights when `weights` is given (accelerate.packed_linear); an embedding table of
    blocks by a BlockEmbedding (a lookup dequantizes its rows), an fp32 one (with `weights`) by a FileEmbedding
    (a lookup reads its rows from the file)."""

    def __init__(self, model: torch.nn.Module, weights: str | None, checkpoint: Checkpoint):
        self.model, self.weights, self.checkpoint = model, weights, checkpoint
        self.packed, self.widened, self.modules = 0, set(), []

    def bind(self, state: dict) -> dict:
        """`state` less the weights (and biases) of the layers it packed."""
        from specpack.runtime.kernels.gguf import Blocks

        state = dict(state)
        for name, value in list(state.items()):
            if not name.endswith(".weight"):
                continue
            module_name = name.removesuffix(".weight")
            module = self.model.get_submodule(module_name)
            if isinstance(value, Blocks):
                replacement = self._blocks(name, module, value, state)
            elif self.weights and isinstance(module, torch.nn.Embedding):
                replacement = self.checkpoint.embedding(value)
                if replacement is None:  # not fp32 in the file: assign_weights converts it
                    continue
            elif self.weights and isinstance(module, torch.nn.Linear) and value.is_floating_point():
                from specpack.runtime.kernels.accelerate import HEAD, packed_linear

                bias = state.pop(module_name + ".bias", None)
                replacement = packed_linear(value.float(), None if bias is None else bias.float(), self.weights,
                                            head=module_name == HEAD, release=self._release)
            else:
                continue
            del state[name]
            parent, _, leaf = module_name.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, leaf, replacement)
            self.packed += 1
            self.modules.append(replacement)
        return state

    def _release(self, rows: Tensor) -> None:
        self.checkpoint.release([rows])

    def _blocks(self, name: str, module, value, state: dict):
        from specpack.runtime.kernels.accelerate import PackedLinearModule
        from specpack.runtime.kernels.gguf import BlockEmbedding

        if isinstance(module, torch.nn.Linear):
            if value.format is None:
                self.widened.add(" + ".join(dict.fromkeys(value.kinds)))
            return PackedLinearModule.of_blocks(value, state.pop(name.removesuffix(".weight") + ".bias", None))
        if isinstance(module, torch.nn.Embedding) and len(value.parts) == 1:
            return BlockEmbedding(value)
        raise InputError(f"{name} is stored as GGUF blocks, which {type(module).__name__} does not read",
                         hint="import the GGUF with --dequantize")

    def done(self) -> None:
        """Say what loading packed."""
        from specpack.runtime.kernels.accelerate import say_narrowed
        from specpack.runtime.kernels.gguf import NATIVE

        if self.widened:
            log.warning("%s layers run widened to fp32 (kernels read %s blocks as they are, one kind of kernel a "
                        "layer): more memory and time than the file's size suggests", ", ".join(sorted(self.widened)),
                        ", ".join(NATIVE))
        if self.weights:
            say_narrowed(self.modules, self.weights)


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc keeps what packing's temporaries freed: 240 MiB after
    SmolLM2 fp32 before loading packed as it read); nothing where the C library has no malloc_trim."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
