"""Typed manifest models and their generated JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

from specpack.schemas.manifest import (BLOCK_LAYOUTS, MANIFEST_NAME, SIGNATURE_NAME, AuxLayers, BlockConfidence,
                                       BlockDrafter, BlockMarkov, DraftModelDrafter, ReleaseDSparkDrafter, LiLiCorrGeometry,
                                       Eagle3Drafter, FileEntry, MadeFor, Manifest, MemoryInfo, MtpDrafter,
                                       NgramDrafter, RemoteCode, Source, TargetArch, TargetExperts, TargetInfo,
                                       TargetMtp, TargetQuantization, TokenizerEvidence)

SCHEMA_PATH = Path(__file__).with_name("manifest.v1.json")

__all__ = ["BLOCK_LAYOUTS", "MANIFEST_NAME", "SIGNATURE_NAME", "AuxLayers", "BlockConfidence", "BlockDrafter",
           "BlockMarkov", "LiLiCorrGeometry", "DraftModelDrafter", "ReleaseDSparkDrafter", "Eagle3Drafter", "FileEntry",
           "MadeFor", "Manifest", "MemoryInfo", "MtpDrafter", "NgramDrafter", "RemoteCode", "Source", "TargetArch",
           "TargetExperts", "TargetInfo", "TargetMtp", "TargetQuantization", "TokenizerEvidence",
           "SCHEMA_PATH", "manifest_schema"]


def manifest_schema() -> dict:
    """The JSON Schema of `specpack.json`, generated from the pydantic models."""
    schema = Manifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://specpack.dev/schemas/manifest.v1.json"
    return schema


def render_schema() -> str:
    return json.dumps(manifest_schema(), indent=2, sort_keys=True) + "\n"
