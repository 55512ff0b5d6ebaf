"""The TensorRT backend without TensorRT: the missing-library error, engine cache keys and rebuild
rules, profile shapes, and where engines go (artifact + manifest + signature, or the user cache).

Engines are "built" by a stand-in that writes bytes: nothing here pretends to run TensorRT."""

import sys

import pytest
import torch

from specpack.exports.onnx import export_onnx, read_index
from specpack.errors import InputError, MissingDependencyError
from specpack.packager import BuildOptions, NgramParams, build, verify
from specpack.runtime.backends import SharedCaches
from specpack.runtime.backends import tensorrt_backend as trtb


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError


def test_missing_library_says_what_to_install(no_tensorrt, tmp_path, exported):
    with pytest.raises(MissingDependencyError) as exc:
        trtb.import_tensorrt()
    assert "pip install 'specpack[tensorrt]'" in exc.value.hint and "NVIDIA" in exc.value.hint
    with pytest.raises(MissingDependencyError):
        trtb.load(tmp_path, None)  # before anything else is looked at
    with pytest.raises(MissingDependencyError):
        trtb.build_engine(tmp_path / "x.onnx", None, {})
    with pytest.raises(MissingDependencyError):
        trtb.build_engines(exported)  # `specpack export ART --to tensorrt`


def test_tensorrt_11_has_no_weak_typing(monkeypatch, tmp_path):
    """TensorRT 11 dropped BuilderFlag.FP16/BF16: say so before building anything."""
    from types import SimpleNamespace

    from specpack.errors import UnsupportedError

    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__version__="11.4.0", BuilderFlag=SimpleNamespace()))
    with pytest.raises(UnsupportedError, match="BuilderFlag.FP16") as exc:
        trtb.build_engine(tmp_path / "target.onnx", _key(), {})
    assert "float32" in exc.value.hint


def _key(**over):
    base = dict(role="target_step", tensorrt_version="10.9.0", gpu_name="NVIDIA H100", gpu_arch="sm_90",
                dtype="float16", profiles=[{"tokens": [[1], [8], [17]]}], onnx_sha256="ab" * 32)
    return trtb.EngineKey(**{**base, **over})


def test_rebuild_rules():
    assert trtb.rebuild_reasons(_key(), _key()) == []
    assert trtb.rebuild_reasons(None, _key()) == ["no engine built yet"]
    for field, value in [("tensorrt_version", "10.10.0"), ("gpu_name", "NVIDIA H200"), ("gpu_arch", "sm_89"),
                         ("dtype", "bfloat16"), ("profiles", [{"tokens": [[1], [4], [9]]}]),
                         ("onnx_sha256", "cd" * 32)]:
        reasons = trtb.rebuild_reasons(_key(**{field: value}), _key())
        assert len(reasons) == 1 and reasons[0].startswith(field), reasons
    plan, sidecar = trtb.engine_paths("ART", _key())
    assert plan.as_posix() == "ART/engines/sm_90/target_step-float16.plan" and sidecar.suffix == ".json"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_target):
    art = tmp_path_factory.mktemp("trt") / "art"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=art, ngram=NgramParams(1, 3, 4)))
    export_onnx(art, progress=False)
    return art


def test_profile_shapes(exported):
    graph = read_index(exported).graph("target_step")
    decode, prefill = trtb.profile_ranges("target_step", max_verify=17, opt_tokens=8, prefill_chunk=256,
                                          max_context=512, max_sequences=4)
    shapes = trtb.profile_shapes(graph.inputs, decode)
    assert shapes["tokens"] == [[1], [32], [68]] and shapes["positions"] == shapes["tokens"]  # 4 x (8 | 17)
    assert shapes["logits_index"] == [[1], [32], [68]] and shapes["row_place"] == shapes["tokens"]
    assert shapes["seq_rows"] == [[1, 1], [4, 8], [4, 17]]  # [B, Q]
    assert shapes["cache_rows"] == [[1, 0], [4, 256], [4, 511]]  # [B, P]
    assert shapes["mask"] == [[1, 1, 1], [4, 8, 256 + 8], [4, 17, 511 + 17]]  # [B, Q, P+Q]
    kv, hd, n = 2, 16, 4 * (512 + trtb.ALIGN)  # tiny: 2 KV heads of 16; every slot's cache, padded
    assert shapes["past_key.0"] == [[1, kv, hd], [n // 2, kv, hd], [n, kv, hd]]
    assert set(shapes) == {i.name for i in graph.inputs}
    pre = trtb.profile_shapes(graph.inputs, prefill)
    assert pre["tokens"] == [[1], [256], [256]] and pre["logits_index"] == [[1], [1], [256]]
    assert pre["seq_rows"] == [[1, 1], [1, 256], [4, 256]]
    profiles = [shapes, pre]
    assert trtb.profile_for(profiles, {"tokens": (20,), "seq_rows": (4, 5), "mask": (4, 5, 300)}) == 0
    assert trtb.profile_for(profiles, {"tokens": (20,), "seq_rows": (1, 20), "mask": (1, 20, 300)}) == 1
    with pytest.raises(InputError, match="no optimization profile"):
        trtb.profile_for(profiles, {"tokens": (20,), "seq_rows": (5, 4)})  # five sequences
    head = trtb.profile_ranges("eagle3_step", 17, 8, 64, 512)
    assert head[0]["U"] == (0, 1, 17) and head[0]["R"] == (0, 0, 17) and head[1]["R"] == (0, 64, 64)


def test_onnx_digest(exported):
    manifest = verify(exported).manifest
    index = read_index(exported)
    d = trtb.onnx_digest(manifest, index.graph("target_step").path, index.data_file)
    assert len(d) == 64
    with pytest.raises(InputError, match="not listed"):
        trtb.onnx_digest(manifest, "exports/onnx/missing.onnx", index.data_file)


class FakeBuild:
    """Stands in for TensorRT's builder: counts calls, returns bytes naming the key."""

    def __init__(self):
        self.calls = []

    def __call__(self, onnx_path, key, io_dtypes):
        self.calls.append((onnx_path.name, key, io_dtypes))
        return f"plan {key.tensorrt_version} {key.dtype}".encode()


def test_engine_cached_in_unsigned_artifact(exported):
    fake, onnx_path = FakeBuild(), exported / "exports/onnx/target.onnx"
    plan = trtb.ensure_engine(exported, _key(), onnx_path, {"past_key.0": "float16"}, build=fake)
    assert plan.read_bytes() == b"plan 10.9.0 float16" and len(fake.calls) == 1
    listed = {f.path for f in verify(exported).manifest.files}  # digests of the new files check out
    assert {"engines/sm_90/target_step-float16.plan", "engines/sm_90/target_step-float16.json"} <= listed
    assert trtb.ensure_engine(exported, _key(), onnx_path, {}, build=fake) == plan and len(fake.calls) == 1
    trtb.ensure_engine(exported, _key(tensorrt_version="10.10.0"), onnx_path, {}, build=fake)  # upgrade
    assert len(fake.calls) == 2 and plan.read_bytes() == b"plan 10.10.0 float16"
    trtb.ensure_engine(exported, _key(gpu_arch="sm_89"), onnx_path, {}, build=fake)  # another GPU: both kept
    assert len(fake.calls) == 3 and plan.is_file()
    assert (exported / "engines/sm_89/target_step-float16.plan").is_file()
    verify(exported)


def test_engine_in_signed_artifact(tmp_path, tiny_target, keypair, monkeypatch):
    art = tmp_path / "art"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=art, key=keypair.private))
    export_onnx(art, key=keypair.private, progress=False)
    onnx_path, fake = art / "exports/onnx/target.onnx", FakeBuild()
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path / "cache"))
    before = (art / "specpack.json").read_bytes()
    plan = trtb.ensure_engine(art, _key(), onnx_path, {}, build=fake)  # no key: the artifact is left alone
    assert (tmp_path / "cache" / "engines") in plan.parents and (art / "specpack.json").read_bytes() == before
    assert trtb.ensure_engine(art, _key(), onnx_path, {}, build=fake) == plan and len(fake.calls) == 1
    plan = trtb.ensure_engine(art, _key(), onnx_path, {}, sign_key=keypair.private, build=fake)
    assert art in plan.parents and len(fake.calls) == 2
    verify(art, keypair.public)  # re-signed over the engine too
    assert trtb.ensure_engine(art, _key(), onnx_path, {}, build=fake) == plan  # found in the artifact first


def test_staging_and_alignment():
    """The engine writes new KV slots to an aligned staging buffer, copied into the cache buffer of
    every slot in one indexed copy."""
    assert trtb._padded(5, 2, 3 * 64) * 3 * 64 * 2 % trtb.ALIGN == 0
    assert trtb._padded(256, 4, 2 * 16) == 256
    shared = SharedCaches((4, (2, 16)), 3, trtb._padded(50, 4, 32), torch.float32, "cpu")
    assert shared.flat[1].data_ptr() % trtb.ALIGN == shared.flat[0].data_ptr() % trtb.ALIGN
    assert shared.slots[2].store[0].data_ptr() % trtb.ALIGN == shared.flat[0].data_ptr() % trtb.ALIGN
    stage = trtb._Staging(shared.slots[0], 17)
    assert all(t.data_ptr() % trtb.ALIGN == stage.buf.data_ptr() % trtb.ALIGN for t in stage.outputs(3))
    for i, t in enumerate(stage.outputs(3)):
        t.fill_(i + 1)
    L = shared.max_len
    shared.write(stage.buf[:, :3], torch.tensor([7, 8, 2 * L + 9]))  # slot 0 positions 7, 8; slot 2 position 9
    cache0, cache2 = shared.slots[0].store, shared.slots[2].store
    assert cache0[:, 7:9].flatten(1).amin(1).tolist() == [1, 2, 3, 4] and cache2[:, 9].flatten(1).amin(1).tolist() \
        == [1, 2, 3, 4]
    assert shared.flat.sum() == (1 + 2 + 3 + 4) * 3 * 32  # nothing else written
    assert cache0[:, :7].abs().sum() == 0 and shared.slots[1].store.abs().sum() == 0


class OrtAsEngine:
    """The one method TrtTarget / TrtEagle3 call on an engine, served by ONNX Runtime on the same
    graph: checks the adapters' plumbing (names, staging, chunked prefills, and that every call fits
    one of the optimization profiles TensorRT would be built with: `graph` and `ranges`), not TensorRT."""

    def __init__(self, path, graph=None, ranges=()):
        from specpack.runtime.backends.onnxruntime_backend import _Binder, session

        self.binder, self.calls, self.used, self.batches = _Binder(session(path, 1)), [], [], []
        self.profiles = [trtb.profile_shapes(graph.inputs, r) for r in ranges]

    def run(self, T, inputs, outputs):
        self.calls.append(T)
        if "seq_rows" in inputs:
            self.batches.append(inputs["seq_rows"].shape[0])
        if self.profiles:
            self.used.append(trtb.profile_for(self.profiles, {n: t.shape for n, t in inputs.items()}))
        self.binder.run(inputs, outputs)


def target_engine(art, graph, max_sequences: int = 1, chunk: int = 5, max_verify: int = 3):
    """An `OrtAsEngine` for the target graph with the profiles of an engine for `max_sequences`
    sequences verifying up to `max_verify` rows each, prefilling in chunks of `chunk`."""
    block_len = graph.inputs[3].shape[1] if graph.role == "block_step" else None  # seq_rows [B, block_len]
    return OrtAsEngine(art / graph.path, graph, trtb.profile_ranges(graph.role, max_verify, 2, chunk, 64, block_len,
                                                                      max_sequences=max_sequences))


def test_trt_adapters_decode_as_torch():
    """TrtTarget and TrtEagle3 over graph runners: the same tokens and accepted drafts as torch."""
    from test_onnx import exported, prompts

    from specpack.runtime import backends
    from specpack.runtime.backends import eagle3_files
    from specpack.families.dense import load_target_spec
    from specpack.runtime.spec_model import SpecModel

    art = exported("llama", "eagle3")
    manifest = verify(art).manifest
    index = read_index(art)
    engine, head_engine = target_engine(art, index.graph("target_step")), target_engine(art, index.graph("eagle3_step"))
    cpu = torch.device("cpu")
    target = trtb.TrtTarget(engine, index.graph("target_step"), load_target_spec(art), index.aux_layer_ids, cpu,
                            torch.float32, prefill_chunk=5)
    head = trtb.TrtEagle3(head_engine, index.graph("eagle3_step"), *eagle3_files(art), cpu, torch.float32,
                          prefill_chunk=5)
    ref = SpecModel(*backends.load("torch", art, manifest))
    got = SpecModel(target, head)
    for i, p in enumerate(prompts("llama", 3)):
        want, have = ref.generate(p, 24, draft_len=2 + i, eos_ids=()), got.generate(p, 24, draft_len=2 + i, eos_ids=())
        assert have.tokens == want.tokens and have.stats.position_accepted == want.stats.position_accepted
    assert max(engine.calls) <= 5 and max(head_engine.calls) <= 5  # prompts of 8+ tokens went in chunks
    assert set(engine.used) == {0, 1}  # 3 verified rows in the decode profile; 4-5 and prefill chunks in the other
    assert set(head_engine.used) == {0, 1}  # draft steps in the decode profile; the prompt's features in chunks
    assert target.cache.max_len * 2 * 16 * 4 % trtb.ALIGN == 0  # padded so every layer's slots start aligned


def test_trt_adapters_run_mtp_over_latent_caches():
    """TrtTarget and TrtMtp over graph runners on a DeepSeek-V3 target and its MTP layer: MLA's latent
    cache staged and chunked as KV pairs are, the target's hidden state handed to the MTP engine."""
    from test_onnx_deepseek_mtp import ids, mtp_artifact

    from specpack.runtime import backends
    from specpack.runtime.backends import mtp_files
    from specpack.runtime.spec_model import SpecModel
    from specpack.runtime.models.weights import target_spec

    _, art = mtp_artifact("deepseek-1")
    index, cpu = read_index(art), torch.device("cpu")
    graph, layers = index.graph("target_step"), index.graphs_of("mtp_step")
    engine, layer_engines = target_engine(art, graph), [target_engine(art, g) for g in layers]
    target = trtb.TrtTarget(engine, graph, target_spec(art), None, cpu, torch.float32, prefill_chunk=5)
    drafter = trtb.TrtMtp(layer_engines, layers, mtp_files(art), target, cpu, torch.float32, prefill_chunk=5)
    ref, got = SpecModel(*backends.load("torch", art, verify(art).manifest)), SpecModel(target, drafter)
    for i in range(3):
        p = ids(8 + 2 * i, seed=i)
        for d in (1, 3):
            want, have = ref.generate(p, 16, draft_len=d, eos_ids=()), got.generate(p, 16, draft_len=d, eos_ids=())
            assert have.tokens == want.tokens and have.stats.position_accepted == want.stats.position_accepted
    assert max(engine.calls) <= 5 and max(layer_engines[0].calls) <= 5  # prompts of 8+ tokens went in chunks
    assert set(layer_engines[0].used) == {0, 1}  # committed rows and chains; prompts in the prefill profile
    width = layers[0].inputs[-1].shape[1]
    decode = trtb.profile_ranges("mtp_step", 17, 8, 64, 512, max_sequences=4)[0]
    shapes = trtb.profile_shapes(layers[0].inputs, decode)
    n = 4 * (512 + trtb.ALIGN)
    assert shapes["past_latent"] == [[1, width], [n // 2, width], [n, width]]  # every slot's buffer
    assert shapes["logits_index"] == [[1], [4], [64]] and shapes["hidden"][2] == [64, target.spec.hidden_size]
    assert shapes["seq_rows"] == [[1, 1], [4, 8], [4, 17]]
    assert trtb.engine_paths("ART", _key(role="mtp_step", layer=0))[0].name == "mtp_step.0-float16.plan"


def test_trt_target_runs_many_sequences_per_call_within_its_profiles():
    """The batched engine over TrtTarget (ONNX Runtime standing in for the engine): every request's
    tokens as alone on torch; a step's sequences share calls of at most `prefill_chunk` rows, a
    long prompt's chunks go in successive calls, and more slots than the engine's sequences is refused."""
    from test_engine import drive
    from test_onnx import exported

    from specpack.runtime import backends
    from specpack.runtime.engine import Engine, Request
    from specpack.families.dense import load_target_spec
    from specpack.runtime.spec_model import SpecModel

    art = exported("llama", "ngram")
    graph, cpu = read_index(art).graph("target_step"), torch.device("cpu")
    engine = target_engine(art, graph, max_sequences=3, chunk=6, max_verify=4)
    target = trtb.TrtTarget(engine, graph, load_target_spec(art), None, cpu, torch.float32, prefill_chunk=6)
    ref = SpecModel(*backends.load("torch", art, verify(art).manifest))
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, 200, (6,), generator=g).tolist()
    prompts = [base * (1 + i % 3) + [7 + i] for i in range(5)]  # 7 to 19 tokens: chunked prefills
    reqs = [Request(p, 8 + i, eos=(), draft_len=3) for i, p in enumerate(prompts)]
    want = [ref.generate(r.prompt, r.max_new_tokens, eos_ids=(), draft_len=3).tokens for r in reqs]
    got = drive(Engine(target, ref.drafter, slots=3, max_len=48, prefill_chunk=None), {0: reqs[:3], 2: reqs[3:]})
    assert [got[i] for i in range(len(reqs))] == want
    assert max(engine.calls) <= 6 and set(engine.used) == {0, 1}
    assert max(b for b in engine.batches) == 3  # three sequences in one call
    with pytest.raises(InputError, match="at most 3 sequences"):
        target.setup_cache(48, 4)


def test_plan_calls_keeps_each_segments_pieces_in_order():
    from specpack.runtime.backends import plan_calls
    from specpack.runtime.models.rows import Rows, Segment

    rows = Rows.of([Segment(0, 0, 7), Segment(1, 4, 2), Segment(2, 9, 3)])
    calls = plan_calls(rows, 4)
    seen = [[(p.slot, p.past, p.rows.tolist()) for p in call] for call in calls]
    assert seen == [[(0, 0, [0, 1, 2, 3])], [(1, 4, [7, 8])], [(2, 9, [9, 10, 11])], [(0, 4, [4, 5, 6])]]
    assert all(sum(len(p.rows) for p in call) <= 4 for call in calls)
    (one,) = plan_calls(rows, None)
    assert [(p.slot, p.past, len(p.rows)) for p in one] == [(0, 0, 7), (1, 4, 2), (2, 9, 3)]
    assert one[1].mask.shape == (2, 6) and one[1].mask[:, :4].all() and one[1].mask[:, 4:].tril().equal(one[1].mask[:, 4:])
