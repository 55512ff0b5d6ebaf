"""The batched engine (engine.py), token choice and accept rule (sampling.py), counters (stats.py)."""

from specpack.runtime.engine.engine import Engine, Generation, Request
from specpack.runtime.engine.sampling import Sampler, SamplingParams, accept
from specpack.runtime.engine.stats import MAX_DRAFT_LEN, DraftLength, GenerationResult, GenerationStats

__all__ = ["Engine", "Generation", "Request", "Sampler", "SamplingParams", "accept", "MAX_DRAFT_LEN",
           "DraftLength", "GenerationResult", "GenerationStats"]
