"""A measured cost curve is kept on this machine per artifact and load: the second start reuses it
(issue 62 point 2), a different load or a damaged file measures again, and a store that cannot be
written only costs the measurement."""

import json
import logging

import pytest


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_target):
    from specpack.packager import BuildOptions, NgramParams, build

    out = tmp_path_factory.mktemp("cost-store") / "art"
    build(BuildOptions(target=tiny_target, drafter="ngram", out=out, ngram=NgramParams(1, 3, 4)))
    return out


@pytest.fixture
def store(tmp_path, monkeypatch):
    from specpack.runtime.engine import cost

    monkeypatch.setenv("SPECPACK_COST_CACHE", "1")
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path / "cache"))
    calls = []
    measure = cost.measure
    monkeypatch.setattr(cost, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    return tmp_path / "cache" / "cost-curves", calls


def _curve(artifact, **load_options):
    from specpack.runtime.api import load

    return load(artifact, **load_options).measure_cost((1, 2, 4)).to_dict()


def test_the_second_start_reuses_the_curve(artifact, store):
    folder, calls = store
    first = _curve(artifact)
    assert calls == [1] and len(list(folder.glob("*.json"))) == 1
    assert _curve(artifact) == first and calls == [1]  # a fresh load, nothing measured


def test_a_kept_curve_prices_drafts_and_output_stays_lossless(artifact, store):
    from specpack.runtime.api import load
    from specpack.serving.generate import GenerateRequest, generate_text

    folder, calls = store
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    generate_text(artifact, GenerateRequest(prompt, max_new_tokens=4))  # measures and keeps
    model = load(artifact)
    spec = generate_text(None, GenerateRequest(prompt, max_new_tokens=24), model=model)
    plain = generate_text(None, GenerateRequest(prompt, max_new_tokens=24, speculative=False), model=model)
    assert calls == [1] and spec["cost_curve"]["rows"] == [1, 2, 4, 8] and spec["token_ids"] == plain["token_ids"]


def test_another_load_or_machine_setting_measures_again(artifact, store, monkeypatch):
    import torch

    folder, calls = store
    _curve(artifact)
    _curve(artifact, weights="int8")
    assert len(calls) == 2
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)  # the machine as torch runs it
    _curve(artifact)
    assert len(calls) == 3 and len(list(folder.glob("*.json"))) == 3


def test_a_damaged_curve_is_measured_again_and_replaced(artifact, store):
    folder, calls = store
    _curve(artifact)
    (path,) = folder.glob("*.json")
    path.write_text('{"rows": [1, 2], "ms": [')
    again = _curve(artifact)
    assert len(calls) == 2 and json.loads(path.read_text()) == again
    for hostile in ('{"rows": [1, 2, 4], "ms": ["x", 1, 1]}', '{"rows": [1, 2, 4], "ms": [-1, 1, 1e999]}'):
        path.write_text(hostile)  # times that would break or skew the pricing: measured again
        assert _curve(artifact) == json.loads(path.read_text())
    assert len(calls) == 4


def test_a_store_that_cannot_be_written_costs_only_the_measurement(artifact, store, caplog):
    folder, calls = store
    folder.parent.mkdir(parents=True)
    folder.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        _curve(artifact)
        _curve(artifact)
    assert len(calls) == 2 and "cannot keep the measured cost curve" in caplog.text


def test_switched_off_it_measures_every_time(artifact, store, monkeypatch):
    folder, calls = store
    monkeypatch.setenv("SPECPACK_COST_CACHE", "0")
    _curve(artifact)
    _curve(artifact)
    assert len(calls) == 2 and not folder.exists()
