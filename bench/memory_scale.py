"""Peak memory of `specpack run` and `specpack serve` as the model grows: a fixed cost (Python, torch, the
tokenizer: ~300-340 MiB before any weight) plus what the model itself holds. On SmolLM2-135M the fixed part is
two thirds of the weights; on a Llama-shaped model of a billion parameters it is a few percent, and the ratio
to weights + KV is what a laptop with a 7B model sees.

  .venv/bin/python bench/memory_scale.py                         # SmolLM2-135M fp32 and a 1.2B random Llama, fp32
  .venv/bin/python bench/memory_scale.py --shapes 1b --weights fp32,w8a8

Each shape's checkpoint is random fp32 (torch.randn x 0.02, seed 0; the speed and memory of decoding do not
depend on the values), written once under the demo cache with SmolLM2's tokenizer, built into a signed n-gram
artifact, and run as a user runs it (a fresh process: `run --no-spec`, 16 new tokens; `serve` with 4 sequences
of 2048 positions and one request). Peak RSS: `wait4` / VmHWM. KV: what the process allocates (run: the
prompt and the new tokens; serve: its sequences x 2048 positions, fp32). w8a8's weight bytes: one byte a
linear weight plus a scale per 32, the embedding in fp32. Never asserted in a test; figures in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import free_port  # noqa: E402
from startup import PROMPT, SPECPACK, timed_run, timed_server  # noqa: E402

MiB = 2 ** 20
# name -> (hidden, layers, heads, kv heads, intermediate, vocab, tied): "1b" is TinyLlama-1.1B's decoder with
# SmolLM2's vocabulary (its tokenizer drives the run)
SHAPES = {"1b": (2048, 22, 32, 4, 5632, 49152, False)}


def random_target(out: Path, shape: tuple, tokenizer_from: Path) -> Path:
    """A Llama checkpoint of `shape` with random fp32 weights (written once), SmolLM2's tokenizer files."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    hidden, layers, heads, kv_heads, inter, vocab, tied = shape
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                      architectures=["LlamaForCausalLM"], torch_dtype="float32")
    hd, gen = hidden // heads, torch.Generator().manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen) * 0.02

    state = {"model.embed_tokens.weight": randn(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    if not tied:
        state["lm_head.weight"] = randn(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": randn(heads * hd, hidden),
                      p + "self_attn.k_proj.weight": randn(kv_heads * hd, hidden),
                      p + "self_attn.v_proj.weight": randn(kv_heads * hd, hidden),
                      p + "self_attn.o_proj.weight": randn(hidden, heads * hd),
                      p + "mlp.gate_proj.weight": randn(inter, hidden), p + "mlp.up_proj.weight": randn(inter, hidden),
                      p + "mlp.down_proj.weight": randn(hidden, inter),
                      p + "input_layernorm.weight": torch.ones(hidden),
                      p + "post_attention_layernorm.weight": torch.ones(hidden)})
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def artifact_of(target: Path, out: Path, key: Path) -> Path:
    from specpack.packager import BuildOptions, NgramParams, build

    if not (out / "specpack.json").is_file():
        build(BuildOptions(target=target, drafter="ngram", out=out, key=key, force=True, ngram=NgramParams(1, 4, 8)))
    return out


def weight_bytes(manifest: dict, weights: str) -> int:
    t, fp32 = manifest["target"], manifest["memory"]["target_weight_bytes"]
    embed = t["vocab_size"] * t["hidden_size"] * 4
    tied = t.get("tie_word_embeddings", False)
    linear = fp32 - embed  # the head included (its own tensor, or the tied embedding packed again)
    if tied:
        linear += embed
    return fp32 if weights == "fp32" else embed + linear // 4 * 34 // 32  # int8 values and fp32 scales per 32


def measure(artifact: Path, pub: Path, weights: str, slots: int, max_new: int) -> dict:
    manifest = json.loads((artifact / "specpack.json").read_text())
    kv_token = manifest["memory"]["target_kv_bytes_per_token"]
    run = [*SPECPACK, "run", str(artifact), "--trust-key", str(pub), "--prompt", PROMPT, "--max-new-tokens",
           str(max_new), "--weights", weights, "--no-spec"]
    port = free_port()
    serve = [*SPECPACK, "serve", str(artifact), "--trust-key", str(pub), "--weights", weights, "--port", str(port),
             "--model-name", "m", "--max-seqs", str(slots), "--max-model-len", "2048"]
    w = weight_bytes(manifest, weights)
    r, s = timed_run(run), timed_server(serve, "m", port, max_new)
    return {"weights_mib": w / MiB,
            "run": {**r, "kv_mib": kv_token * (64 + max_new) / MiB},  # the prompt (under 64 tokens) and the new ones
            "serve": {**s, "kv_mib": kv_token * 2048 * slots / MiB}}


def prepare_all(shapes: list[str]) -> tuple[dict, str]:
    """({shape: artifact}, the public key): SmolLM2's n-gram artifact and each random shape's."""
    from specpack.demo import cache_dir, prepare, target_dir

    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    cache = cache_dir()
    smollm2, pub = prepare(cache, say)
    artifacts = {}
    for shape in shapes:
        if shape == "smollm2":
            artifacts[shape] = str(smollm2)
            continue
        target = random_target(cache / f"random-llama-{shape}", SHAPES[shape], target_dir(cache, say))
        artifacts[shape] = str(artifact_of(target, cache / f"random-llama-{shape}-ngram", cache / "demo-signer.pem"))
    return artifacts, str(pub)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2,1b", help=f"smollm2 and/or {', '.join(SHAPES)}")
    ap.add_argument("--weights", default="fp32", help="comma-separated: fp32, w8a8, ...")
    ap.add_argument("--slots", type=int, default=4, help="serve's sequences (--max-seqs)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # the child that writes the artifacts
    args = ap.parse_args()
    if args.prepare:
        print(json.dumps(prepare_all(args.shapes.split(","))))
        return 0
    # the artifacts are made in a child: a process's peak RSS counts what its parent held when it forked
    # (Linux keeps the pre-exec high-water mark), so this one must stay small
    made = subprocess.run([sys.executable, __file__, "--prepare", "--shapes", args.shapes], check=True,
                          stdout=subprocess.PIPE, text=True).stdout
    artifacts, pub = json.loads(made)
    rows = {}
    for shape, artifact in artifacts.items():
        artifact = Path(artifact)
        for weights in args.weights.split(","):
            print(f"measuring {shape} {weights}", file=sys.stderr)
            rows[f"{shape} {weights}"] = measure(artifact, Path(pub), weights, args.slots, args.max_new_tokens)
    print(f"\n{'':16s}{'weights MiB':>12s}{'command':>9s}{'KV MiB':>9s}{'peak RSS MiB':>14s}{'RSS / (W + KV)':>16s}"
          f"{'(RSS - 340) / (W + KV)':>24s}")
    for name, row in rows.items():
        for command in ("run", "serve"):
            r = row[command]
            base = row["weights_mib"] + r["kv_mib"]
            print(f"{name:16s}{row['weights_mib']:12.0f}{command:>9s}{r['kv_mib']:9.0f}{r['peak_rss_mib']:14.0f}"
                  f"{r['peak_rss_mib'] / base:16.2f}{(r['peak_rss_mib'] - 340) / base:24.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
