"""The JSON Schema of `specpack.json`, generated from the pydantic models and checked in."""

from __future__ import annotations

import json
from pathlib import Path

from specpack.schemas.manifest import Manifest

SCHEMA_PATH = Path(__file__).with_name("manifest.v1.json")


def manifest_schema() -> dict:
    """The JSON Schema of `specpack.json`, generated from the pydantic models."""
    schema = Manifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://specpack.dev/schemas/manifest.v1.json"
    return schema


def render_schema() -> str:
    return json.dumps(manifest_schema(), indent=2, sort_keys=True) + "\n"
