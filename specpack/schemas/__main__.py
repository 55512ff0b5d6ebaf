"""Regenerate the checked-in JSON Schema: `python -m specpack.schemas`."""

from specpack.schemas import SCHEMA_PATH, render_schema

SCHEMA_PATH.write_text(render_schema())
print(f"wrote {SCHEMA_PATH}")
