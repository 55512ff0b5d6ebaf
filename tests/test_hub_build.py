"""`specpack build hf://org/name@rev` (issue 61 item 2), against the local hub in fake_hub.py with the real
huggingface_hub client: the tiny DeepSeek-V4-Flash-DSpark release checked by range requests, then only what
the artifact carries downloaded (not `original/`, images or GGUFs), each file checked against the hub's
sha256; the artifact equals a local build of the same files, with the commit as the target's source. A
dropped download resumes; a corrupted one is refused and evicted from the cache; a release that would be
refused downloads nothing; a cached file is not fetched again; a drafter comes from the hub too."""

import json

import pytest
from huggingface_hub import HfApi

from fake_hub import WRITE_TOKEN, FakeHub, hermetic_hub_client  # noqa: F401  (autouse here)

REPO = "deepseek-ai/v4-dspark"
EXTRAS = {"original/consolidated.safetensors": b"\0" * 9000, "figures/arch.png": b"\x89PNG" + b"\1" * 5000,
          "model-q4.gguf": b"GGUF" + b"\2" * 5000}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny V4-Flash-DSpark release (family_fixtures, layout B), and the same with the files a build does
    not carry (an original/ copy, an image, a GGUF of another precision)."""
    import shutil

    import family_fixtures as ff

    root = tmp_path_factory.mktemp("hub-build")
    release = ff.deepseek_v4_dspark(ff.make("deepseek_v4", root / "DeepSeek-V4-Flash-DSpark"))
    full = shutil.copytree(release, root / "full")
    for rel, data in EXTRAS.items():
        (full / rel).parent.mkdir(parents=True, exist_ok=True)
        (full / rel).write_bytes(data)
    return release, full


@pytest.fixture
def hub(release, monkeypatch):
    with FakeHub(lfs_threshold=4096) as h:
        api = HfApi(endpoint=h.url, token=WRITE_TOKEN)
        api.create_repo(REPO)
        api.upload_folder(repo_id=REPO, folder_path=release[1])
        h.bytes_served, h.requests[:] = 0, []
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def _manifest(art):
    return json.loads((art / "specpack.json").read_text())


def _downloaded(hub) -> set[str]:
    return {r.split("/resolve/", 1)[1].split("/", 1)[1] for r in hub.requests if "/resolve/" in r}


def test_build_hf_equals_a_local_build_of_the_files_it_carries(hub, release, tmp_path, cli):
    """What is skipped: the extras and DeepSeek's `inference/` reference code (subfolders are not the model);
    a local build of the release without them gives the same artifact, byte for byte but its source."""
    import shutil

    code, out, err = cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "remote", "--json")
    assert code == 0, err
    fetched = json.loads(out)["fetched"]["target"]
    assert set(fetched["skipped"]) == {*EXTRAS, "inference/config.json", "inference/model.py"}
    local_dir = shutil.copytree(release[1], tmp_path / "carried")
    for rel in fetched["skipped"]:
        (local_dir / rel).unlink()
    assert cli("build", local_dir, "--drafter", "bundled", "-o", tmp_path / "local")[0] == 0
    remote, local = _manifest(tmp_path / "remote"), _manifest(tmp_path / "local")
    commit = hub.repos[REPO].refs["main"]
    assert remote["target"]["source"] == {"kind": "hub", "repo_id": REPO, "revision": commit}
    same = lambda m: {f["path"]: f["sha256"] for f in m["files"] if f["path"] != "README.md"}  # noqa: E731
    assert same(remote) == same(local)
    strip = lambda m: {k: v for k, v in m.items() if k not in ("source", "files")}  # noqa: E731
    assert strip(remote["target"]) == strip(local["target"]) and strip(remote["drafter"]) == strip(local["drafter"])
    assert remote["drafter"]["source"] == remote["target"]["source"]  # the stages are the release's own
    for f in remote["files"]:  # byte for byte
        assert (tmp_path / "remote" / f["path"]).read_bytes() == (tmp_path / "local" / f["path"]).read_bytes() \
            or f["path"] in ("README.md", "specpack.json")
    assert not _downloaded(hub) & set(EXTRAS)  # never requested (inference/config.json is read by the checks)  # nothing of what is not carried was requested


def test_a_cached_file_is_not_fetched_again(hub, tmp_path, cli):
    assert cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "a")[0] == 0
    first, hub.bytes_served = hub.bytes_served, 0
    assert cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "b")[0] == 0
    assert hub.bytes_served < first / 20  # the range reads of the check; no file again


def test_a_dropped_download_resumes_where_it_stopped(hub, release, tmp_path, cli, monkeypatch):
    """The connection drops halfway through the largest shard: the download goes on from the last chunk
    written (huggingface_hub's resume; its 10 MB chunks made 64 KB so that this tiny shard spans several)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    shard = max((p for p in release[0].glob("*.safetensors")), key=lambda p: p.stat().st_size).name
    assert cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "clean")[0] == 0
    clean = hub.bytes_served
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "other-cache"))
    hub.bytes_served, hub.faults[shard] = 0, "drop_download_once"
    code, _, err = cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "dropped")
    assert code == 0, err
    assert shard not in hub.faults  # it was dropped once
    resumed = [r for r in hub.requests if r.endswith("-]") and shard in r]
    assert len(resumed) == 1 and clean <= hub.bytes_served < clean + 64 * 1024, (hub.bytes_served, clean)
    files = lambda art: [f for f in _manifest(art)["files"] if f["path"] != "README.md"]  # noqa: E731  (names the dir)
    assert files(tmp_path / "dropped") == files(tmp_path / "clean")


def test_a_corrupted_download_is_refused_and_evicted(hub, release, tmp_path, cli):
    shard = sorted(p.name for p in release[0].glob("*.safetensors"))[0]
    hub.faults[shard] = "corrupt"
    code, _, err = cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "art")
    assert code == 2 and "the hub lists" in err and shard in err and not (tmp_path / "art").exists(), err
    del hub.faults[shard]
    code, _, err = cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "art")
    assert code == 0, err  # the bad copy was removed from the cache and fetched again


def test_a_release_that_would_be_refused_downloads_nothing(hub, tmp_path, cli):
    """Its target holds no MTP layers: refused from its headers, before any file is downloaded."""
    import huggingface_hub.constants as constants
    from pathlib import Path

    code, _, err = cli("build", f"hf://{REPO}", "--drafter", "mtp", "-o", tmp_path / "art")
    assert code == 2 and "MTP" in err and "nothing was downloaded" in err and not (tmp_path / "art").exists(), err
    assert all(r.endswith("]") for r in hub.requests if "/resolve/" in r)  # range reads only
    assert not any(r.startswith("HEAD") for r in hub.requests) and not Path(constants.HF_HUB_CACHE).exists()


def test_a_drafter_from_the_hub(tiny_target, tmp_path, cli, monkeypatch):
    """`--drafter hf://org/head`: an EAGLE-3 head fetched, verified, and recorded by its commit."""
    import eagle_layouts
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_target)
    head = eagle_layouts.write_official(tmp_path / "head", eagle_layouts.random_head(cfg), cfg)
    with FakeHub(lfs_threshold=4096) as hub:
        HfApi(endpoint=hub.url, token=WRITE_TOKEN).create_repo("org/head")
        HfApi(endpoint=hub.url, token=WRITE_TOKEN).upload_folder(repo_id="org/head", folder_path=head)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        code, _, err = cli("build", tiny_target, "--drafter", "hf://org/head", "-o", tmp_path / "art")
        commit = hub.repos["org/head"].refs["main"]
    assert code == 0, err
    assert _manifest(tmp_path / "art")["drafter"]["source"] == {"kind": "hub", "repo_id": "org/head", "revision": commit}


def test_a_gated_release_says_how_to_get_access(hub, tmp_path, cli):
    hub.gated[REPO] = set()
    code, _, err = cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "art")
    assert code == 2 and "gated" in err and "HF_TOKEN" in err and "accept its terms" in err, err
    assert not (tmp_path / "art").exists()


def test_an_index_naming_a_shard_the_repository_lacks_is_refused(tmp_path, cli, monkeypatch):
    """A sharded release whose index names a shard that was never uploaded: refused from the listing,
    nothing downloaded."""
    import huggingface_hub.constants as constants
    from pathlib import Path

    import tiny

    sharded = tiny.make_target(tmp_path / "sharded", "llama", shards=3)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with FakeHub(lfs_threshold=4096) as hub:
        HfApi(endpoint=hub.url, token=WRITE_TOKEN).create_repo("org/sharded")
        HfApi(endpoint=hub.url, token=WRITE_TOKEN).upload_folder(repo_id="org/sharded", folder_path=sharded)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        for argv in (("inspect", "hf://org/sharded"), ("build", "hf://org/sharded", "--drafter", "ngram", "-o", tmp_path / "a")):
            code, _, err = cli(*argv)
            assert code == 2 and "model-00002-of-00003.safetensors" in err and "Traceback" not in err, err
    assert not Path(constants.HF_HUB_CACHE).exists() and not (tmp_path / "a").exists()


def test_a_subfolder_drafter_is_fetched_and_bound(tmp_path, cli, monkeypatch):
    """MiniMax-M3.1's `dspark/` (layout C) on the hub: `build hf:// --drafter bundled` fetches the folder
    with the target and binds it as a local build of the same files does, recording the hub commit."""
    import family_fixtures as ff

    release = ff.minimax_m31_dspark(ff.make("minimax_m3_vl", tmp_path / "MiniMax-M3.1"))
    with FakeHub(lfs_threshold=4096) as hub:
        HfApi(endpoint=hub.url, token=WRITE_TOKEN).create_repo("MiniMaxAI/m31")
        HfApi(endpoint=hub.url, token=WRITE_TOKEN).upload_folder(repo_id="MiniMaxAI/m31", folder_path=release)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        code, _, err = cli("build", "hf://MiniMaxAI/m31", "--drafter", "bundled", "-o", tmp_path / "remote")
        commit = hub.repos["MiniMaxAI/m31"].refs["main"]
    assert code == 0, err
    assert cli("build", release, "--drafter", "bundled", "-o", tmp_path / "local")[0] == 0
    remote, local = _manifest(tmp_path / "remote"), _manifest(tmp_path / "local")
    source = remote["drafter"]["source"]
    assert source["kind"] == "hub" and source["revision"] == commit and source["subfolder"] == "dspark"
    assert source["files_sha256"] == local["drafter"]["source"]["files_sha256"]
    same = lambda m: {f["path"]: f["sha256"] for f in m["files"] if f["path"] != "README.md"}  # noqa: E731
    assert same(remote) == same(local)


def test_inspect_hf_checks_a_subfolder_drafter_from_its_headers(tmp_path, cli, monkeypatch):
    """`inspect hf://` runs the dspark/ folder's own checks (config and headers read by range) as `inspect DIR`
    does; a folder made for another release is refused with the same reason, and `build hf://` then
    downloads nothing."""
    import huggingface_hub.constants as constants
    from pathlib import Path

    import family_fixtures as ff

    good = ff.minimax_m31_dspark(ff.make("minimax_m3_vl", tmp_path / "good"))
    bad = ff.minimax_m31_dspark(ff.make("minimax_m3_vl", tmp_path / "bad"), rank=4)
    config = json.loads((bad / "dspark/config.json").read_text())
    config["text_config"]["dspark_markov_rank"] = 8  # the config says 8, the Markov tensors are rank 4
    (bad / "dspark/config.json").write_text(json.dumps(config))
    with FakeHub(lfs_threshold=4096) as hub:
        for name, folder in (("good", good), ("bad", bad)):
            HfApi(endpoint=hub.url, token=WRITE_TOKEN).create_repo(f"MiniMaxAI/{name}")
            HfApi(endpoint=hub.url, token=WRITE_TOKEN).upload_folder(repo_id=f"MiniMaxAI/{name}", folder_path=folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        rows = {}
        for name, folder in (("good", good), ("bad", bad)):
            code, out, err = cli("inspect", f"hf://MiniMaxAI/{name}", "--json")
            assert code == 0, err
            local = json.loads(cli("inspect", folder, "--json")[1])
            remote = json.loads(out)
            shape = lambda d: [(b["layout"], b["kind"], bool(b.get("drafter")),  # noqa: E731
                                b.get("why_not", "").split("problems)")[-1]) for b in d["bundled"]]  # where: apart
            assert shape(remote) == shape(local)
            rows[name] = remote
        assert rows["good"]["drafter_bundled"] == "dspark/" and "why_not" in rows["bad"]
        hub.requests[:] = []
        code, _, err = cli("build", "hf://MiniMaxAI/bad", "--drafter", "bundled", "-o", tmp_path / "art")
    assert code == 2 and "markov" in err.lower() and not (tmp_path / "art").exists(), err
    assert not Path(constants.HF_HUB_CACHE).exists()


def test_inspect_hf_names_the_engines_the_built_artifact_has(hub, tmp_path, cli):
    """The DSpark stages bind from headers alone: `inspect hf://` states the export engines that `inspect ART`
    states for the artifact `build hf://` then makes."""
    code, out, err = cli("inspect", f"hf://{REPO}", "--json")
    assert code == 0, err
    assert cli("build", f"hf://{REPO}", "--drafter", "bundled", "-o", tmp_path / "art")[0] == 0
    built = json.loads(cli("inspect", tmp_path / "art", "--json")[1])
    assert json.loads(out)["engines"] == built["engines"] and "vllm" in built["engines"]
    code, text, _ = cli("inspect", f"hf://{REPO}")
    assert code == 0 and "export engines" in text


def test_a_llamacpp_drafter_gguf_from_the_hub(tmp_path, tiny_target, tiny_cfg, cli, monkeypatch):
    """A repository holding one llama.cpp drafter GGUF (no config.json): `--drafter hf://org/head-gguf`
    fetches that file, verified, and binds it as a local GGUF; two GGUFs are refused (which one is not said)."""
    import eagle_layouts
    import gguf_fixtures as gf

    head = eagle_layouts.random_head(tiny_cfg, draft_vocab=256)
    folder = tmp_path / "gguf-repo"
    folder.mkdir()
    gf.write_eagle3_gguf(folder / "draft-eagle3-f32.gguf", head, tiny_cfg, [1, 3, 6], tiny_cfg.vocab_size)
    (folder / "README.md").write_text("an EAGLE-3 head for llama.cpp")
    with FakeHub(lfs_threshold=4096) as hub:
        api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
        api.create_repo("org/head-gguf")
        api.upload_folder(repo_id="org/head-gguf", folder_path=folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        code, _, err = cli("build", tiny_target, "--drafter", "hf://org/head-gguf", "-o", tmp_path / "art")
        assert code == 0, err
        assert _manifest(tmp_path / "art")["drafter"]["kind"] == "eagle3"
        (folder / "draft-eagle3-q8_0.gguf").write_bytes((folder / "draft-eagle3-f32.gguf").read_bytes())
        api.upload_folder(repo_id="org/head-gguf", folder_path=folder)
        code, _, err = cli("build", tiny_target, "--drafter", "hf://org/head-gguf", "-o", tmp_path / "art2")
    assert code == 2 and "2 GGUF files" in err and not (tmp_path / "art2").exists(), err


def test_a_listed_name_that_leaves_the_snapshot_is_refused_before_any_download(tmp_path):
    """A hostile hub lists `dspark/../../escape.json`: nothing is fetched, the name is refused."""
    import huggingface_hub.constants as constants
    from pathlib import Path

    from specpack.converters.hub_files import HubFiles
    from specpack.errors import InputError

    with FakeHub() as hub:
        hub.add_virtual("org/hostile", {"config.json": b"{}", "dspark/../../escape.json": b"{}"})
        files = HubFiles.open("hf://org/hostile", endpoint=hub.url)
        with pytest.raises(InputError, match="escapes its directory"):
            files.download(["config.json", "dspark/../../escape.json"])
    assert not Path(constants.HF_HUB_CACHE).exists()
