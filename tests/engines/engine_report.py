"""The engine suite's table: one row per target and drafter, printed at the end of the run and
written to SPECPACK_ENGINE_REPORT (default tests/engines/report.json) for BENCHMARKS.md."""

import json
import os
from pathlib import Path

REPORT = Path(os.environ.get("SPECPACK_ENGINE_REPORT", Path(__file__).parent / "report.json"))
ROWS: list[dict] = []


def record(**row) -> None:
    """One row of the suite's table (printed at the end, written to REPORT)."""
    ROWS.append(row)
    REPORT.write_text(json.dumps(ROWS, indent=1))


def table(rows) -> str:
    head = "| target | drafter | D | loads in the engine | tokens: spec = plain = specpack | AL engine | AL specpack | ratio |"
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        al = (f"{r['al_vllm']:.2f} | {r['al_specpack']:.2f} | {r['al_vllm'] / r['al_specpack']:.3f}"
              if r.get("al_vllm") else f"- | {r['al_specpack']:.2f} | -" if r.get("al_specpack") else "- | - | -")
        loads = "yes" if r["loads"] is True else f"no: `{r['loads']}`"
        note = f" ({r['note']})" if r.get("note") else ""
        out.append(f"| {r['target']} | {r['drafter']}{note} | {r.get('D', '-')} | {loads} | {r.get('equal', '-')} | {al} |")
    return "\n".join(out)
