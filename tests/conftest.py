import json
import os
import sys
from pathlib import Path

import pytest

import tiny

# Kernel settings stay at their defaults (they change speed, never results): no half-second
# measurement per weight format in a test run. tests/test_kernels.py measures on its own.
os.environ.setdefault("SPECPACK_KERNEL_TUNE", "0")
# Cost curves are measured fresh in every test (tests count the measurements); test_cost_store.py keeps them.
os.environ.setdefault("SPECPACK_COST_CACHE", "0")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny 8-layer Llama target (defaults aux ids 2, 4, 5 are distinct)."""
    return tiny.make_target(tmp_path_factory.mktemp("target") / "tiny-llama", "llama",
                            num_hidden_layers=8)


@pytest.fixture(scope="session")
def tiny_cfg(tiny_target):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_target)


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run the real `specpack` entry point; return (exit code, stdout, stderr)."""
    from specpack.cli import main

    def run(*args):
        capsys.readouterr()  # drop what came before (e.g. fixture progress bars)
        monkeypatch.setattr(sys, "argv", ["specpack", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code or 0
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def keypair(tmp_path_factory):
    from specpack.packager import keygen

    return keygen(tmp_path_factory.mktemp("keys") / "signer")


def read_json(path):
    return json.loads(Path(path).read_text())


def assert_decodes_incrementally(model, tokens, ref, tol: float = 1e-4) -> None:
    """`model` (a runtime decoder) fed `tokens` as a prefill of 30, single tokens up to 40, then the rest
    in one chunk gives the full forward's logits `ref`; rolling the cache back to 40 only moves the
    pointer: junk written past it is never seen."""
    import torch

    model.setup_cache(64)
    parts = [model(tokens[:30]).logits] + [model(tokens[i : i + 1]).logits for i in range(30, 40)]
    parts.append(model(tokens[40:]).logits)
    assert (torch.cat(parts) - ref).abs().max() <= tol
    model.cache.length = 40
    model(torch.randint(0, ref.shape[-1], (5,), generator=torch.Generator().manual_seed(7)))
    model.cache.length = 40
    assert (model(tokens[40:]).logits - ref[40:]).abs().max() <= tol


def measured_profile(drafter: str, draft_len: int = 3, max_concurrency: int = 8, concurrency=(1, 4, 8, 16),
                     device: str = "cuda", backend: str = "tensorrt", speedup: float = 1.7, gpu: str = "NVIDIA H100",
                     speculative: bool = True, lookup: int | None = None):
    """A validated profile as `specpack tune` writes it (figures made up, id derived), for tests that
    read profiles without measuring: speculation pays up to `max_concurrency` concurrent requests
    (with prompt lookup of up to `lookup` tokens beside the drafter)."""
    from specpack.schemas.profile import make_profile

    sweep = [{"concurrency": c, "baseline_tokens_per_s": 100.0 * c,
              "speculative_tokens_per_s": 100.0 * c * (1.5 if c <= max_concurrency else 0.8)} for c in concurrency]
    hardware = {"cpu_model": "Test CPU", "cpu_cores": 8, "memory_bytes": 2**34,
                "gpu": gpu if device == "cuda" else None, "gpu_memory_bytes": 2**36 if device == "cuda" else None}
    evidence = {"workload": {"name": "chat", "sha256": "0" * 64, "prompts": 4, "max_new_tokens": 32, "new_tokens": 128},
                "baseline_tokens_per_s": 100.0, "speculative_tokens_per_s": 100.0 * speedup, "speedup": speedup,
                "acceptance_length": 2.5, "position_acceptance": [0.8, 0.6, 0.4], "greedy_equal": True,
                "prompts_checked": 4, "draft_len_sweep": [], "concurrency_sweep": sweep if speculative else [],
                "hardware": hardware, "software": {"specpack": "0", "python": "3", "platform": "test", "packages": {}},
                "measured_at": "2026-01-01T00:00:00+00:00", "seconds": 1.0}
    settings = {"speculative": speculative, "draft_len": draft_len if speculative else 0,
                "max_concurrency": max_concurrency if speculative else 0, "lookup": lookup}
    memory = {"weights_bytes": 1, "kv_cache_bytes": 1, "context_tokens": 64, "required_bytes": 2,
              "measured_peak_bytes": 2}
    return make_profile(backend=backend, device=device, dtype="float16" if device == "cuda" else "float32",
                        drafter=drafter if speculative else "none", settings=settings, memory=memory,
                        evidence=evidence)


def with_profiles(art: Path, out: Path, *profiles) -> Path:
    """A copy of the artifact `art` at `out` holding `profiles` (stored as `specpack tune` does)."""
    import shutil

    from specpack.tuning.profiles import store_profile

    shutil.copytree(art, out)
    for p in profiles:
        store_profile(out, p)
    return out


def pytest_terminal_summary(terminalreporter):
    """The engine suite's table (tests/engines), when this run recorded rows."""
    report = sys.modules.get("engine_report")
    if report is not None and report.ROWS:
        terminalreporter.write_sep("=", f"engine rows: vLLM and llama.cpp (also in {report.REPORT})")
        terminalreporter.write_line(report.table(report.ROWS))
