"""The small-M linear kernel: a linear layer, rows independent bit for bit, and a clean fallback."""

import logging
import multiprocessing
import threading

import pytest
import torch
import torch.nn.functional as F

from specpack.runtime.kernels import linear as kl


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Each test sees the environment it sets, and leaves the loaded library as it found it."""
    monkeypatch.delenv("SPECPACK_KERNELS", raising=False)
    monkeypatch.delenv("SPECPACK_KERNEL_THREADS", raising=False)
    yield
    kl._library.cache_clear()


@pytest.fixture
def kernel():
    if not kl.available():
        pytest.skip(f"fast linear kernel unavailable: {kl.unavailable_reason()}")
    return kl


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


def test_rows_bit_identical_for_every_m_and_thread_count(kernel):
    """Row i of an M-row product == the 1-row product of row i, bit for bit, at any thread count:
    what makes verifying 8 drafts give the same logits as decoding them one by one."""
    torch.manual_seed(0)
    for N, K in [(1000, 576), (576, 1536), (83, 40)]:
        w = torch.randn(N, K)
        x = torch.randn(16, K)
        packed = kernel.pack(w, threads=1)
        single = torch.cat([packed(x[i:i + 1]) for i in range(16)])
        for threads in (1, 2, 3):
            packed.threads = threads
            packed._parallel = True  # force the pool even on small weights
            for M in range(1, 17):
                assert torch.equal(packed(x[:M]), single[:M]), (N, K, M, threads)
                assert torch.equal(packed(x[16 - M:]), single[16 - M:]), (N, K, M, threads)


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


def test_pool_works_after_fork(kernel):
    torch.manual_seed(3)
    w, x = torch.randn(2048, 576), torch.randn(4, 576)
    packed = kernel.pack(w, threads=2)
    packed._parallel = True
    want = packed(x)  # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, packed, x))  # forked: nothing pickled
    p.start()
    got = q.get(timeout=20)
    p.join(timeout=20)
    assert got == want.numpy().tobytes()


def test_disabled_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("SPECPACK_KERNELS", "0")
    assert not kl.available()
    assert "SPECPACK_KERNELS" in kl.unavailable_reason()
    w, b, x = torch.randn(30, 20), torch.randn(30), torch.randn(5, 20)
    packed = kl.pack(w, b)
    assert packed.backend == "torch"
    assert torch.equal(packed(x), F.linear(x, w, b))
    out = torch.empty(5, 30)
    assert packed(x, out=out) is out and torch.equal(out, F.linear(x, w, b))


def test_build_failure_is_logged_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    kl._library.cache_clear()
    kl._log_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=kl.__name__):
        assert not kl.available()
    assert "building the kernel failed" in kl.unavailable_reason()
    assert "unavailable" in caplog.text
    assert kl.pack(torch.randn(4, 4)).backend == "torch"
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind


def test_missing_compiler(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    kl._library.cache_clear()
    assert not kl.available() and "no C compiler" in kl.unavailable_reason()


def _build_in_child(q):
    kl._library.cache_clear()
    lib, why = kl._library()
    q.put(why or lib.sp_abi_version())


def test_concurrent_first_builds_agree(kernel, tmp_path, monkeypatch):
    """Processes compiling into an empty cache at once all load a whole library (temp + rename)."""
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(q,)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=20)
    assert results == [2, 2, 2]
    assert [p.name for p in tmp_path.rglob("*.so")] == ["specpack_kernels.so"]  # temp files renamed or gone
    kl._library.cache_clear()
    torch.manual_seed(0)
    w, x = torch.randn(70, 30), torch.randn(3, 30)
    assert within_tolerance(kl.pack(w)(x), x, w)  # the library they built works here too
