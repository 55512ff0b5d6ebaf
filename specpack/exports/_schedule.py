"""A validated profile's measured concurrency crossover, written as the batch-size draft-length
schedule of the engines users scale out on: the profile's draft length up to its
`max_concurrency`, no drafting above (what `specpack serve` itself does with the profile).

Sources followed (read with the search tool):
- vLLM: vllm/config/speculative.py @ 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443
  (`num_speculative_tokens_per_batch_size: list[tuple[int, int, int]]`, entries
  `(range_start, range_end, K)` with inclusive ranges); vllm/v1/spec_decode/dynamic/utils.py @
  14b450ca590cbff96e7004bdb147a5d3acf5a4f6 (`validate_and_normalize_dynamic_sd_schedule`: ranges
  positive, sorted, non-overlapping, the first starting at 1, K >= 0; the lookup clamps K to
  `num_speculative_tokens` and lets gaps and the tail inherit the previous K);
  docs/features/speculative_decoding/dynamic_speculative_decoding.md @ 015a47e1 (K <=
  num_speculative_tokens, K = 0 drafts nothing; tested with Eagle, Eagle-3 and DFlash, a DSpark
  example; ignored with --data-parallel-size > 1).
- TensorRT-LLM: tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412
  `DecodingBaseConfig.draft_len_schedule: dict[int, int]` (batch size -> draft length for batch
  sizes up to that key, 0 above the largest; exclusive with `max_concurrency`) and, in another
  stored revision, its validator (keys >= 1, lengths >= 0 and <= `max_draft_len`, the smallest
  key's value equal to `max_draft_len`); _torch/speculative/utils.py @ 011d0933dcb5e592f5fa2626beaf42a96324c578
  (`get_draft_len_for_batch_size`: draft lengths floored at `min_runtime_draft_len`, 1 for
  one-engine modes in that revision; the schedule is ignored for vanilla MTP with several
  layers); _torch/speculative/interface.py @ 00b6d5a25c30b4382d24fbdf52956d601b3ffd24
  (`support_dynamic_draft_len`: MTP one-model, MTP-Eagle, EAGLE-3 one-model, PARD, DFlash,
  draft-target one-model and SA; not DSpark); the two-model n-gram drafter reads it too
  (tests/unittest/_torch/speculative/hw_agnostic/test_min_runtime_draft_len.py @ 011d0933).
- SGLang has no batch-size draft-length setting (its server arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_TAIL = 1 << 16  # end of vLLM's last range; its lookup carries the last K beyond it anyway


@dataclass(frozen=True)
class Crossover:
    """What a profile measured: speculation with `draft_len` tokens paid up to `max_concurrency`."""

    profile: str  # "name (id)"
    draft_len: int
    max_concurrency: int
    measured: tuple[int, ...]  # the concurrencies measured
    where: str  # backend, device, dtype and hardware it was measured with

    @classmethod
    def of(cls, p) -> "Crossover":
        hw = p.evidence.hardware
        machine = hw.gpu or f"{hw.cpu_model} ({hw.cpu_cores} cores)"
        return cls(f"{p.name} ({p.id})", p.settings.draft_len, p.settings.max_concurrency,
                   tuple(c.concurrency for c in p.evidence.concurrency_sweep),
                   f"{p.backend}/{p.device}/{p.dtype} on {machine}, workload '{p.evidence.workload.name}'")


def vllm(c: Crossover) -> list[list[int]]:
    """`num_speculative_tokens_per_batch_size`: the draft length for batch sizes 1..M, 0 above."""
    return [[1, c.max_concurrency, c.draft_len], [c.max_concurrency + 1, VLLM_TAIL, 0]]


def trtllm(c: Crossover) -> dict[int, int]:
    """`draft_len_schedule`: the draft length up to batch size M (0 above is implicit)."""
    return {c.max_concurrency: c.draft_len}


def measured_lines(c: Crossover, device: str = "cuda") -> list[str]:
    """README lines: where the crossover comes from and how far the measurement reaches."""
    lines = [f"From validated profile {c.profile}, measured with {c.where}: speculation with {c.draft_len} draft "
             f"tokens beat decoding without it up to {c.max_concurrency} concurrent requests "
             f"(concurrencies measured: {', '.join(map(str, c.measured)) or 'one request only'})."]
    if not c.measured or c.max_concurrency >= max(c.measured):
        lines.append("Speculation still paid at the highest concurrency measured: above it nothing was measured and "
                     "the schedule turns drafting off. Tune with higher --concurrency levels to find the crossover.")
    if f"/{device}/" not in c.where:
        lines.append(f"The profile was not measured on {device}, where the engine runs: its crossover may not hold "
                     "there.")
    return lines


def vllm_lines(c: Crossover) -> list[str]:
    return measured_lines(c) + [
        f"`num_speculative_tokens_per_batch_size` {vllm(c)}: {c.draft_len} draft tokens for batch sizes "
        f"1-{c.max_concurrency}, none above (inclusive ranges; the last K also holds past its end). vLLM documents "
        "it as tested with Eagle, Eagle-3 and DFlash, and ignores it with --data-parallel-size > 1."]


def trtllm_lines(c: Crossover) -> list[str]:
    return measured_lines(c) + [
        f"`draft_len_schedule` {trtllm(c)}: {c.draft_len} draft tokens up to batch size {c.max_concurrency}. Above "
        "it TensorRT-LLM drafts `min_runtime_draft_len` tokens: 0 for the two-model n-gram drafter, and in releases "
        "with that floor 1 for one-engine modes (EAGLE-3 one-model, MTP, DFlash), whose drafter state must keep "
        "up, so speculation drops to one draft token rather than off."]
