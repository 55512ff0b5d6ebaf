"""The small-M linear kernel at every weight precision (fp32, fp16, bf16, int8, w8a8): a linear layer,
rows independent bit for bit, and a clean fallback."""

import json
import logging
import multiprocessing
import threading

import pytest
import torch
import torch.nn.functional as F

from specpack.runtime.kernels import linear as kl
from specpack.runtime.kernels.tuning import pack


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Each test sees the environment it sets, and leaves the loaded library as it found it."""
    monkeypatch.delenv("SPECPACK_KERNELS", raising=False)
    monkeypatch.delenv("SPECPACK_KERNELS_PREBUILT", raising=False)
    monkeypatch.delenv("SPECPACK_KERNEL_THREADS", raising=False)
    yield
    kl._library.cache_clear()


@pytest.fixture
def kernel():
    """kernels/linear.py with the tuned `pack` (kernels/tuning.py lays weights out with this machine's settings)."""
    import types

    if not kl.available():
        pytest.skip(f"fast linear kernel unavailable: {kl.unavailable_reason()}")
    return types.SimpleNamespace(**vars(kl), pack=pack)


def within_tolerance(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b=None) -> bool:
    """|y - exact| <= 1e-5 of the magnitude sum |x| @ |w|^T (+|b|): fp32 rounding, any order."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    return bool(((y.double() - exact).abs() <= 1e-5 * scale + 1e-30).all())


@pytest.mark.parametrize("N, K", [(16, 16), (960, 576), (37, 5), (100, 130), (17, 1), (5, 0), (1, 700)])
def test_matches_f_linear(kernel, N, K):
    torch.manual_seed(N * 1000 + K)
    w, b = torch.randn(N, K), torch.randn(N)
    for bias in (None, b):
        packed = kernel.pack(w, bias)
        assert packed.backend == "avx2"
        for M in (1, 3, 8, 9, 16, 17, 40):
            x = torch.randn(M, K)
            y = packed(x)
            assert y.shape == (M, N) and y.dtype == torch.float32
            assert within_tolerance(y, x, w, bias), (M, N, K)
            torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-4, atol=1e-4 * (K ** 0.5))


@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int8", "w8a8"])
def test_rows_bit_identical_for_every_m_and_thread_count(kernel, weights):
    """Row i of an M-row product == the 1-row product of row i, bit for bit, at any thread count
    and panel grouping: what makes verifying 8 drafts give the same logits as decoding them one by one."""
    torch.manual_seed(0)
    for N, K in [(1000, 576), (576, 1536), (83, 40), (64, 33)]:
        w = torch.randn(N, K)
        x = torch.randn(16, K)
        packed = kernel.pack(w, threads=1, weights=weights)
        single = torch.cat([packed(x[i:i + 1]) for i in range(16)])
        for threads, group, prefetch, isa in ((1, 1, 0, 0), (2, 4, 64, 3), (3, 1, 256, 1), (2, 1, 128, 2)):
            packed.threads, packed.group, packed.prefetch, packed.isa = threads, group, prefetch, isa
            packed._parallel = True  # force the pool even on small weights
            for M in range(1, 17):
                assert torch.equal(packed(x[:M]), single[:M]), (N, K, M, threads, group, isa)
                assert torch.equal(packed(x[16 - M:]), single[16 - M:]), (N, K, M, threads, group, isa)


@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int8", "w8a8"])
def test_avx512_tiles_give_the_avx2_bits(kernel, weights):
    """The AVX-512 tiles (one zmm a row, up to 12 rows a tile) compute each column's chain exactly
    as the AVX2 tiles do: the same bits for every M, with bias, residual and a partial last panel, so
    which tile set a machine's tuning picks never changes an output."""
    if not kernel._library()[0].sp_avx512():
        pytest.skip("this CPU has no AVX-512: the isa setting falls back to AVX2")
    torch.manual_seed(1)
    for N, K in [(1000, 576), (83, 40), (64, 33), (48, 1536)]:
        w, b = torch.randn(N, K), torch.randn(N)
        packed = kernel.pack(w, b, threads=2, weights=weights)
        packed._parallel = True
        for M in (1, 2, 3, 7, 12, 13, 16, 24, 40, 100):
            x, res = torch.randn(M, K), torch.randn(M, N)
            got = {}
            for isa in (0, 1, 2, 3):  # bit 0: 1-2 row slabs on AVX-512, bit 1: 3+ row slabs
                for group in (1, 4):
                    packed.isa, packed.group = isa, group
                    got[isa, group] = (packed(x), packed(x, residual=res))
            for key, (y, yr) in got.items():
                assert torch.equal(y, got[0, 1][0]) and torch.equal(yr, got[0, 1][1]), (N, K, M, key)
        packed.isa = 3  # past 16 rows each panel pair runs over all rows at once: still row for row
        x = torch.randn(100, K)
        assert torch.equal(packed(x), torch.cat([packed(x[i : i + 1]) for i in range(100)])), (N, K)


@pytest.mark.parametrize("weights, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_weights_are_the_fp32_kernel_on_the_rounded_weights(kernel, weights, dtype):
    """fp16/bf16 panels widen exactly and go through the fp32 kernel's chain: bit-identical results."""
    torch.manual_seed(4)
    for N, K in [(960, 576), (37, 5), (100, 130), (17, 1)]:
        w, b = torch.randn(N, K), torch.randn(N)
        half, rounded = kernel.pack(w, b, weights=weights), w.to(dtype).float()
        assert half.weight.dtype == dtype and half.weight.numel() * 2 <= (N + 15) // 16 * 16 * K * 2
        assert torch.equal(half.dense(), rounded)
        ref = kernel.pack(rounded, b)
        for M in (1, 2, 7, 9, 17):
            x = torch.randn(M, K)
            assert torch.equal(half(x), ref(x)), (weights, N, K, M)


def test_int8_blocks_are_q8_0(kernel):
    """Per 32 k and column, scale = amax / 127 and q = round(w / scale): every weight within half a
    step of its value; the product within fp32 rounding of F.linear on the dequantized weight."""
    torch.manual_seed(5)
    for N, K in [(960, 576), (37, 5), (100, 130), (17, 1), (48, 64)]:
        w, b = torch.randn(N, K), torch.randn(N)
        w[0, :] = 0  # an all-zero block: scale 0, no NaN
        packed = kernel.pack(w, b, weights="int8")
        assert packed.weight.shape == ((N + 15) // 16, (K + 31) // 32, 576)
        dense = packed.dense()
        blocks = F.pad(w, (0, -K % 32)).view(N, -1, 32)
        step = (blocks.abs().amax(-1, keepdim=True) / 127).expand_as(blocks).reshape(N, -1)[:, :K]
        assert ((dense - w).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all()
        assert not dense[0].any()
        for M in (1, 3, 9, 17):
            x = torch.randn(M, K)
            assert within_tolerance(packed(x), x, dense, b), (N, K, M)


def test_w8a8_is_q8_0_weights_times_q8_0_activations(kernel):
    """w8a8: the int8 format's weights (the same Q8_0 blocks), and each row rounded to int8 blocks
    of 32 too (scale amax / 127, half to even); the product is the exact integer sum per block,
    scaled and summed in block order: the torch reference `w8a8_linear` gives the same numbers, and
    the VNNI tiles (isa 1-3) the same bits as the portable C path (isa 0)."""
    torch.manual_seed(7)
    x = torch.tensor([[0.5, -1.0, 0.25, 127.0, 63.5, -63.5, 0.0, 2.0]])
    q, d = kernel.quantize_rows(x)
    assert torch.equal(d, torch.tensor([[1.0]])) and q[0, 0, :8].tolist() == [0, -1, 0, 127, 64, -64, 0, 2]
    for N, K in [(960, 576), (37, 5), (100, 130), (17, 1), (64, 33), (5, 0)]:
        w, b = torch.randn(N, K), torch.randn(N)
        packed = kernel.pack(w, b, threads=2, weights="w8a8")
        packed._parallel = True
        assert torch.equal(packed.dense(), kernel.pack(w, weights="int8").dense())
        values = kernel.q8_values(packed.weight, "w8a8")
        for M in (1, 2, 3, 9, 17):
            x = torch.randn(M, K) * torch.rand(M, 1) * 4
            got = {}
            for isa in (0, 1, 2, 3):
                packed.isa = isa
                got[isa] = packed(x)
            assert all(torch.equal(y, got[0]) for y in got.values()), (N, K, M)
            torch.testing.assert_close(got[0], kernel.w8a8_linear(x, *values, b, N), rtol=1e-6, atol=1e-6)
            exact = F.linear(x, w, b)
            assert (got[0] - exact).abs().max() <= 0.05 * exact.abs().max() + 1e-6, (N, K, M)


@pytest.mark.parametrize("weights", ["fp32", "fp16", "bf16", "int8", "w8a8"])
def test_residual_is_added_last_bit_for_bit(kernel, weights):
    """linear(x, residual=r) == r + linear(x), bit for bit (the decoder's residual adds, fused)."""
    torch.manual_seed(6)
    for N, K in [(576, 576), (37, 70), (64, 1536)]:
        packed = kernel.pack(torch.randn(N, K), torch.randn(N), weights=weights)
        for M in (1, 2, 5, 17):
            x, r = torch.randn(M, K), torch.randn(M, N)
            assert torch.equal(packed(x, residual=r), r + packed(x)), (N, K, M)
        with pytest.raises(TypeError):
            packed(x, residual=torch.randn(M, N + 1))


def test_layouts_and_out(kernel):
    torch.manual_seed(1)
    w = torch.randn(50, 64)
    packed = kernel.pack(w)
    x3 = torch.randn(2, 3, 64)
    ref = torch.cat([packed(r[None]) for r in x3.reshape(6, 64)]).reshape(2, 3, 50)
    assert torch.equal(packed(x3), ref)                                  # leading dims
    xt = torch.randn(64, 6).T                                            # non-contiguous rows
    assert torch.equal(packed(xt), torch.cat([packed(r[None]) for r in xt]))
    out = torch.full((2, 3, 50), float("nan"))
    assert packed(x3, out=out) is out and torch.equal(out, ref)
    with pytest.raises(TypeError):
        packed(torch.randn(2, 63))
    with pytest.raises(TypeError):
        packed(torch.randn(2, 64, dtype=torch.float64))


def test_packed_layout_is_panels_and_about_the_weight_size(kernel):
    w = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    panels = kernel.pack_panels(w)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0], w[:16].T)
    assert torch.equal(panels[1, :, :4], w[16:].T) and not panels[1, :, 4:].any()


def test_threads_from_python_threads_at_once(kernel):
    """Callers racing for the pool: the loser runs on its own thread, results unchanged."""
    torch.manual_seed(2)
    w, x = torch.randn(2048, 576), torch.randn(8, 576)
    packed = kernel.pack(w, threads=2)
    want = packed(x)
    results = []
    threads = [threading.Thread(target=lambda: results.extend(packed(x) for _ in range(20)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 60 and all(torch.equal(r, want) for r in results)


def _child(q, packed, x):
    q.put(packed(x).numpy().tobytes())


def _in_forked_child(packed, x) -> tuple[bytes, int]:
    """packed(x)'s bytes as a forked child computes them (forked: nothing pickled), and its exit code."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, packed, x))
    p.start()
    got = q.get(timeout=20)
    p.join(timeout=20)
    return got, p.exitcode


def test_pool_works_after_fork(kernel):
    torch.manual_seed(3)
    w, x = torch.randn(2048, 576), torch.randn(4, 576)
    packed = kernel.pack(w, threads=2)
    packed._parallel = True
    want = packed(x)  # the parent's pool is running
    assert _in_forked_child(packed, x)[0] == want.numpy().tobytes()


def test_disabled_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("SPECPACK_KERNELS", "0")
    assert not kl.available()
    assert "SPECPACK_KERNELS" in kl.unavailable_reason()
    w, b, x = torch.randn(30, 20), torch.randn(30), torch.randn(5, 20)
    packed = pack(w, b)
    assert packed.backend == "torch"
    assert torch.equal(packed(x), F.linear(x, w, b))
    out = torch.empty(5, 30)
    assert packed(x, out=out) is out and torch.equal(out, F.linear(x, w, b))


def test_w8a8_fallback_is_the_kernel_arithmetic(monkeypatch):
    """Without the kernel, w8a8 keeps its packed blocks and runs the same integer arithmetic in torch."""
    torch.manual_seed(8)
    w, b, x, r = torch.randn(30, 40), torch.randn(30), torch.randn(5, 40), torch.randn(5, 30)
    want = pack(w, b, weights="w8a8")(x) if kl.available() else None
    monkeypatch.setenv("SPECPACK_KERNELS", "0")
    packed = pack(w, b, weights="w8a8")
    assert packed.backend == "torch" and packed.weight.dtype == torch.uint8
    y = packed(x)
    assert torch.equal(y, kl.w8a8_linear(x, *kl.q8_values(packed.weight, "w8a8"), b, 30))
    assert torch.equal(packed(x, residual=r), r + y)
    if want is not None:
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weights", ["fp16", "bf16", "int8"])
def test_fallback_keeps_the_precision(monkeypatch, weights):
    """Without the kernel, F.linear runs on an fp32 copy of the weight as the kernel would round it."""
    monkeypatch.setenv("SPECPACK_KERNELS", "0")
    w, b, x, r = torch.randn(30, 40), torch.randn(30), torch.randn(5, 40), torch.randn(5, 30)
    packed = pack(w, b, weights=weights)
    assert packed.backend == "torch" and packed.weight.dtype == torch.float32
    dense = kl.unpack(kl.packed_panels(w, weights), weights, 30, 40)
    assert torch.equal(packed.weight, dense) and not torch.equal(dense, w)
    assert torch.equal(packed(x), F.linear(x, dense, b))
    assert torch.equal(packed(x, residual=r), r + F.linear(x, dense, b))


def test_build_failure_is_logged_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPECPACK_KERNELS_PREBUILT", "0")  # as on a machine where pip built none
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    kl._library.cache_clear()
    kl._log_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=kl.__name__):
        assert not kl.available()
    assert "building the kernel failed" in kl.unavailable_reason()
    assert "unavailable" in caplog.text
    assert pack(torch.randn(4, 4)).backend == "torch"
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind


def test_missing_compiler(monkeypatch):
    monkeypatch.setenv("SPECPACK_KERNELS_PREBUILT", "0")
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    kl._library.cache_clear()
    assert not kl.available() and "no C compiler" in kl.unavailable_reason()


@pytest.mark.skipif(kl._lib._prebuilt() is None, reason="no current install-time build here (setup.py)")
def test_install_time_build_serves_a_machine_without_a_compiler(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    kl._library.cache_clear()
    assert kl.available() and kl._library()[0]._name == str(kl._lib.prebuilt_path())


def test_a_stale_install_time_build_is_not_used(kernel, monkeypatch, tmp_path):
    """A library built from other sources (an editable install edited since) is compiled anew."""
    stale = tmp_path / "_native.so"
    kl._lib._compile(kl._lib.shutil.which("cc"), stale)  # SP_SOURCE_HASH of these sources...
    stale.write_bytes(stale.read_bytes().replace(kl._lib.source_hash().encode(), b"0" * 16))  # ...but older
    monkeypatch.setattr(kl._lib, "prebuilt_path", lambda: stale)
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path / "cache"))
    kl._library.cache_clear()
    assert kl.available() and kl._library()[0]._name != str(stale)
    assert list((tmp_path / "cache").rglob("specpack_kernels.so"))


def _build_in_child(q):
    kl._library.cache_clear()
    lib, why = kl._library()
    q.put(why or lib.sp_abi_version())


def test_concurrent_first_builds_agree(kernel, tmp_path, monkeypatch):
    """Processes compiling into an empty cache at once all load a whole library (temp + rename)."""
    monkeypatch.setenv("SPECPACK_KERNELS_PREBUILT", "0")
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(q,)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=20)
    assert results == [5, 5, 5]  # sp_abi_version: every child loaded a whole library
    assert [p.name for p in tmp_path.rglob("*.so")] == ["specpack_kernels.so"]  # temp files renamed or gone
    kl._library.cache_clear()
    torch.manual_seed(0)
    w, x = torch.randn(70, 30), torch.randn(3, 30)
    assert within_tolerance(pack(w)(x), x, w)  # the library they built works here too


def test_settings_are_measured_once_per_cpu_model_and_cached(kernel, tmp_path, monkeypatch):
    """The first pack of a format on a machine measures the candidate settings (a short stream
    here), caches the fastest per CPU model, and later processes read it back; results never change."""
    from specpack.runtime.kernels import tuning

    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECPACK_KERNEL_TUNE", "1")
    monkeypatch.setattr(tuning, "SHAPE", (256, 128))
    monkeypatch.setattr(tuning, "_l3_bytes", lambda: 1 << 20)
    monkeypatch.setattr(tuning, "MIN_STREAM", 1 << 20)
    monkeypatch.setattr(tuning, "REPS", 1)
    monkeypatch.setattr(tuning, "BUSY_SHARE", 1.0)  # cached however busy the machine is (the next test: not)
    tuning._tuned.cache_clear()
    try:
        torch.manual_seed(7)
        w, x = torch.randn(100, 64), torch.randn(3, 64)
        want = kernel.pack(w, weights="bf16", threads=1)
        want.group, want.prefetch = 4, 128
        packed = kernel.pack(w, weights="bf16")  # measures now
        cache = (tmp_path / "kernels" / "tuning.json").read_text()
        entry = next(v for k, v in json.loads(cache).items() if k.endswith("|bf16"))
        assert tuning._valid(entry["settings"]) and entry["ms_one_row"] > 0
        assert (packed.group, packed.prefetch) == (entry["settings"]["group"], entry["settings"]["prefetch"])
        assert packed.isa == kernel.isa_bits(entry["settings"])
        assert torch.equal(packed(x), want(x))
        tuning._tuned.cache_clear()
        monkeypatch.setattr(tuning, "measure", lambda *a, **k: pytest.fail("measured again"))
        assert tuning.settings("bf16") == entry["settings"]  # read back from the cache
    finally:
        tuning._tuned.cache_clear()
        tuning._lib.set_tuned_threads(None)


def test_fewer_threads_are_chosen_only_when_clearly_faster():
    from specpack.runtime.kernels import tuning

    c = [{"group": 4, "threads": 2}, {"group": 4, "threads": 1}, {"group": 1, "threads": 2}]
    assert tuning._fastest(c, {0: 10.5, 1: 10.0, 2: 12.0}, 2) == c[0]  # 5% faster: noise, all cores kept
    assert tuning._fastest(c, {0: 11.5, 1: 10.0, 2: 12.0}, 2) == c[1]  # 15% faster: one thread
    assert tuning._fastest(c, {0: 10.0, 1: 9.0, 2: 9.5}, 2) == c[2]  # the fastest on every core


def test_attention_takes_the_most_threads_any_weight_format_was_tuned_to(kernel):
    """The greedy screen's w8a8 head is tuned after a model's own format: a single-thread choice for
    it must not become the thread count of the kernels without weights (test_fused_layers: nor of
    the model's fused layers)."""
    from specpack.runtime.kernels import _lib

    cores = _lib.cores()
    try:
        _lib.set_tuned_threads(None)
        _lib.set_tuned_threads(cores)
        _lib.set_tuned_threads(1)  # the format tuned last
        assert _lib.default_threads() == cores
    finally:
        _lib.set_tuned_threads(None)


def test_tuning_off_keeps_the_defaults(kernel, monkeypatch):
    from specpack.runtime.kernels import tuning

    monkeypatch.setenv("SPECPACK_KERNEL_TUNE", "0")
    assert tuning.settings("int8") == dict(tuning.DEFAULTS, threads=tuning._lib.cores())


def test_a_cpu_without_avx2_is_told_which_path_runs_and_how_fast(monkeypatch, caplog):
    """No AVX2/F16C (ARM, old x86): a warning names torch's F.linear and its measured rate here;
    int8 weights still compute with the int8-rounded values there."""
    from specpack.runtime.kernels import tuning
    from specpack.runtime.kernels.accelerate import use_cpu_kernels

    monkeypatch.setattr(kl._lib, "_cpu_problem", lambda: "CPU lacks avx2, f16c")
    monkeypatch.setattr(tuning, "SHAPE", (256, 128))
    kl._library.cache_clear()
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    threads = torch.get_num_threads()
    with caplog.at_level(logging.WARNING):
        assert use_cpu_kernels(model) == 0 and isinstance(model[0], torch.nn.Linear)
        assert use_cpu_kernels(model, "int8") == 1
    torch.set_num_threads(threads)
    assert "CPU lacks avx2, f16c" in caplog.text and "run torch's F.linear" in caplog.text
    assert "GB/s of fp32 weights at one row here" in caplog.text
    assert model[0].packed.backend == "torch"


def test_the_kernels_build_wherever_they_can(monkeypatch, tmp_path):
    """On a CPU that can run them with a C compiler present, the sources must compile: a build error
    would otherwise only show as every kernel test skipping and torch's slower path running."""
    import os
    import shutil

    if kl._lib._cpu_problem() or not shutil.which(os.environ.get("CC", "cc")):
        pytest.skip("no AVX2/FMA/F16C Linux CPU with a C compiler here")
    monkeypatch.setenv("SPECPACK_KERNELS_PREBUILT", "0")  # compile the sources as they are now
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path))
    kl._library.cache_clear()
    assert kl.available(), kl.unavailable_reason()


def test_argmax_rows_is_torch_argmax(kernel):
    """The greedy pick in C gives torch.argmax's index for every row: the first of equal maxima, a NaN
    above everything (the first NaN), rows of -inf, lengths around the 32-wide vector loop."""
    from specpack.runtime.kernels.argmax import argmax_rows

    torch.manual_seed(9)
    for n in (1, 7, 31, 32, 33, 95, 4096, 49152):
        rows = [torch.randn(n), torch.randint(-2, 3, (n,)).float(), torch.full((n,), float("-inf")),
                torch.zeros(n)]
        nan = torch.randn(n)
        nan[n // 2] = float("nan")
        nan[-1] = float("nan")
        late = torch.randint(-2, 3, (n,)).float()
        late[-1] = 9.0  # the maximum in the tail past the vector loop
        x = torch.stack(rows + [nan, late])
        assert argmax_rows(x) == x.argmax(-1).tolist(), n
        assert argmax_rows(x[:, : max(1, n // 2)]) == x[:, : max(1, n // 2)].argmax(-1).tolist(), n  # row stride > n


def test_w8a8_without_vnni_says_int8_is_the_fast_choice(kernel, monkeypatch, caplog):
    """On a CPU without AVX-512 VNNI, w8a8 still runs (the AVX2 tiles, the same bits) and says so."""
    from torch import nn

    from specpack.runtime.kernels import accelerate

    class NoVnni:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            return getattr(self._lib, name)

        def sp_vnni(self):
            return 0

    lib = kernel._library()[0]
    monkeypatch.setattr(kernel._lib, "_library", lambda: (NoVnni(lib), ""))
    with caplog.at_level(logging.WARNING, logger=accelerate.__name__):
        assert accelerate.use_cpu_kernels(nn.Sequential(nn.Linear(64, 64)), "w8a8") == 1
    assert "no AVX-512 VNNI" in caplog.text and "--weights int8" in caplog.text


def test_w8a8_amx_tiles_give_the_vnni_bits(kernel):
    """AMX (where the CPU and kernel allow it) computes w8a8's integer block sums for slabs of 3+
    rows; they are exact, and folded as the VNNI tiles fold them: the same bits for every row count,
    panel grouping, bias and residual, each row what it is alone."""
    lib = kernel._library()[0]
    if not lib.sp_amx():
        pytest.skip("no AMX here (CPU, kernel permission, compiler or SPECPACK_AMX=0)")
    torch.manual_seed(4)
    for N, K in [(1000, 576), (576, 1536), (83, 40), (64, 33), (48, 1536)]:
        w, b = torch.randn(N, K), torch.randn(N)
        packed = kernel.pack(w, b, threads=2, weights="w8a8")
        packed._parallel, packed.isa = True, 3  # 3+ row slabs on the VNNI (or AMX) tiles
        for M in (3, 5, 9, 13, 16, 17, 40):
            x, res = torch.randn(M, K), torch.randn(M, N)
            try:
                lib.sp_w8a8_amx(0)
                vnni = packed(x, residual=res)
            finally:
                lib.sp_w8a8_amx(1)
            amx = packed(x, residual=res)
            assert torch.equal(amx, vnni), (N, K, M)
            assert torch.equal(amx, torch.cat([packed(x[i : i + 1], residual=res[i : i + 1]) for i in range(M)]))
    # a forked child (its tile state may start reset) computes the same
    got, exitcode = _in_forked_child(packed, x)
    assert got == packed(x).numpy().tobytes() and exitcode == 0


AFTER_TORCH_AMX = """
import torch
from specpack.runtime.kernels import linear as kl
torch.manual_seed(0)
w, x = torch.randn(256, 512), torch.randn(8, 512)
products = [pack(w, weights=f) for f in ("w8a8", kl.BF16_TILES if kl.bf16_tiles() else "w8a8")]
before = [p(x) for p in products]
torch.randn(64, 512, dtype=torch.bfloat16) @ torch.randn(512, 512, dtype=torch.bfloat16)  # oneDNN
assert all(torch.equal(p(x), y) for p, y in zip(products, before))
"""


def test_amx_kernels_run_after_torchs_own_amx_products(kernel):
    """torch's bf16 matmuls on the CPU (oneDNN) use AMX themselves and release the tiles afterwards:
    the thread that called them must load its tile configuration again before its next tile
    instruction, not take it as still loaded (that was an illegal instruction, the process killed by
    SIGILL). In a child process, so such a crash fails this test rather than the run."""
    import subprocess
    import sys

    if not kernel._library()[0].sp_amx():
        pytest.skip("no AMX here (CPU, kernel permission, compiler or SPECPACK_AMX=0)")
    done = subprocess.run([sys.executable, "-c", AFTER_TORCH_AMX], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@pytest.fixture
def tiles(kernel):
    if not kernel.bf16_tiles():
        pytest.skip("no AMX-BF16 tiles here (CPU, kernel permission, compiler or SPECPACK_AMX=0)")
    return kernel


def test_bf16_tiles_are_row_exact_and_near_the_exact_product(tiles):
    """bf16 on AMX tiles: each row what it is alone, bit for bit, at any thread count, row count, bias
    and residual (with a partial last panel and K not a multiple of 32); within 1e-5 of the magnitude
    sum of the exact product of the activations and the rounded weights (the activations carry 16
    significant bits); the weights are the bf16 kernel's, laid out in pairs."""
    torch.manual_seed(5)
    for N, K in [(1000, 576), (576, 1536), (83, 40), (64, 33), (17, 1)]:
        w, b = torch.randn(N, K), torch.randn(N)
        packed = tiles.pack(w, b, threads=2, weights="bf16-amx")
        rounded = tiles.unpack(packed.weight, "bf16-amx", N, K)
        assert torch.equal(rounded, tiles.unpack(tiles.pack(w, weights="bf16").weight, "bf16", N, K))
        x, res = torch.randn(40, K), torch.randn(40, N)
        single = torch.cat([packed(x[i : i + 1], residual=res[i : i + 1]) for i in range(40)])
        assert within_tolerance(single - res, x, rounded, b), (N, K)
        for threads in (1, 2, 3):
            packed.threads, packed._parallel = threads, True
            for M in (1, 2, 3, 9, 13, 16, 17, 40):
                assert torch.equal(packed(x[:M], residual=res[:M]), single[:M]), (N, K, M, threads)
    # a forked child (its tile state may start reset) computes the same
    got, exitcode = _in_forked_child(packed, x)
    assert got == packed(x).numpy().tobytes() and exitcode == 0


def test_bf16_tiles_are_refused_where_they_do_not_run(kernel, monkeypatch):
    monkeypatch.setattr(kl, "bf16_tiles", lambda: False)
    with pytest.raises(TypeError, match="AMX-BF16"):
        kernel.pack(torch.randn(16, 32), weights="bf16-amx")


def test_bf16_asked_for_runs_on_tiles_but_the_head_and_narrowed_layers_do_not(tiles):
    """`--weights bf16` puts every linear layer but the vocabulary head (which the greedy screen
    recomputes columns of in the vector kernel's arithmetic) on the tiles; an fp32 model whose layers
    hold bf16 values keeps the vector kernel, whose bits are fp32's."""
    from torch import nn

    from specpack.runtime.kernels import accelerate

    def model():
        m = nn.Module()
        m.proj, m.lm_head = nn.Linear(64, 64), nn.Linear(64, 100)
        return m

    asked = model()
    assert accelerate.use_cpu_kernels(asked, "bf16") == 2
    assert (asked.proj.packed.weights, asked.lm_head.packed.weights) == ("bf16-amx", "bf16")
    narrowed = model()
    with torch.no_grad():
        narrowed.proj.weight.copy_((narrowed.proj.weight * 1e6).bfloat16().float())  # beyond fp16's range
    accelerate.use_cpu_kernels(narrowed, "fp32")
    assert narrowed.proj.packed.weights == "bf16"


def test_settings_measured_on_a_busy_machine_are_used_but_not_cached(kernel, tmp_path, monkeypatch, caplog):
    from specpack.runtime.kernels import tuning

    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECPACK_KERNEL_TUNE", "1")
    chosen = dict(tuning.DEFAULTS, threads=1)
    monkeypatch.setattr(tuning, "measure", lambda weights: {"settings": chosen, "busy": 0.6})
    tuning._tuned.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert tuning.settings("int8") == chosen
        assert "other work took 60% of the CPU" in caplog.text and "not cached" in caplog.text
        assert not (tmp_path / "kernels" / "tuning.json").exists()
    finally:
        tuning._tuned.cache_clear()
        tuning._lib.set_tuned_threads(None)


def test_the_share_of_the_cpu_others_took_is_what_this_process_did_not_use():
    from specpack.runtime.kernels import tuning

    # 2 s on 2 cores: 4 CPU seconds; the machine was busy 3.5 of them, 1.5 of those this process's
    assert tuning._others_share((0.0, 10.0, 1.0), (2.0, 13.5, 2.5), 2) == 0.5
    assert tuning._others_share((0.0, 10.0, 1.0), (2.0, 11.0, 2.1), 2) == 0.0  # accounting jitter: not negative
    assert tuning._others_share((0.0, float("nan"), 0.0), (1.0, float("nan"), 1.0), 2) == 0.0
    wall, busy, own = tuning._cpu_times()
    assert wall > 0 and busy > 0 and own > 0
