"""The ONNX Runtime column of bench/decode.py: plain and speculative tokens/s on the exported graphs.

    from ort_column import ort_engines
    engines.update(ort_engines(artifact, pub, key, max_new_tokens, draft_len))

Each engine is `fn(prompt_ids) -> (new token ids, tokens/s, acceptance length or None)`, the shape
decode.py's table takes. The artifact is exported first when it has no ONNX export (re-signed with
`key`; a signed artifact needs it). Run alone for a quick comparison with the torch backend:

    python bench/ort_column.py [ARTIFACT] [--max-new-tokens 128] [--draft-len 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

Engine = Callable[[list[int]], tuple[list[int], float, float | None]]


def load_ort(artifact, public_key=None, key=None, threads: int = 2, export: bool = True):
    """A SpecModel on the onnxruntime backend (the artifact verified first; exported if needed)."""
    from specpack.exports.onnx import export_onnx, read_index
    from specpack.packager import verify
    from specpack.runtime import backends
    from specpack.runtime.spec_model import SpecModel

    if read_index(artifact) is None and export:
        export_onnx(artifact, key=key, public_key=public_key, progress=sys.stderr.isatty())
    manifest = verify(artifact, public_key).manifest
    target, drafter = backends.load("onnxruntime", artifact, manifest, threads=threads, torch_threads=None)
    return SpecModel(target, drafter)


def engines_of(model, max_new_tokens: int, draft_len: int, label: str, torch_threads: int) -> dict[str, Engine]:
    """{label plain, label speculative} engines over one SpecModel; each run sets torch's thread count
    first (engines of different backends share the process)."""
    import torch

    def run(spec: bool) -> Engine:
        def fn(ids):
            torch.set_num_threads(torch_threads)
            r = model.generate(ids, max_new_tokens=max_new_tokens, speculative=spec, draft_len=draft_len)
            return r.tokens, r.stats.tokens_per_s, r.stats.acceptance_length if spec else None
        return fn

    kind = model.drafter.kind if model.drafter is not None else "spec"
    return {f"{label} plain": run(False), f"{label} {kind}": run(True)}


def ort_engines(artifact, public_key=None, key=None, max_new_tokens: int = 128, draft_len: int = 8,
                threads: int = 2) -> dict[str, Engine]:
    """decode.py's ONNX Runtime column: {"onnxruntime plain": fn, "onnxruntime <drafter>": fn}."""
    return engines_of(load_ort(artifact, public_key, key, threads), max_new_tokens, draft_len, "onnxruntime", 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?", type=Path, help="default: the demo's SmolLM2 n-gram artifact")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import specpack
    from specpack.demo import PROMPTS, cache_dir, prepare

    pub = key = None
    artifact = args.artifact
    if artifact is None:
        artifact, pub = prepare(cache_dir(), lambda s: print(s, file=sys.stderr))
        key = cache_dir() / "demo-signer.pem"
    ref = specpack.load(artifact, public_key=pub)
    tok = ref.tokenizer
    engines = engines_of(ref, args.max_new_tokens, args.draft_len, "torch", args.threads)
    engines.update(ort_engines(artifact, pub, key, args.max_new_tokens, args.draft_len, args.threads))
    for name, prompt in PROMPTS.items():
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        print(f"\n{name} ({len(ids)} prompt tokens, {args.max_new_tokens} new, median of {args.repeats})")
        outs = {}
        for engine, fn in engines.items():
            runs = [fn(ids) for _ in range(args.repeats)]
            outs[engine] = runs[0][0]
            al = runs[0][2]
            print(f"  {engine:24s} {statistics.median(r[1] for r in runs):7.1f} tokens/s"
                  + (f"   acceptance length {al:.2f}" if al else ""))
        same = len({tuple(o) for o in outs.values()}) == 1
        print(f"  all outputs identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
