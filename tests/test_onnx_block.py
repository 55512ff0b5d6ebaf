"""Block drafters (DFlash, DSpark, LiLiCorr) as ONNX graphs: the graphs on ONNX Runtime draft what the
torch drafter drafts (tokens and confidences, greedy and sampled, alone and batched, every
algorithm in both layouts and every optional binding); a built artifact exports, lists and signs
them, and `specpack.load(ART, backend="onnxruntime")` decodes greedy output equal to torch's and
to plain decoding; the TensorRT adapters run the same graphs (through ONNX Runtime standing in for
TensorRT's engines)."""

import functools

import pytest
import torch

import block_layouts as bl
import eagle_fixtures as ef
import tiny
from eagle_fixtures import one_thread  # noqa: F401
from specpack.exports.onnx import ONNX_DIR, OPSET, export_onnx, read_index
from specpack.packager import BuildOptions, build, verify
from specpack.runtime import backends
from specpack.runtime.drafters.base import DraftJob, TreeShape
from specpack.runtime.spec_model import SpecModel, load_target
from test_runtime_block import VARIANTS, features, head, sampler, sequence

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")



@functools.cache
def llama():
    return load_target(ef.target_dir("llama")), tiny.build_model("llama")


@functools.cache
def drafters(variant: str):
    """(torch BlockDrafter, OrtBlock over its exported graphs) of a random head of `variant`."""
    from specpack.exports.onnx import block
    from specpack.exports.onnx.pipeline import DATA_NAME, write_graphs
    from specpack.runtime.backends.graph_block import block_files
    from specpack.runtime.backends.onnxruntime_backend import OrtBlock
    from specpack.runtime.drafters.block import load_block
    from specpack.schemas.exports import OnnxExport

    root = ef.session_dir(f"block-graphs-{variant}-")
    head_dir = head(root / "head", variant)
    torch_drafter = load_block(None, head_dir, llama()[0])
    entries = write_graphs(block.graphs(torch_drafter), root / "g", prefix="g")
    index = OnnxExport(opset=OPSET, data_file=f"g/{DATA_NAME}", max_verify_tokens=17, drafter_kind="block",
                       exporter="test", graphs=entries)
    return torch_drafter, OrtBlock(root, index, *block_files(head_dir), threads=1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_graphs_draft_as_the_torch_drafter(variant):
    """Rounds of one sequence (the context grows by several rows, by one, ...), greedy and sampled,
    then three sequences in one call: the same tokens and confidences as torch."""
    hf = llama()[1]
    ref, ort = drafters(variant)
    seq = sequence(hf, 5)
    feats, N = features(hf, seq), ref.spec.draft_slots
    seen = set()
    for seed in (None, 11):
        for d in (ref, ort):
            d.reset(64)
        committed = 0
        for n, k in ((9, N), (12, 2), (13, N), (17, N + 2)):
            want, got = (d.propose(seq[:n], feats[committed : n - 1], k, sampler(seed)) for d in (ref, ort))
            committed = n - 1
            assert got.tokens.tolist() == want.tokens.tolist(), (variant, seed, n)
            if want.confidence is None:
                assert got.confidence is None
            else:
                torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=1e-5)
            seen.update(want.tokens.tolist())
    assert len(seen) > 1  # not a constant
    seqs = [sequence(hf, s) for s in (1, 2, 3)]
    for d in (ref, ort):
        d.reserve(4, 64)
    drafts = []
    for d in (ref, ort):
        jobs = [DraftJob(slot, s[:n], features(hf, s)[: n - 1], k, sampler(7) if slot == 0 else None)
                for slot, s, n, k in zip((3, 0, 2), seqs, (9, 14, 11), (N, 2, 3))]
        for job in jobs:
            d.start(job.slot)
        drafts.append(d.draft(jobs))
    assert [x.tokens.tolist() for x in drafts[1]] == [x.tokens.tolist() for x in drafts[0]]


# ---- built artifacts ----

LAYOUTS = {"zlab-dflash": ("dflash", "fill_in"), "deepseek-dflash": ("dflash", "anchor_first"),
           "deepspec-dspark": ("dspark", "anchor_first"), "nemotron35-dspark": ("dspark", "fill_in"),
           "lilicorr": ("lilicorr", "fill_in")}


@functools.cache
def artifact(layout: str, key=None):
    root = ef.session_dir(f"block-onnx-{layout}-")
    target = tiny.make_target(root / "target", "llama", num_hidden_layers=8)
    head_dir = bl.write(layout, root / "head", target)
    art = build(BuildOptions(target=target, drafter=str(head_dir), out=root / "art", key=key)).out
    export_onnx(art, key=key, progress=False)
    return art


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_on_onnxruntime_decodes_as_torch_and_plain(layout):
    import specpack

    art = artifact(layout)
    index = read_index(art)
    assert [g.role for g in index.graphs] == ["target_step", "block_context", "block_step"]
    manifest = verify(art).manifest
    assert (manifest.drafter.algorithm, manifest.drafter.query_layout) == LAYOUTS[layout]
    assert index.aux_layer_ids == list(manifest.drafter.target_features.layer_ids)
    ort, ref = specpack.load(art, backend="onnxruntime"), specpack.load(art)
    assert ort.drafter.kind == "block" and type(ort.drafter).__name__ == "OrtBlock"
    for i, p in enumerate([[5, 9, 14, 3, 22, 7] * 3, [40, 41, 42, 43] * 4, [100, 7, 100, 7, 12, 30]]):
        plain = ref.generate(p, 16, speculative=False, eos_ids=()).tokens
        want, got = (m.generate(p, 16, draft_len=1 + 2 * i, eos_ids=()) for m in (ref, ort))
        assert got.tokens == want.tokens == plain, (layout, i)
        assert got.stats.position_accepted == want.stats.position_accepted
        if ort.drafter.tree_drafts:  # DFlash and DSpark trees (LiLiCorr drafts chains)
            want, got = (m.generate(p, 16, draft_len=3, eos_ids=(), tree=TreeShape(2, 5)) for m in (ref, ort))
            assert got.tokens == want.tokens == plain, (layout, i, "tree")
            assert got.stats.position_accepted == want.stats.position_accepted


def test_signed_export_lists_the_block_graphs(tmp_path, keypair):
    root = tmp_path
    target = tiny.make_target(root / "target", "llama", num_hidden_layers=8)
    head_dir = bl.write("deepspec-dspark", root / "head", target)
    art = build(BuildOptions(target=target, drafter=str(head_dir), out=root / "art", key=keypair.private)).out
    written = export_onnx(art, key=keypair.private, progress=False)
    assert sorted(p.name for p in written) == ["block_context.onnx", "block_step.onnx", "index.json", "target.onnx",
                                               "weights.bin"]
    listed = {f.path for f in verify(art, keypair.public).manifest.files}
    assert {f"{ONNX_DIR}/{p.name}" for p in written} <= listed
    step = read_index(art).graph("block_step")
    B = verify(art).manifest.drafter.block_size
    assert [i.name for i in step.inputs][:7] == ["tokens", "positions", "logits_index", "seq_rows", "cache_rows",
                                                 "seen", "past_key.0"]
    assert step.inputs[3].shape == ["B", B] and [o.name for o in step.outputs] == ["hidden", "logits"]


def test_tensorrt_adapters_run_the_block_graphs():
    """TrtTarget and TrtBlock over graph runners (ONNX Runtime standing in for TensorRT's engines):
    the same tokens as torch, context rows written through the aligned staging buffer, prefills in
    chunks, the step engine's one profile sized by the block."""
    from test_tensorrt_backend import target_engine

    from specpack.runtime.backends import tensorrt_backend as trtb
    from specpack.runtime.backends.graph_block import block_files
    from specpack.runtime.models.weights import target_spec

    art = artifact("lilicorr")
    index, cpu = read_index(art), torch.device("cpu")
    graphs = index.graph("block_context"), index.graph("block_step")
    engine, block_engines = target_engine(art, index.graph("target_step")), [target_engine(art, g) for g in graphs]
    target = trtb.TrtTarget(engine, index.graph("target_step"), target_spec(art), index.aux_layer_ids, cpu,
                            torch.float32, prefill_chunk=5)
    drafter = trtb.TrtBlock(tuple(block_engines), graphs, *block_files(art / "drafter"), cpu, torch.float32,
                            prefill_chunk=5)
    ref, got = SpecModel(*backends.load("torch", art, verify(art).manifest)), SpecModel(target, drafter)
    for i, p in enumerate([[5, 9, 14, 3, 22, 7] * 3, [40, 41, 42, 43] * 4]):
        want, have = ref.generate(p, 16, draft_len=2 + i, eos_ids=()), got.generate(p, 16, draft_len=2 + i, eos_ids=())
        assert have.tokens == want.tokens and have.stats.position_accepted == want.stats.position_accepted
    assert max(block_engines[0].calls) <= 5 and len(block_engines[1].calls) > 0  # the prompt's context in chunks
    assert drafter.caches[0].store[0].data_ptr() % trtb.ALIGN == drafter.caches[0].store[1].data_ptr() % trtb.ALIGN
    B = verify(art).manifest.drafter.block_size
    assert block_engines[1].used  # each step call fit the step engine's one profile
    (step,) = trtb.profile_ranges("block_step", 17, 8, 64, 512, block_len=B, max_sequences=3)
    shapes = trtb.profile_shapes(graphs[1].inputs, step)
    assert shapes["tokens"] == [[B], [3 * B], [3 * B]] and shapes["logits_index"] == [[1], [3 * min(8, B)], [3 * B]]
    assert shapes["seq_rows"] == [[1, B], [3, B], [3, B]] and shapes["seen"][2] == [3, 511]
    assert shapes["past_key.0"][2][0] == 3 * (512 + trtb.ALIGN)  # every slot's buffer
    decode, prefill = trtb.profile_ranges("block_context", 17, 8, 64, 512)
    ctx = trtb.profile_shapes(graphs[0].inputs, prefill)
    assert ctx["feats"][2][0] == 64 and trtb.profile_shapes(graphs[0].inputs, decode)["positions"][2] == [17]
    assert trtb.engine_paths("ART", trtb.EngineKey(role="block_step", tensorrt_version="10.9.0", gpu_name="x",
                                                   gpu_arch="sm_90", dtype="float16", profiles=[],
                                                   onnx_sha256="ab" * 32))[0].name == "block_step-float16.plan"


def test_an_export_whose_step_graph_runs_one_sequence_is_refused():
    """A block export made before the step graph took many sequences: a clear error naming the fix."""
    from specpack.errors import InputError
    from specpack.runtime.backends.graph_block import GraphBlock, block_files

    art = artifact("lilicorr")
    index = read_index(art)
    step = index.graph("block_step")
    old = step.model_copy(update={"inputs": [i for i in step.inputs if i.name not in ("seq_rows", "seen")]})
    with pytest.raises(InputError, match="runs one sequence a call") as exc:
        GraphBlock(*block_files(art / "drafter"), index.graph("block_context"), old, torch.device("cpu"),
                   torch.float32)
    assert "--force" in exc.value.hint
