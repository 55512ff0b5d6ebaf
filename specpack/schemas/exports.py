"""Graphs and engines derived from an artifact and stored in it (`exports/`, `engines/`)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

ONNX_DIR = "exports/onnx"  # where `export --to onnx` stores its files, with their index:
ONNX_INDEX_NAME = "index.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorInfo(_Strict):
    name: str = Field(description="Graph input or output name.")
    dtype: Literal["int64", "bool", "float32", "float16", "bfloat16"] = Field(description="Element type.")
    shape: list[Union[int, str]] = Field(description="Dimensions: a number, or a symbol (T, P, K, R, U).")


class OnnxGraph(_Strict):
    role: Literal["target_step", "eagle3_step", "draft_model_step", "mtp_step", "block_context", "block_step"] = Field(
        description="What the graph computes (exports/onnx); a draft model's graph is a target_step "
                    "graph; mtp_step: one graph per MTP layer; block_context / block_step: a block drafter's "
                    "context K/V of new committed positions, and its query block over them.")
    path: str = Field(description="The .onnx file, relative to the artifact.")
    inputs: list[TensorInfo] = Field(description="Inputs in order.")
    outputs: list[TensorInfo] = Field(description="Outputs in order.")
    num_layers: int = Field(ge=1, description="Layers with a cache: past_key.{i}/past_value.{i} (or "
                                              "past_latent.{i} for MLA) for i below this; no .{i} when 1.")
    layer: Optional[int] = Field(None, ge=0, description="mtp_step: the MTP layer the graph runs; else None.")


class OnnxExport(_Strict):
    format: Literal["onnx"] = "onnx"
    opset: int = Field(description="ONNX opset of every graph.")
    dtype: Literal["float32"] = Field("float32", description="Weights, activations and KV cache dtype.")
    data_file: str = Field(description="External data file holding every weight of every graph.")
    kv_layout: Literal["slot_major_new_slots"] = Field(
        "slot_major_new_slots", description="The cache per layer is [slots, kv_heads, head_dim] for keys and "
        "values, or [slots, kv_lora_rank + rope_dim] for MLA's latent; graphs return only the T new slots, "
        "which the runtime writes into its cache. A drafter graph reads its sequence's P cached slots; the "
        "target graph reads the whole buffer of every sequence [N, ...] and gathers each one's rows "
        "(inputs seq_rows, row_place, cache_rows, mask [B, Q, P+Q]).")
    max_verify_tokens: int = Field(description="D+1 for the longest draft the runtime asks for (T's "
                                   "intended range when verifying; prefills may be longer).")
    aux_layer_ids: Optional[list[int]] = Field(
        None, description="Target layers whose input hidden states `aux` concatenates (input-of-layer "
                          "convention); None when the drafter needs none.")
    target_hidden: Optional[Literal["final_norm_output", "last_layer_output"]] = Field(
        None, description="What the target graph's `hidden` output holds (the state an MTP drafter's first "
                          "layer reads); None when it has no such output.")
    drafter_kind: str = Field(description="The manifest's drafter kind the graphs were exported for.")
    exporter: str = Field(description="The exporter and its version.")
    graphs: list[OnnxGraph] = Field(description="The graphs.")

    def graph(self, role: str) -> OnnxGraph | None:
        return next((g for g in self.graphs if g.role == role), None)

    def graphs_of(self, role: str) -> list[OnnxGraph]:
        """Every graph of `role`, by layer (mtp_step)."""
        return sorted((g for g in self.graphs if g.role == role), key=lambda g: g.layer or 0)


class TensorrtEngine(_Strict):
    path: str = Field(description="engines/<sm_XX>/<role>[.<layer>]-<dtype>.plan, relative to the artifact.")
    role: Literal["target_step", "eagle3_step", "draft_model_step", "mtp_step", "block_context", "block_step"] = Field(
        description="Graph it was built from.")
    layer: Optional[int] = Field(None, ge=0, description="mtp_step: the MTP layer; else None.")
    tensorrt_version: str = Field(description="TensorRT version that built it.")
    gpu_name: str = Field(description="GPU it was built on.")
    gpu_arch: str = Field(description="Compute capability, sm_XY.")
    dtype: Literal["float16", "bfloat16", "float32"] = Field(description="Engine precision.")
    profiles: list[dict[str, list[list[int]]]] = Field(description="input -> [min, opt, max] shapes per profile.")
    onnx_sha256: str = Field(description="Digest over the graph's and weights' manifest digests.")


class Exports(_Strict):
    onnx: Optional[OnnxExport] = Field(None, description="The ONNX graphs under exports/onnx/.")
    tensorrt: list[TensorrtEngine] = Field(default_factory=list, description="TensorRT engines under engines/.")
