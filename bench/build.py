"""Benchmark `specpack build` on a synthetic sharded target of several GB.

Prints, from one run: build time ÷ one `sha256sum` pass over the same files (goal ≤ 1.3 with hard
links: each byte hashed once), and the build's peak RSS (goal ≤ 500 MB whatever the model size).

    python bench/build.py --gb 4 --shards 4 [--copy] [--dir /tmp/specpack-bench]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROWS = 4096


def write_target(root: Path, gb: float, shards: int) -> list[Path]:
    """A Llama-shaped config plus `shards` safetensors files of float32 tensors, `gb` GB in all."""
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    per_shard = int(gb * 1e9 / shards)
    cols = 4096
    tensors_per_shard = max(1, per_shard // (ROWS * cols * 4))
    weight_map, files = {}, []
    rng = np.random.default_rng(0)
    block = rng.standard_normal((ROWS, cols), dtype=np.float32)
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"model.layers.{s * tensors_per_shard + i}.mlp.weight": block + i
                   for i in range(tensors_per_shard)}
        save_file(tensors, root / name)
        weight_map.update({k: name for k in tensors})
        files.append(root / name)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "num_hidden_layers": len(weight_map), "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0}
    (root / "config.json").write_text(json.dumps(config))
    return files


_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
         "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall time and peak RSS (bytes) of `cmd`, run under a small fresh parent so that the RSS this
    process holds is not counted against the child."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PEAK, *cmd], check=True, capture_output=True, text=True)
    return time.perf_counter() - start, int(out.stdout.split()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/specpack-bench-build"))
    ap.add_argument("--copy", action="store_true", help="copy instead of hard links")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    shutil.rmtree(args.dir, ignore_errors=True)
    target, out, keys = args.dir / "target", args.dir / "artifact", args.dir / "signer"
    files = write_target(target, args.gb, args.shards)
    total = sum(f.stat().st_size for f in files)
    subprocess.run([sys.executable, "-m", "specpack", "keygen", str(keys)], check=True,
                   stdout=subprocess.DEVNULL)
    sha_s, _ = timed(["sha256sum", *map(str, files)])  # page cache is warm for both runs
    cmd = [sys.executable, "-m", "specpack", "build", str(target), "--drafter", "ngram", "-o", str(out),
           "--key", f"{keys}.pem"] + (["--copy"] if args.copy else [])
    build_s, rss = timed(cmd)
    verify_s, _ = timed([sys.executable, "-m", "specpack", "verify", str(out), "--key", f"{keys}.pub"])
    print(f"target: {total / 1e9:.2f} GB in {len(files)} shards; mode: {'copy' if args.copy else 'hard link'}")
    print(f"sha256sum, one pass:      {sha_s:7.2f} s  ({total / sha_s / 1e9:.2f} GB/s)")
    print(f"specpack build + sign:    {build_s:7.2f} s  ratio {build_s / sha_s:.2f}  (goal <= 1.3)")
    print(f"specpack verify --key:    {verify_s:7.2f} s  ratio {verify_s / sha_s:.2f}")
    print(f"build peak RSS:           {rss / 2**20:7.1f} MiB  (goal <= 500 MiB)")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
