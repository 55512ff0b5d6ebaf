"""The floor of architecture knowledge every room shares: from a target's config.json (or its
`text_config`), its decoder's geometry, each layer's kind, its experts, its MTP modules, the tensors
its checkpoint holds and how they are quantized. Converters, the runtime and the exports read targets
through it; it reads configs and safetensors headers, never weights, and imports nothing above it.

The package hands on the names of registry.py."""

from __future__ import annotations

from specpack.families.registry import (
    Arch, text_config, check_config, FAMILIES, family_of, describe,
    Checked, check, mtp_tensors, mtp_held)

__all__ = ["Arch", "text_config", "check_config", "FAMILIES",
           "family_of", "describe", "Checked", "check", "mtp_tensors", "mtp_held"]
