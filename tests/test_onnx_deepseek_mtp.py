"""ONNX export of DeepSeek-V3 targets (MLA's latent cache, MoE routing in the graph) and of MTP
drafters (one graph per layer): checked graphs, logits equal to the torch backend's (fp32, <= 1e-4),
and greedy speculative output on ONNX Runtime identical to torch's, token for token."""

import functools
import json

import pytest
import torch

import eagle_fixtures as ef
import mtp_layouts as ml
import tiny
from eagle_fixtures import one_thread  # noqa: F401
from specpack.exports.onnx import ONNX_DIR, export_onnx, read_index
from specpack.packager import BuildOptions, NgramParams, build
from specpack.packager.artifact import read_manifest
from specpack.runtime.models.rows import Rows, Segment
from specpack.runtime.spec_model import SpecModel
from specpack.runtime.drafters.base import DraftJob
from test_onnx import TOL, both, steps_match

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

DEEPSEEK = {  # as DeepSeek-V3 ships (YaRN, q LoRA, interleaved rope dims), and plain RoPE with q_proj
    "yarn-qlora": {},
    "rope-q_proj": {"q_lora_rank": None, "rope_interleave": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}
# (layout, MTP layers, training steps): trained layers get drafts accepted, so rollbacks run too
MTP = {"mimo-1": ("mtp-mimo", 1, 80), "mimo-2": ("mtp-mimo", 2, 80), "deepseek-1": ("mtp-deepseek", 1, 40)}


@functools.lru_cache(maxsize=None)
def deepseek_artifact(variant: str):
    """A 3-layer DeepSeek-V3 target (layer 0 dense, 1-2 MoE) with an n-gram drafter, exported."""
    root = ef.session_dir(f"ds-{variant}-")
    ml.build_deepseek(3, **DEEPSEEK[variant]).save_pretrained(root / "target", safe_serialization=True)
    tiny.make_tokenizer(root / "target")
    art = build(BuildOptions(target=root / "target", drafter="ngram", out=root / "art",
                             ngram=NgramParams(1, 3, 4))).out
    export_onnx(art, progress=False)
    return art


@functools.lru_cache(maxsize=None)
def mtp_artifact(name: str):
    """(MtpTarget, exported artifact) of a case of `MTP`; layer reuse on, so any draft length runs."""
    layout, n, steps = MTP[name]
    root = ef.session_dir(f"mtp-{name}-")
    t = ml.make_target(root, layout, n, train_steps=steps)
    art = build(BuildOptions(target=t.path, drafter="mtp", out=root / "art", mtp_allow_reuse=True)).out
    export_onnx(art, progress=False)
    return t, art


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, tiny.VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


# ---- DeepSeek-V3 targets ----

@pytest.mark.parametrize("variant", list(DEEPSEEK))
def test_deepseek_export_is_checked_with_latent_cache_and_routing(variant):
    art = deepseek_artifact(variant)
    path = art / ONNX_DIR / "target.onnx"
    onnx.checker.check_model(str(path))
    graph = read_index(art).graph("target_step")
    cfg = json.loads((art / "config.json").read_text())
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    past = [(t.name, t.shape) for t in graph.inputs if t.name.startswith("past_")]
    assert past == [(f"past_latent.{i}", ["N", width]) for i in range(3)]  # the whole buffer
    assert [t.name for t in graph.outputs if t.name.startswith("new_")] == [f"new_latent.{i}" for i in range(3)]
    assert {"TopK", "NonZero", "ScatterElements"} <= ops(path)  # routed, not dense over the experts
    assert read_manifest(art).exports.onnx.graphs == [graph]


@pytest.mark.parametrize("variant", list(DEEPSEEK))
def test_deepseek_logits_match_torch(variant):
    (ref, _), (ort, _) = both(deepseek_artifact(variant))
    steps_match(ref, ort, ids(13))


def test_deepseek_greedy_speculative_identical():
    (tt, td), (ot, od) = both(deepseek_artifact("yarn-qlora"))
    ref, ort = SpecModel(tt, td), SpecModel(ot, od)
    accepted = 0
    for i in range(3):
        p = ids(7 + i, seed=i) * 2  # a repeat, so n-gram drafts get accepted
        plain = ref.generate(p, 40, speculative=False, eos_ids=()).tokens
        want, got = ref.generate(p, 40, draft_len=2 + i, eos_ids=()), ort.generate(p, 40, draft_len=2 + i, eos_ids=())
        assert got.tokens == want.tokens == plain, i
        assert got.stats.position_accepted == want.stats.position_accepted, i
        accepted += got.stats.accepted
    assert accepted > 0


# ---- MTP drafters ----

@pytest.mark.parametrize("name", list(MTP))
def test_mtp_export_is_checked_and_indexed(name):
    t, art = mtp_artifact(name)
    index = read_index(art)
    assert [(g.role, g.path, g.layer) for g in index.graphs] == [("target_step", f"{ONNX_DIR}/target.onnx", None)] + [
        ("mtp_step", f"{ONNX_DIR}/mtp.{k}.onnx", k) for k in range(t.n)]
    for g in index.graphs:
        onnx.checker.check_model(str(art / g.path))
    drafter = read_manifest(art).drafter
    assert index.target_hidden == drafter.target_hidden_state
    assert [o.name for o in index.graph("target_step").outputs][:2] == ["logits", "hidden"]
    cache = ["past_latent"] if t.layout == "mtp-deepseek" else ["past_key", "past_value"]
    assert [i.name for i in index.graph("mtp_step").inputs] == \
        ["hidden", "tokens", "positions", "logits_index", "seq_rows", "row_place", "cache_rows", "mask", *cache]
    assert read_manifest(art).exports.onnx == index


@pytest.mark.parametrize("name", list(MTP))
@torch.inference_mode()  # as `propose` runs the layers (the torch drafter's buffers are inference tensors)
def test_mtp_layer_logits_match_torch(name):
    """The target state MTP layer 0 reads, then each layer's graph against the torch layer on the same
    inputs: over the prompt rows (empty cache), then T=3 and T=1 more rows after them."""
    t, art = mtp_artifact(name)
    (tt, td), (ot, od) = both(art)
    ctx, P = torch.tensor(ids(20)), 11
    for target, drafter in ((tt, td), (ot, od)):
        target.setup_cache(32)
        drafter.reset(32)
        feats = target(ctx[:P], capture=drafter.capture_layers).aux
        drafter._absorb(DraftJob(0, ctx[: P + 1], feats, 1, None))
    assert (od.outs[0, 0, :P] - td.outs[0, 0, :P]).abs().max() <= TOL
    h = torch.cat([td.outs[0, 0, :P], torch.randn(4, tt.spec.hidden_size, generator=torch.Generator().manual_seed(0))])
    for k in range(t.n):
        for start, end in ((0, P), (P, P + 3), (P + 3, P + 4)):
            tokens = ctx[start + k + 1 : end + k + 1]  # one step ahead per layer
            rows = Rows.of([Segment(0, start, end - start)])
            (want, want_logits), (got, got_logits) = (d._run_layer(k, h[start:end], tokens, rows) for d in (td, od))
            assert (got_logits - want_logits).abs().max() <= TOL, (k, start)
            assert (got - want).abs().max() <= TOL, (k, start)


@pytest.mark.parametrize("name", list(MTP))
def test_mtp_greedy_speculative_identical(name):
    """specpack.load(..., backend="onnxruntime") drafts and decodes as the torch backend, token for
    token, with the same drafts accepted at the same positions."""
    import specpack

    t, art = mtp_artifact(name)
    ref, ort = (specpack.load(art, backend=b) for b in ("torch", "onnxruntime"))
    seqs = ef.greedy_sequences(ml.hf_target(t), ef.training_prompts(n=3), 12)
    lengths = []
    for i in range(3):
        p = seqs[i, : 8 + i % 5].tolist()
        plain = ref.generate(p, 24, speculative=False, eos_ids=()).tokens
        for d in sorted({1, t.n, t.n + 2}):
            want, got = ref.generate(p, 24, draft_len=d, eos_ids=()), ort.generate(p, 24, draft_len=d, eos_ids=())
            assert got.tokens == want.tokens == plain, (i, d)
            assert got.stats.position_accepted == want.stats.position_accepted, (i, d)
            lengths.append(got.stats.acceptance_length)
    assert sum(lengths) / len(lengths) > 1.4, lengths


def test_cli_run_mtp_on_onnxruntime_equals_torch(cli):
    _, art = mtp_artifact("deepseek-1")
    runs = {}
    for backend in ("torch", "onnxruntime"):
        code, out, err = cli("run", art, "--prompt", "def add(a, b):", "--max-new-tokens", "16", "--draft-len", "3",
                             "--backend", backend, "--json")
        assert code == 0, err
        runs[backend] = json.loads(out)
    assert runs["onnxruntime"]["token_ids"] == runs["torch"]["token_ids"]
    assert runs["onnxruntime"]["steps"] == runs["torch"]["steps"]
