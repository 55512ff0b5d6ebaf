"""Validated profiles (`specpack.json` `profiles[]`): measured settings for one backend/device/dtype.

A profile is only written by `specpack tune`, with the evidence it was measured on. Its `id` is a
hash of everything else in it, so an edited profile is recognised (see `profile_id`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILE_VERSION = 1
BACKENDS = ("torch", "onnxruntime", "tensorrt")
NAME_PATTERN = r"^[a-z0-9]+-[a-z0-9]+-[a-z0-9]+-[a-z0-9_]+-d[0-9]+(-t[0-9]+x[0-9]+)?(-l[0-9]+)?$"
ADDED_LATER = ("lookup",)  # nested fields newer than profile_version 1: left out of `profile_id` when unset


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostCurve(_Strict):
    rows: list[int] = Field(min_length=1, description="Rows in one target forward, ascending.")
    ms: list[float] = Field(min_length=1, description="Milliseconds one target forward over that many rows took "
                                                      "(median after a warm-up).")
    key_ms: Optional[float] = Field(None, ge=0, description="Milliseconds each row adds per key it attends "
                                                            "(measured at 512 positions of context).")


class ProfileSettings(_Strict):
    speculative: bool = Field(description="Drafter on (speculative decoding) or off (the target alone).")
    draft_len: int = Field(ge=0, le=16, description="Draft tokens proposed per step (a tree: its depth); 0 when "
                                                    "speculation is off.")
    draft_shape: Literal["chain", "tree"] = Field(
        "chain", description="Shape of a draft: one chain of tokens, or a tree of `tree_topk` children per node "
                             "and at most `tree_nodes` nodes, `draft_len` deep, verified in one target forward.")
    tree_topk: int = Field(1, ge=1, le=8, description="Children per draft tree node (1 for a chain).")
    tree_nodes: int = Field(0, ge=0, le=64, description="Draft tree nodes verified per step at most (0 for a chain).")
    lookup: int | None = Field(
        None, ge=1, le=16, description="Prompt lookup: where the context's last 3-4 tokens occurred before, a step "
                                       "verifies a copy of up to max(draft_len, lookup) tokens of what followed "
                                       "instead of asking the drafter (absent: off).")
    max_concurrency: int = Field(
        ge=0, description="Highest number of requests in flight at which speculation still beat decoding "
                          "without it on the workload; above it, `serve` turns speculation off. "
                          "0 when speculation never paid.")
    cost_curve: Optional[CostCurve] = Field(
        None, description="Target step time vs rows measured on the profile's hardware: the batched engine "
                          "chooses each step's draft lengths from it (absent in profiles from before the engine).")

    @model_validator(mode="after")
    def _tree_fields_match_the_shape(self):
        tree = self.draft_shape == "tree"
        if tree != (self.tree_topk > 1) or tree != (self.tree_nodes > 0):
            raise ValueError("a tree has tree_topk > 1 and tree_nodes > 0; a chain has tree_topk 1 and tree_nodes 0")
        return self


class ProfileMemory(_Strict):
    weights_bytes: int = Field(ge=0, description="Target plus drafter weights in the profile's dtype.")
    kv_cache_bytes: int = Field(ge=0, description="KV cache of target plus drafter for one sequence of "
                                                   "`context_tokens` tokens in the profile's dtype.")
    context_tokens: int = Field(gt=0, description="Context length the KV cache figure is for.")
    required_bytes: int = Field(ge=0, description="weights_bytes + kv_cache_bytes: memory the device needs "
                                                   "free for this profile to run (GPU memory on cuda).")
    measured_peak_bytes: int = Field(ge=0, description="Peak memory seen while tuning: process peak RSS on "
                                                        "cpu, torch's peak allocation on cuda.")


class WorkloadInfo(_Strict):
    name: str = Field(description="Workload name (its file name without .jsonl).")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the workload file's bytes.")
    prompts: int = Field(gt=0, description="Number of prompts in the workload.")
    max_new_tokens: int = Field(gt=0, description="New tokens asked per prompt when a line sets no max_tokens.")
    new_tokens: int = Field(ge=0, description="New tokens one pass over the workload produced (greedy).")


class DraftLenPoint(_Strict):
    draft_len: int = Field(ge=1, description="Draft length measured (a tree: its depth).")
    tree_topk: int = Field(1, ge=1, le=8, description="Children per draft tree node (1: a chain).")
    tree_nodes: int = Field(0, ge=0, le=64, description="Draft tree nodes at most (0: a chain).")
    lookup: int | None = Field(None, ge=1, le=16, description="Prompt lookup copies of up to this many tokens "
                                                                 "beside the drafter (absent: off).")
    tokens_per_s: float = Field(ge=0, description="Speculative tokens/s over the workload at this length.")
    acceptance_length: float = Field(ge=1, description="The drafter's: 1 + its accepted draft tokens / the steps "
                                                      "that verified its drafts, over the workload.")
    speedup: float = Field(ge=0, description="tokens_per_s / the baseline's tokens/s.")


class ConcurrencyPoint(_Strict):
    concurrency: int = Field(ge=1, description="Concurrent clients sending the workload through the batched "
                                               "engine `serve` runs (its scheduler).")
    baseline_tokens_per_s: float = Field(ge=0, description="Aggregate tokens/s with speculation off.")
    speculative_tokens_per_s: float = Field(ge=0, description="Aggregate tokens/s with speculation on.")
    baseline_p50_s: Optional[float] = Field(None, ge=0, description="Median request latency, speculation off.")
    baseline_p95_s: Optional[float] = Field(None, ge=0, description="95th percentile request latency, "
                                                                     "speculation off.")
    speculative_p50_s: Optional[float] = Field(None, ge=0, description="Median request latency, speculation on.")
    speculative_p95_s: Optional[float] = Field(None, ge=0, description="95th percentile request latency, "
                                                                        "speculation on.")


class Hardware(_Strict):
    cpu_model: str = Field(description="CPU model name (/proc/cpuinfo or platform).")
    cpu_cores: int = Field(ge=1, description="Logical CPU cores.")
    memory_bytes: int = Field(ge=0, description="Total system memory.")
    gpu: Optional[str] = Field(None, description="GPU name when the profile runs on cuda.")
    gpu_memory_bytes: Optional[int] = Field(None, description="Total memory of that GPU.")


class Software(_Strict):
    specpack: str = Field(description="specpack version that measured the profile.")
    python: str = Field(description="Python version.")
    platform: str = Field(description="Operating system and architecture.")
    packages: dict[str, str] = Field(description="Versions of the backend and its key packages "
                                                 "(torch, transformers, ...).")


class Evidence(_Strict):
    workload: WorkloadInfo = Field(description="The workload the figures were measured on.")
    baseline_tokens_per_s: float = Field(ge=0, description="Tokens/s without speculation, one request at a time.")
    speculative_tokens_per_s: float = Field(ge=0, description="Tokens/s with the profile's settings.")
    speedup: float = Field(ge=0, description="speculative_tokens_per_s / baseline_tokens_per_s.")
    acceptance_length: float = Field(ge=1, description="The drafter's (1 + accepted / drafted steps) at the chosen "
                                                      "draft length.")
    position_acceptance: list[float] = Field(
        description="Conditional acceptance rate of draft position k given positions < k were accepted.")
    greedy_equal: bool = Field(description="Greedy speculative output was token-identical to decoding "
                                           "without speculation on every prompt of the workload.")
    prompts_checked: int = Field(ge=0, description="Prompts whose greedy outputs were compared.")
    draft_len_sweep: list[DraftLenPoint] = Field(description="Every draft length measured, ascending, then every "
                                                             "tree shape, then the best of each with prompt "
                                                             "lookup.")
    concurrency_sweep: list[ConcurrencyPoint] = Field(description="Every concurrency measured, ascending.")
    hardware: Hardware = Field(description="The machine the figures were measured on.")
    software: Software = Field(description="The software the figures were measured with.")
    measured_at: str = Field(description="UTC time the measurement ended, ISO 8601.")
    seconds: float = Field(ge=0, description="How long tuning took.")


class Profile(_Strict):
    profile_version: Literal[1] = Field(PROFILE_VERSION, description="Version of this profile schema.")
    id: str = Field(pattern=r"^[0-9a-f]{16}$",
                    description="First 16 hex digits of the SHA-256 of the profile's canonical JSON without "
                                "its id (see `profile_id`): changes when anything in it changes.")
    name: str = Field(pattern=NAME_PATTERN,
                      description="Readable name backend-device-dtype-drafter-dD, e.g. torch-cpu-float32-ngram-d5 "
                                  "(drafter `none`, d0 when speculation is off), with -tKxM for draft trees of "
                                  "top-k K and M nodes (torch-cpu-float32-eagle3-d6-t4x24) and -lN for prompt "
                                  "lookup of up to N tokens beside the drafter (torch-cpu-float32-eagle3-d3-l8). Not "
                                  "unique across machines.")
    backend: Literal["torch", "onnxruntime", "tensorrt", "vllm", "sglang", "trtllm"] = Field(
        description="Runtime backend, or the external engine the profile was measured through (`tune --engine`).")
    device: Literal["cpu", "cuda"] = Field(description="Device type.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(description="Compute dtype of the weights.")
    weights: Optional[Literal["fp16", "bf16", "int8", "w8a8"]] = Field(
        None, description="Precision the CPU kernels kept the linear layers' weights in (`--weights`); "
                          "absent: as loaded, in `dtype`.")
    kv_cache: Optional[Literal["fp16"]] = Field(
        None, description="The target's KV cache when kept narrower than `dtype` (`--kv-cache`); absent: in `dtype`.")
    drafter: str = Field(description="Drafter kind the profile uses (the manifest's), or `none`.")
    settings: ProfileSettings = Field(description="What run and serve apply when they pick this profile.")
    memory: ProfileMemory = Field(description="Memory this profile needs.")
    evidence: Evidence = Field(description="What the settings were validated with.")


def profile_name(backend: str, device: str, dtype: str, drafter: str, draft_len: int, tree_topk: int = 1,
                 tree_nodes: int = 0, lookup: int | None = None) -> str:
    """backend-device-dtype-drafter-dD, with -tKxM for trees of top-k K and M nodes and -lN for prompt
    lookup copies of up to N tokens."""
    tree = f"-t{tree_topk}x{tree_nodes}" if tree_topk > 1 else ""
    return f"{backend}-{device}-{dtype}-{drafter}-d{draft_len}{tree}" + (f"-l{lookup}" if lookup else "")


def profile_id(data: dict) -> str:
    """The id a profile (as JSON data) should have: a hash of all its fields but `id`. A top-level
    field left unset (None: `weights` and `kv_cache`, added later) is left out, and so is a nested
    field of ADDED_LATER, so profiles written before it existed keep their id."""
    body = _without_unset_later({k: v for k, v in data.items() if k != "id" and v is not None})
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _without_unset_later(value):
    if isinstance(value, dict):
        return {k: _without_unset_later(v) for k, v in value.items() if not (k in ADDED_LATER and v is None)}
    if isinstance(value, list):
        return [_without_unset_later(v) for v in value]
    return value


def make_profile(**fields) -> Profile:
    """A Profile from its fields but `id` and `name`, which are derived."""
    s = fields["settings"]
    s = s if isinstance(s, ProfileSettings) else ProfileSettings.model_validate(s)
    draft_len = s.draft_len if s.speculative else 0
    topk, nodes = (s.tree_topk, s.tree_nodes) if s.speculative else (1, 0)
    name = profile_name(fields["backend"], fields["device"], fields["dtype"], fields["drafter"], draft_len, topk, nodes,
                        s.lookup if s.speculative else None)
    body = Profile.model_validate({**fields, "id": "0" * 16, "name": name}).model_dump(mode="json")
    return Profile.model_validate({**body, "id": profile_id(body)})
