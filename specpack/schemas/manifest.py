"""The artifact manifest (`specpack.json`), format v1: the single source of truth.

`manifest.v1.json` beside this file is generated from these models (`python -m specpack.schemas`)
and checked in; a test fails when the two drift.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from specpack._version import FORMAT_NAME, FORMAT_VERSION
from specpack.schemas.exports import Exports
from specpack.schemas.profile import Profile

MANIFEST_NAME = "specpack.json"
SIGNATURE_NAME = "model.sig"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    path: str = Field(description="Relative POSIX path inside the artifact (no '..', no links).")
    size: int = Field(ge=0, description="Size in bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the file's bytes, hex.")


class Source(_Strict):
    kind: Literal["path", "hub"] = Field(description="Where the input came from.")
    path: Optional[str] = Field(
        None, description="Name of the local folder the input was read from, without its location (older "
                          "artifacts may hold the path as given).")
    repo_id: Optional[str] = Field(None, description="Hugging Face repo id, when pulled from the hub.")
    revision: Optional[str] = Field(None, description="Hub revision (commit) of the input.")
    subfolder: Optional[str] = Field(None, description="A drafter the release ships in a subfolder of the target "
                                                       "(`dspark/`): that folder. Its files are not carried among "
                                                       "the target's; the canonical drafter holds their tensors.")
    files_sha256: Optional[dict[str, str]] = Field(None, description="With `subfolder`: SHA-256 of each file it "
                                                                     "held, as the release published it.")

    @classmethod
    def local(cls, path) -> "Source":
        """A local folder, by its name only (`./models/llama/` -> `llama`)."""
        return cls(kind="path", path=Path(os.path.abspath(path)).name)


class RemoteCode(_Strict):
    allowed: bool = Field(description="The build was told to carry the target's own code "
                                      "(`--allow-remote-code`); without it such a target is refused.")
    files: list[str] = Field(description="The target's code files (`.py`), carried and digested like any "
                                         "other file. specpack never runs them; engines may.")
    reasons: list[str] = Field(description="What names or ships code: `auto_map` entries, `.py` files, "
                                           "tokenizer classes transformers does not have.")


class TargetExperts(_Strict):
    routed: int = Field(ge=0, description="Routed experts per MoE layer.")
    active: int = Field(ge=0, description="Routed experts each token passes through (num_experts_per_tok).")
    size: int = Field(ge=0, description="Width of one routed expert's MLP.")
    shared: int = Field(0, ge=0, description="Always-on shared experts per MoE layer.")
    shared_size: int = Field(0, ge=0, description="Width of the shared experts together.")
    layout: Literal["per_expert", "fused"] = Field(
        description="`per_expert`: one MLP each (`experts.{e}.gate_proj`); `fused`: 3-D tensors (`experts.gate_up_proj`).")


class TargetMtp(_Strict):
    layout: Literal["mtp-deepseek", "mtp-qwen3-next", "mtp-mimo", "mtp-nemotron-h"] = Field(
        description="Where and how the MTP modules are named (family.Mtp).")
    count_key: str = Field(description="The config key that states how many there are.")
    stated: int = Field(ge=0, description="Modules the config states (0: it states none; the checkpoint's count holds).")
    held: int = Field(ge=0, description="Modules whose tensors the checkpoint holds (0: a re-upload dropped them).")


class TargetQuantization(_Strict):
    scheme: Literal["fp8-block", "fp8", "ct-fp8", "ct-nvfp4", "ct-int4", "modelopt-nvfp4", "modelopt-fp8",
                    "modelopt-mixed", "mxfp4", "mxfp8", "gguf"] = Field(description="How quantized linear weights are stored (families/quant.py).")
    quant_method: str = Field(description="config.json `quantization_config.quant_method` (modelopt: or hf_quant_config.json).")
    block: Optional[list[int]] = Field(None, description="FP8 weight block [rows, cols], for block-scaled schemes.")
    group: int = Field(0, ge=0, description="Group size of FP4 / INT4 scales (0: none).")
    kv_cache: Optional[str] = Field(None, description="The KV cache quantization the config states, if any.")
    scale_format: Literal["float", "ue8m0"] = Field("float", description="fp8-block: the scales' format (ue8m0: one-byte "
                                                                      "powers of two, DeepSeek-V4).")
    expert_dtype: Literal["fp8", "fp4"] = Field("fp8", description="fp8-block: fp4 when the routed experts are packed two "
                                                                   "e2m1 values per byte with a scale per 32 inputs.")
    quantized_linear: int = Field(ge=0, description="Linear weights stored quantized (every one checked against the scheme).")
    unquantized_linear: int = Field(ge=0, description="Linear weights the release kept unquantized (routers, lm_head, ...).")


class MadeFor(_Strict):
    """One place a drafter states the target it was made for, against this target."""

    stated_in: str = Field(description="Where the drafter states it: `speculators_config.verifier.name_or_path`, "
                                       "`speculators_config.verifier.architectures`, `num_target_layers`.")
    value: Any = Field(description="What it states.")
    target: Any = Field(None, description="This target's value for the same thing (null: the target states none).")
    matches: Optional[bool] = Field(None, description="The statement agrees with this target (a mismatch builds only with "
                                                "`--allow-target-mismatch`, stated in `target_mismatch_allowed`); null: "
                                                "the target states nothing to compare it with (a local directory with "
                                                "no hub id).")


class _CheckedDrafter(_Strict):
    """What a drafter whose weights and config specpack checks (EAGLE-3 heads, block drafters)
    states beyond its kind's own bindings."""

    quantization: Optional[TargetQuantization] = Field(
        None, description="How the drafter's weights are quantized, checked per scheme as a target's are (its "
                          "config's quantization_config is kept in drafter/config.json); absent: float weights.")
    made_for: list[MadeFor] = Field(default_factory=list, description="Every statement the drafter makes about the "
                                                                      "target it was made for, each checked against "
                                                                      "this target.")
    target_mismatch_allowed: bool = Field(False, description="The drafter states another target (a `made_for` entry "
                                                             "does not match) and was built anyway with "
                                                             "`--allow-target-mismatch`: expect low acceptance.")


class TargetArch(_Strict):
    family: str = Field(description="The families/ module that reads this target (dense, deepseek, qwen3_next, ...).")
    text_config: bool = Field(description="The decoder's config is config.json's `text_config` (a multimodal "
                                          "wrapper; its other towers are carried untouched).")
    tensor_prefix: str = Field(description="Where the decoder's layers live in the checkpoint (`{prefix}layers.{i}.`).")
    layer_kinds: list[str] = Field(description="Each decoder layer as `attention+mlp`: attention full, sliding, chunked, "
                                               "mla, mla_sparse, csa / hca (DeepSeek-V4's compressed sparse / heavily compressed), block_sparse "
                                               "(MiniMax-M3's indexed key blocks), linear "
                                               "(linear attention), mamba or none; mlp dense, hash_moe (experts chosen "
                                               "by token id), "
                                               "moe or none.")
    experts: Optional[TargetExperts] = Field(None, description="The mixture of experts, for MoE targets.")
    total_parameters: int = Field(ge=0, description="Decoder weights in logical (unpacked) count.")
    active_parameters: int = Field(ge=0, description="Of those, what one token uses (routed experts: `active` of `routed`).")
    kv_bytes_per_token: int = Field(ge=0, description="Cache bytes a token adds, attention layers only (bf16 cache; "
                                                      "MLA: its latent).")
    state_bytes_per_sequence: int = Field(0, ge=0, description="Recurrent state a sequence holds in linear-attention "
                                                               "and Mamba layers whatever its length (bf16 conv, fp32 SSM).")
    draft_len_start: int = Field(ge=1, description="D = 128 / G - 1 for G query heads per cached KV head (MLA: every "
                                                   "head reads the one latent): a GPU starting point to measure, not a rule.")
    mtp: Optional[TargetMtp] = Field(None, description="MTP modules inside the target's checkpoint.")
    quantization: Optional[TargetQuantization] = Field(None, description="How the checkpoint is quantized; absent: not.")
    runs: bool = Field(description="specpack's own runtime decodes it (`run`, `serve`, `tune`); otherwise "
                                   "`serve --engine` / `export` serve it.")


class TargetInfo(_Strict):
    architecture: str = Field(description="config.json `architectures[0]`, e.g. LlamaForCausalLM.")
    model_type: str = Field(description="config.json `model_type`.")
    hidden_size: int = Field(gt=0, description="Width of the residual stream.")
    num_hidden_layers: int = Field(gt=0, description="Number of decoder layers.")
    num_attention_heads: int = Field(gt=0, description="Query heads.")
    num_key_value_heads: int = Field(gt=0, description="Key/value heads (GQA).")
    head_dim: int = Field(gt=0, description="Width of one attention head (MLA: query/key head width).")
    mla_latent_dim: Optional[int] = Field(
        None, description="MLA (DeepSeek-V3-style): width of the cached latent per layer "
                          "(kv_lora_rank + rope key dim); None for standard attention.")
    intermediate_size: int = Field(gt=0, description="MLP width.")
    vocab_size: int = Field(gt=0, description="Rows of the embedding / lm_head.")
    max_position_embeddings: int = Field(gt=0, description="Context length the config declares.")
    dtype: str = Field(description="Dtype of the weights on disk, e.g. float32, bfloat16.")
    rope_theta: float = Field(description="RoPE base.")
    rope_scaling: Optional[dict[str, Any]] = Field(None, description="config.json `rope_scaling`, verbatim; for a "
                                                   "transformers v5 config its `rope_parameters` when they scale.")
    tie_word_embeddings: bool = Field(description="lm_head shares the embedding matrix.")
    weight_files: list[str] = Field(description="The safetensors files holding the target's weights.")
    parameters: int = Field(ge=0, description="Number of weights, counted from safetensors headers.")
    config_sha256: str = Field(description="SHA-256 of config.json.")
    tokenizer_sha256: Optional[str] = Field(
        None, description="SHA-256 over the tokenizer files (sorted name + digest), None if none shipped.")
    source: Source = Field(description="Where the target was read from.")
    remote_code: Optional[RemoteCode] = Field(
        None, description="Set when the target needs code of its own (transformers' trust_remote_code) "
                          "and the build allowed it; absent for targets that need none.")
    arch: Optional[TargetArch] = Field(
        None, description="The decoder as its family reads it: layer kinds, experts, MTP, quantization (absent in "
                          "artifacts built before families/).")


class AuxLayers(_Strict):
    layer_ids: list[int] = Field(
        description="Target layers whose hidden states feed the head, low to mid to high.")
    convention: Literal["input_of_layer"] = Field(
        "input_of_layer",
        description="`layer_ids[k] = i` means the hidden state ENTERING decoder layer i (HF "
                    "`hidden_states[i]`; 0 = embeddings). Engines that count 'output of layer i' "
                    "use i - 1 for the same tensor.")
    source_ids: Optional[list[int]] = Field(
        None, description="The ids as the source layout stated them (None: the source used defaults).")
    source_convention: Literal["input_of_layer", "output_of_layer", "default"] = Field(
        description="How the source layout counts, or `default` when it gave no ids.")
    produced_by: Optional[list[str]] = Field(
        None, description="For each id i, the kind (`attention+mlp`, as target.arch.layer_kinds) of layer i - 1, whose "
                          "output it is (`embedding` for id 0): a feature a linear-attention or Mamba layer produces "
                          "is stated (absent for targets of a family specpack does not read).")


class Eagle3Drafter(_CheckedDrafter):
    kind: Literal["eagle3"] = "eagle3"
    source_layout: Literal["eagle3-official", "eagle3-sglang", "eagle3-modelopt", "eagle3-speculators",
                           "eagle3-llamacpp"] = \
        Field(description="The published layout the head was converted from.")
    source: Source = Field(description="Where the head was read from.")
    config: str = Field("drafter/config.json", description="Canonical drafter config.")
    weights: str = Field("drafter/model.safetensors", description="Canonical drafter weights.")
    dtype: str = Field(description="Dtype of the head's float weights (its quantized ones: `quantization`).")
    parameters: int = Field(ge=0, description="Number of weights in the head, in logical (unpacked) count (maps "
                                              "and scales excluded).")
    hidden_size: int = Field(gt=0, description="Width of the head.")
    num_layers: int = Field(1, description="Decoder layers in the head.")
    aux_hidden_states: AuxLayers = Field(description="Which target hidden states feed `fc`.")
    draft_vocab_size: int = Field(gt=0, description="Rows of the head's lm_head.")
    vocab_map: Literal["d2t", "identity"] = Field(
        description="`d2t`: target_id = draft_id + d2t[draft_id] (t2d marks the draft tokens); "
                    "`identity`: draft vocab == target vocab.")
    t2d_source: Literal["checkpoint", "derived", "none"] = Field(
        description="Whether t2d came with the head or was derived from d2t.")
    embedding_source: Literal["target", "drafter"] = Field(
        description="Token embedding the head uses: the target's, or its own copy (stored).")
    lm_head_source: Literal["drafter"] = Field("drafter", description="The head has its own lm_head.")
    concat_order: Literal["embedding_first"] = Field(
        "embedding_first", description="q/k/v input is cat(norm(embed), norm(h)).")
    norm_before_residual: bool = Field(False, description="Residual is hidden_norm(h) instead of h.")


class NgramDrafter(_Strict):
    kind: Literal["ngram"] = "ngram"
    min_n: int = Field(ge=1, description="Shortest context suffix to look up.")
    max_n: int = Field(ge=1, description="Longest context suffix to look up (tried first).")
    draft_len: int = Field(ge=1, description="Default number of proposed tokens.")
    match: Literal["latest", "earliest"] = Field(
        "latest", description="Which earlier occurrence of the suffix is copied: `latest` (the most recent; the "
                              "copy goes on past the context's end, as LZ77 does) or `earliest` (the first; the "
                              "copy stops at the context's end: vLLM's ngram proposer). Lossless either way; "
                              "acceptance differs.")


class MtpDrafter(_Strict):
    kind: Literal["mtp"] = "mtp"
    source_layout: Literal["mtp-deepseek", "mtp-qwen3-next", "mtp-mimo", "mtp-nemotron-h"] = Field(
        description="Published MTP layout: DeepSeek-V3/GLM (`model.layers.{L+k}.{enorm,hnorm,eh_proj,"
                    "shared_head}`), Qwen3-Next / Qwen3.5 (`mtp.*`), MiMo (`model.mtp_layers.{k}.*`) or Nemotron 3 "
                    "(`mtp.layers.{j}.*`, one layer per character of mtp_hybrid_override_pattern).")
    source: Source = Field(description="Where the MTP tensors were read from (the target, or a head directory).")
    location: Literal["target", "drafter"] = Field(
        description="`target`: the tensors stay in the target's weight files and drafter/config.json maps "
                    "each canonical name to its target tensor; `drafter`: drafter/model.safetensors.")
    config: str = Field("drafter/config.json", description="Canonical drafter config.")
    weights: Optional[str] = Field(None, description="Canonical weights file, when location is `drafter`.")
    dtype: str = Field(description="Dtype of the MTP layers' weights.")
    parameters: int = Field(ge=0, description="Weights of the MTP layers (shared embedding/lm_head excluded).")
    num_layers: int = Field(gt=0, description="MTP layers; draft step k uses layer k (k mod n with reuse).")
    concat_order: Literal["embedding_first", "hidden_first"] = Field(
        description="Input of the projection: cat(norm(embed), norm(h)) or cat(norm(h), norm(embed)).")
    target_hidden_state: Literal["final_norm_output", "last_layer_output"] = Field(
        description="The target hidden state feeding MTP layer 0: after the final norm, or before it.")
    chain_hidden_state: Literal["pre_norm", "post_norm"] = Field(
        description="What MTP layer k hands to layer k+1: its block output before or after its final norm.")
    shared_tensors: list[str] = Field(description="Target tensors the drafter uses (embedding, lm_head, ...).")
    duplicates_checked: list[str] = Field(
        default_factory=list,
        description="Source tensors that duplicate target tensors: checked equal and not stored twice.")
    allow_layer_reuse: bool = Field(
        False, description="Whether more draft tokens than MTP layers may be asked for (layer k mod n).")


class TokenizerEvidence(_Strict):
    vocab_tokens: int = Field(ge=0, description="Token strings compared: same ids in both tokenizers.")
    special_tokens: dict[str, Optional[str]] = Field(
        description="Special tokens (bos, eos, pad, unk, ...), identical in both tokenizers.")
    added_tokens: int = Field(ge=0, description="Added tokens compared (content, id and special flag).")
    files_identical: bool = Field(description="The tokenizer files are byte-identical.")
    target_vocab_size: int = Field(gt=0, description="Rows of the target's embedding.")
    draft_vocab_size: int = Field(gt=0, description="Rows of the draft model's embedding; rows past "
                                                    "`vocab_tokens` are padding in both.")
    draft_tokenizer_sha256: Optional[str] = Field(None, description="Digest over the draft's tokenizer files.")


class DraftModelDrafter(_Strict):
    kind: Literal["draft_model"] = "draft_model"
    source: Source = Field(description="Where the draft model was read from.")
    architecture: str = Field(description="Draft model's config.json `architectures[0]`.")
    model_type: str = Field(description="Draft model's config.json `model_type`.")
    config: str = Field("drafter/config.json", description="The draft model's own config.json, bytes unchanged.")
    weight_files: list[str] = Field(description="Its safetensors files (+ index) under drafter/, bytes unchanged.")
    dtype: str = Field(description="Dtype of its weights on disk.")
    parameters: int = Field(ge=0, description="Number of weights, from the safetensors headers.")
    num_layers: int = Field(gt=0, description="Decoder layers.")
    hidden_size: int = Field(gt=0, description="Width of its residual stream.")
    tokenizer: TokenizerEvidence = Field(description="Why its token ids mean the same as the target's.")


BLOCK_LAYOUTS = ("zlab-dflash", "modelopt-dflash", "speculators-dflash", "lilicorr", "lilicorr-sequential",
                 "deepspec-dspark", "deepseek-dflash", "speculators-dspark", "modelopt-dspark", "specforge-dspark",
                 "nemotron35-dflash", "nemotron35-dspark", "vllm-dspark", "llamacpp-dflash")


class BlockMarkov(_Strict):
    rank: int = Field(gt=0, description="Rank r of the low-rank transition bias (markov_w1 [V, r], markov_w2 [Vd, r]).")
    type: Literal["vanilla", "gated", "rnn"] = Field(
        description="`vanilla`: bias = W2·W1[prev]; `gated`: W1[prev] gated by the backbone state (gate_proj); "
                    "`rnn`: a GRU-like state carried across the block (joint_proj).")


class BlockConfidence(_Strict):
    with_markov: bool = Field(description="The confidence head reads [hidden, markov_w1[prev]] (else hidden only).")


class LiLiCorrGeometry(_Strict):
    candidate_topk: int = Field(gt=0, description="Candidates per slot (lilicorr_candidate_topk).")
    hidden_size: int = Field(gt=0, description="Correlator width (lilicorr_hidden_size; 0/null in the source = "
                                               "the drafter's hidden size).")
    num_layers: int = Field(ge=0, description="Correlator transformer layers.")
    num_heads: int = Field(gt=0, description="Correlator attention heads.")
    mlp_ratio: float = Field(gt=0, description="Correlator MLP width = int(hidden_size · mlp_ratio).")
    factor_dim: int = Field(gt=0, description="Width of the out/in edge vectors.")
    vector_eps: float = Field(description="F.normalize eps of the edge vectors (changes scores, not shapes).")
    logit_scale: float = Field(description="Multiplies the cosine scores into logits (changes scores, not shapes).")


class BlockDrafter(_CheckedDrafter):
    kind: Literal["block"] = "block"
    source_layout: Literal[BLOCK_LAYOUTS] = Field(
        description="The published layout the drafter was converted from (z-lab/ModelOpt/speculators DFlash, "
                    "LiLiCorr and its older nn.Sequential names, DeepSpec DSpark and DeepSeek's dflash_*_block7, "
                    "speculators/ModelOpt/SpecForge DSpark, Nemotron 3.5, vLLM's Qwen3DSparkModel config).")
    source: Source = Field(description="Where the drafter was read from.")
    config: str = Field("drafter/config.json", description="Canonical drafter config (the runtime reads only it "
                                                           "and the weights).")
    weights: str = Field("drafter/model.safetensors", description="Canonical drafter weights.")
    dtype: str = Field(description="Dtype of the drafter's float weights (its quantized ones: `quantization`).")
    parameters: int = Field(ge=0, description="Number of weights in the drafter, in logical (unpacked) count (d2t "
                                              "and scales excluded).")
    algorithm: Literal["dflash", "dspark", "lilicorr"] = Field(
        description="`dflash`: independent slots; `dspark`: sequential Markov correction (+ confidence head); "
                    "`lilicorr`: DFlash backbone + candidate-lattice correlator.")
    query_layout: Literal["fill_in", "anchor_first"] = Field(
        description="`fill_in`: queries [anchor@p, MASK@p+1..p+N], the slot at q predicts the token at q, N = B-1 "
                    "(z-lab DFlash, LiLiCorr, Nemotron 3.5); `anchor_first`: queries [anchor@p, MASK@p+1..p+N-1], "
                    "the slot at q predicts the token at q+1, N = B (DeepSpec DSpark and dflash_*_block7).")
    block_size: int = Field(gt=0, description="Trained block size B (query tokens per block, anchor included).")
    draft_slots: int = Field(gt=0, description="Draft tokens one block proposes as trained: B-1 (fill_in) or B "
                                               "(anchor_first).")
    hidden_size: int = Field(gt=0, description="Width of the drafter.")
    num_layers: int = Field(gt=0, description="Draft decoder layers.")
    target_features: AuxLayers = Field(
        description="Target hidden states concatenated (in this order) into `fc`: ids counted as input of layer i, "
                    "with the ids and convention the source stated (never defaulted).")
    mask_token_id: int = Field(ge=0, description="Token id of the MASK query slots (below the target vocab).")
    mask_embedding: bool = Field(description="A separately trained mask embedding (tensor `mask_embedding` [H], "
                                             "from the source's mask_embedding.pt) replaces embed(mask_token_id).")
    embedding_source: Literal["target", "drafter"] = Field(
        description="`target`: the target's embedding (a shipped copy was equal and is not stored twice); "
                    "`drafter`: the drafter's own `embed_tokens.weight`, which differs from the target's.")
    lm_head_source: Literal["target", "drafter"] = Field(
        description="`target`: the target's lm_head (or its tied embedding); `drafter`: its own `lm_head.weight`.")
    target_embedding_sha256: Optional[str] = Field(
        None, description="With embedding `target`: SHA-256 of the target embedding tensor's bytes the drafter "
                          "shares (the one it was trained against, when the source shipped a copy).")
    target_lm_head_sha256: Optional[str] = Field(
        None, description="With lm_head `target`: SHA-256 of the target lm_head (or tied embedding) tensor's bytes.")
    vocab_size: int = Field(gt=0, description="Rows of the drafter's input embedding (= target vocab unless it "
                                              "ships a bigger own table).")
    draft_vocab_size: int = Field(gt=0, description="Rows of the drafter's lm_head (< target vocab: reduced, see "
                                                    "`vocab_map`).")
    vocab_map: Literal["d2t", "identity"] = Field(
        description="`d2t`: target_id = draft_id + d2t[draft_id] (reduced draft vocab); `identity` otherwise.")
    rope_theta: float = Field(description="RoPE base of the drafter (checked equal to the target's).")
    rope_scaling: Optional[dict[str, Any]] = Field(None, description="The drafter config's RoPE scaling, verbatim.")
    rope_style: Literal["neox", "interleaved"] = Field(description="RoPE pairing (checked equal to the target's).")
    layer_causal: list[bool] = Field(description="Per draft layer: causal within the block (false = the block "
                                                 "attends to itself non-causally).")
    sliding_window: list[Optional[int]] = Field(description="Per draft layer: attention window, or null (full).")
    attention_sinks: bool = Field(description="Per-head attention sink biases (layers.{i}.self_attn."
                                              "attention_sink_bias) are present and used.")
    logit_scale: Optional[float] = Field(None, description="Multiplier on the draft logits (config logit_scale).")
    markov: Optional[BlockMarkov] = Field(None, description="DSpark's sequential Markov head, if any.")
    confidence: Optional[BlockConfidence] = Field(
        None, description="DSpark's confidence head (per-position conditional acceptance), if any.")
    lilicorr: Optional[LiLiCorrGeometry] = Field(None, description="LiLiCorr's correlator geometry.")
    resolved_from: dict[str, str] = Field(
        description="For each binding that published layouts state in different places or not at all (algorithm, "
                    "query_layout, target_layer_ids, mask_token_id, ...): what settled it — a config key, the "
                    "layout's own definition, or a `specpack build` flag.")


class ReleaseDSparkDrafter(_Strict):
    kind: Literal["release_dspark"] = "release_dspark"
    source_layout: Literal["deepseek-v4-dspark", "deepseek-v41-dspark", "minimax-m31-dspark"] = Field(
        description="A DSpark drafter as a release ships it, in its engine's own architecture: DeepSeek-V4's or "
                    "V4.1's stages inside the target's weights (`mtp.{k}.`, layout B, as vLLM's DeepSeek-V4 / "
                    "V4.1 DSpark drafts load them) or MiniMax-M3.1's `dspark/` folder (DSparkMiniMaxDraftModel, layout C). "
                    "Engines run it; specpack checks and binds it.")
    source: Source = Field(description="Where it was read from (the target itself, or its subfolder).")
    location: Literal["target", "drafter"] = Field(
        description="`target`: its tensors stay in the target's weight files (nothing copied); `drafter`: its files, "
                    "byte for byte, under drafter/ (and not again in the target's files).")
    files: list[str] = Field(default_factory=list, description="Its files under drafter/ (location `drafter`).")
    decoder: str = Field(description="The draft layers' architecture, in words (norms, attention, MLP).")
    layers: int = Field(gt=0, description="Draft layers (DeepSeek-V4: stages `mtp.{k}.`, k < layers).")
    layers_from: str = Field(description="What settled the layer count (a config key, or the weights' prefixes as "
                                         "vLLM's _read_dspark_num_layers reads them).")
    layer_kind: str = Field(description="Each draft layer's kind, as target.arch.layer_kinds names it.")
    sliding_window: int = Field(gt=0, description="Context the draft layers attend to (tokens).")
    query_causal: bool = Field(description="Whether a block's query tokens attend causally among themselves (false: "
                                           "every block row sees the whole block).")
    block_size: int = Field(gt=0, description="dspark_block_size: draft tokens one block proposes.")
    noise_token_id: int = Field(ge=0, description="dspark_noise_token_id: the token filling the block's draft slots "
                                                  "(below the target vocab).")
    target_layer_ids: list[int] = Field(description="dspark_target_layer_ids: target layers whose outputs, "
                                                    "concatenated, feed the drafter (main_proj / fc).")
    target_layer_convention: Literal["output_of_layer", "input_of_layer"] = Field(
        description="How the ids count: id i is the hidden state leaving target layer i (output_of_layer: "
                    "DeepSeek-V4, MiniMax-M3.1) or entering it (input_of_layer: DeepSeek-V4.1), i < num_hidden_layers.")
    markov: BlockMarkov = Field(description="The Markov head (markov_w1 / markov_w2, rank dspark_markov_rank).")
    confidence: Optional[BlockConfidence] = Field(None, description="The confidence head, when it ships one.")
    quantization: Optional[TargetQuantization] = Field(
        None, description="How its weights are quantized, checked tensor by tensor.")
    tensors: int = Field(gt=0, description="Tensors checked (scales included).")
    parameters: int = Field(ge=0, description="Weights in logical (unpacked) count.")
    shared_tensors: list[str] = Field(description="Target tensors it uses (embedding, lm_head).")
    resolved_from: dict[str, str] = Field(description="Where each binding was read: a config key or a source's rule.")


Drafter = Annotated[Union[Eagle3Drafter, NgramDrafter, MtpDrafter, DraftModelDrafter, BlockDrafter,
                          ReleaseDSparkDrafter], Field(discriminator="kind")]


class MemoryInfo(_Strict):
    target_weight_bytes: int = Field(ge=0, description="Bytes of target weights on disk.")
    drafter_weight_bytes: int = Field(ge=0, description="Extra bytes the drafter adds.")
    target_kv_bytes_per_token: int = Field(ge=0, description="KV cache bytes per token (target dtype).")
    drafter_kv_bytes_per_token: int = Field(ge=0, description="KV cache bytes per token of the drafter.")


class Manifest(_Strict):
    format: Literal["specpack"] = Field(FORMAT_NAME, description="Always 'specpack'.")
    format_version: Literal[1] = Field(FORMAT_VERSION, description="Manifest format version.")
    specpack_version: str = Field(description="specpack version that wrote the artifact.")
    created: str = Field(description="UTC creation time, ISO 8601.")
    name: str = Field(description="Artifact name (the output directory's name at build time).")
    target: TargetInfo
    drafter: Drafter
    memory: MemoryInfo
    files: list[FileEntry] = Field(
        description="Every file of the artifact except specpack.json and model.sig, sorted by path.")
    exports: Optional[Exports] = Field(
        None, description="Graphs and engines derived from the artifact and stored in it (exports/, engines/).")
    profiles: list[Profile] = Field(
        default_factory=list, description="Validated profiles measured by `specpack tune` (empty until then); "
                                          "`run` and `serve` pick the best one that fits the machine.")


def default_draft_len(manifest: Manifest) -> int:
    """The draft length used when neither a validated profile nor the caller sets one: the drafter's
    own (n-gram; a block drafter's trained slots), else 4, capped at what the drafter can run (MTP
    without layer reuse: one draft token per layer, so DeepSeek-V3, GLM and MiMo as published get 1)."""
    drafter = manifest.drafter
    length = getattr(drafter, "draft_len", None) or 4
    if drafter.kind == "block":  # a block drafts its trained slots in one forward
        return drafter.draft_slots
    if drafter.kind == "release_dspark":
        return drafter.block_size
    if drafter.kind == "mtp" and not drafter.allow_layer_reuse:
        length = min(length, drafter.num_layers)
    return length


def check_draft_len(manifest: Manifest, draft_len: int) -> None:
    """Refuse a draft length the artifact's drafter cannot draft as bound (an InputError naming the
    limit): a block drafter proposes at most its trained slots, an MTP drafter one token per layer
    unless layer reuse is allowed. `run`, `serve` and `export` check one a user gives; a longer
    draft asked of the runtime itself would be the shorter one in silence."""
    from specpack.errors import InputError

    d = manifest.drafter
    if d.kind == "block" and draft_len > d.draft_slots:
        raise InputError(f"{draft_len} draft tokens asked for, but this {d.algorithm} drafter's block of "
                         f"{d.block_size} ({d.query_layout}) has {d.draft_slots} trained draft slots",
                         hint=f"use --draft-len {d.draft_slots} (or fewer)")
    if d.kind == "release_dspark" and draft_len != d.block_size:
        raise InputError(f"{draft_len} draft tokens asked for, but this DSpark drafter drafts one block of "
                         f"{d.block_size} (dspark_block_size); engines run them at that length",
                         hint=f"use --draft-len {d.block_size}")
    if d.kind == "mtp" and draft_len > d.num_layers and not d.allow_layer_reuse:
        raise InputError(f"{draft_len} draft tokens asked for, but the MTP drafter has {d.num_layers} "
                         "layer(s) and layer reuse is not allowed",
                         hint=f"use --draft-len {d.num_layers} (or fewer), or rebuild the artifact with "
                              "--mtp-allow-reuse (step k then runs layer k mod n)")
