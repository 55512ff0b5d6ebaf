"""Typed manifest models and their generated JSON Schema."""

from __future__ import annotations

from specpack.schemas.manifest import (BLOCK_LAYOUTS, MANIFEST_NAME, SIGNATURE_NAME, AuxLayers, BlockConfidence,
                                       BlockDrafter, BlockMarkov, DraftModelDrafter, ReleaseDSparkDrafter, LiLiCorrGeometry,
                                       Eagle3Drafter, FileEntry, MadeFor, Manifest, MemoryInfo, MtpDrafter,
                                       NgramDrafter, RemoteCode, Source, TargetArch, TargetExperts, TargetInfo,
                                       TargetMtp, TargetQuantization, TokenizerEvidence)
from specpack.schemas.schema import SCHEMA_PATH, manifest_schema, render_schema

__all__ = ["BLOCK_LAYOUTS", "MANIFEST_NAME", "SIGNATURE_NAME", "AuxLayers", "BlockConfidence", "BlockDrafter",
           "BlockMarkov", "LiLiCorrGeometry", "DraftModelDrafter", "ReleaseDSparkDrafter", "Eagle3Drafter", "FileEntry",
           "MadeFor", "Manifest", "MemoryInfo", "MtpDrafter", "NgramDrafter", "RemoteCode", "Source", "TargetArch",
           "TargetExperts", "TargetInfo", "TargetMtp", "TargetQuantization", "TokenizerEvidence",
           "SCHEMA_PATH", "manifest_schema", "render_schema"]
