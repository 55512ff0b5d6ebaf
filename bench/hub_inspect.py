"""`specpack inspect hf://` against downloading the repository (issue 61): bytes read, requests and wall time.

In ONE run, on the local hub of tests/fake_hub.py (loopback, the real huggingface_hub client):

  tiny   the tiny DeepSeek-V4-Flash-DSpark release (tests/family_fixtures.py, layout B): `inspect hf://`
         (range requests), then `build hf:// --drafter bundled` (downloads what the artifact carries) and a
         plain download of the whole repository (snapshot_download), each timed;
  full   a real-size header set: DeepSeek-V3 (671B, bf16, 61 layers + its MTP layer, 256 experts; the
         public config) in 48 shards whose headers are written at full size and whose weights are left
         sparse (the hub serves zeros): `inspect hf://` reads every header and checks every tensor; the
         download is not run (1.3 TB), its time is stated at the --bandwidth given.

    .venv/bin/python bench/hub_inspect.py [--bandwidth 1e9]

Loopback has no latency: on the real hub each request costs a round trip (~20-100 ms), so the requests
column is what a real network multiplies.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (its quantization_config left out: bf16 here)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1}


def full_size_shards(shards: int = 48) -> tuple[dict, dict]:
    """({shard: (header bytes, file size)}, the index) of DeepSeek-V3 in bf16 (router biases F32), every
    tensor named and shaped as its family reads it (layer 61: the MTP layer), split into `shards`."""
    from specpack.families.deepseek import deepseek_spec_from_config, layer_tensor_shapes, target_tensor_shapes

    spec = deepseek_spec_from_config(DEEPSEEK_V3)
    shapes = target_tensor_shapes(spec)
    p = f"model.layers.{spec.num_layers}."
    shapes.update(layer_tensor_shapes(spec, p, spec.is_moe(spec.num_layers)))
    H, V = spec.hidden_size, spec.vocab_size
    shapes.update({p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                   p + "shared_head.norm.weight": (H,), p + "shared_head.head.weight": (V, H),
                   p + "embed_tokens.weight": (V, H)})
    names = sorted(shapes, key=lambda n: (int(n.split(".")[2]) if n.startswith("model.layers.") else -1, n))
    dtype = {n: "F32" if n.endswith("e_score_correction_bias") else "BF16" for n in names}
    nbytes = {n: math.prod(shapes[n]) * (4 if dtype[n] == "F32" else 2) for n in names}
    per_shard, files, weight_map, current = sum(nbytes.values()) / shards, {}, {}, []
    groups, size = [], 0
    for n in names:
        current.append(n)
        size += nbytes[n]
        if size >= per_shard and len(groups) < shards - 1:
            groups.append(current)
            current, size = [], 0
    groups.append(current)
    for i, group in enumerate(groups, 1):
        file, header, offset = f"model-{i:05d}-of-{len(groups):05d}.safetensors", {}, 0
        for n in group:
            header[n] = {"dtype": dtype[n], "shape": list(shapes[n]), "data_offsets": [offset, offset + nbytes[n]]}
            offset += nbytes[n]
            weight_map[n] = file
        raw = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        files[file] = (struct.pack("<Q", len(raw)) + raw, 8 + len(raw) + offset)
    index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
    return files, index


def _inspect(cli_runner, spec: str) -> tuple[dict, float]:
    start = time.perf_counter()
    code, out, err = cli_runner("inspect", spec, "--json")
    if code != 0:
        raise SystemExit(f"inspect {spec} failed: {err}")
    return json.loads(out), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", type=float, default=1e9, help="bytes/s a download is stated at (default 1 GB/s)")
    args = ap.parse_args()
    import os

    import huggingface_hub.constants as constants
    from click.testing import CliRunner
    from huggingface_hub import HfApi, snapshot_download

    import family_fixtures as ff
    from fake_hub import WRITE_TOKEN, FakeHub
    from specpack.cli import cli

    runner = CliRunner()

    def run(*argv):
        r = runner.invoke(cli, [str(a) for a in argv], catch_exceptions=False)
        return r.exit_code, r.stdout, r.stderr

    tmp = Path(tempfile.mkdtemp(prefix="hub-bench-"))
    constants.HF_HUB_DISABLE_XET, constants.HF_HUB_CACHE = True, str(tmp / "cache")
    os.environ.pop("HF_TOKEN", None)
    rows = []
    with FakeHub(lfs_threshold=4096) as hub:
        os.environ["HF_ENDPOINT"] = hub.url
        api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
        release = ff.deepseek_v4_dspark(ff.make("deepseek_v4", tmp / "DeepSeek-V4-Flash-DSpark"))
        api.create_repo("bench/v4-dspark")
        api.upload_folder(repo_id="bench/v4-dspark", folder_path=release)
        hub.bytes_served = 0
        d, t_inspect = _inspect(run, "hf://bench/v4-dspark")
        start = time.perf_counter()
        code, _, err = run("build", "hf://bench/v4-dspark", "--drafter", "bundled", "-o", tmp / "art", "--json")
        t_build = time.perf_counter() - start
        served_build = hub.bytes_served - d["bytes_read"]
        start, before = time.perf_counter(), hub.bytes_served
        snapshot_download("bench/v4-dspark", endpoint=hub.url, cache_dir=str(tmp / "plain"))
        t_download, served_download = time.perf_counter() - start, hub.bytes_served - before
        rows.append(("tiny V4-Flash-DSpark", d["repository_bytes"], d["bytes_read"], d["requests"], t_inspect,
                     f"build hf:// {t_build:.2f} s ({served_build:,} B); full download {t_download:.2f} s "
                     f"({served_download:,} B)"))
        files, index = full_size_shards()
        hub.add_virtual("bench/deepseek-v3", {"config.json": json.dumps(DEEPSEEK_V3).encode(),
                                              "model.safetensors.index.json": json.dumps(index).encode(), **files})
        hub.bytes_served = 0
        d, t_inspect = _inspect(run, "hf://bench/deepseek-v3")
        assert hub.bytes_served == d["bytes_read"]
        rows.append((f"DeepSeek-V3 bf16, {len(files)} shards, {len(index['weight_map']):,} tensors",
                     d["repository_bytes"], d["bytes_read"], d["requests"], t_inspect,
                     f"download at {args.bandwidth / 1e9:g} GB/s: {d['repository_bytes'] / args.bandwidth / 60:,.1f} min"))
    print("| release | repository | inspect hf:// read | share | requests | inspect wall | against it |")
    print("|---|---|---|---|---|---|---|")
    for name, size, read, requests, wall, other in rows:
        print(f"| {name} | {size / 2**20:,.1f} MiB | {read:,} B | 1/{size / read:,.0f} | {requests} | {wall:.2f} s | {other} |")


if __name__ == "__main__":
    main()
