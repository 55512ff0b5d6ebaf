"""A release read on the hub by range requests (issue 61, first piece: converters/hub_files.py), against
the local hub in fake_hub.py with the real huggingface_hub client: the revision resolved to its commit,
configs read whole, safetensors headers by two ranges each and equal to the local reader's, the bytes
served a sliver of the repository; a lying header length, a server that ignores ranges, a missing
repository, revision or file: each a clear error, nothing else read."""

import json
import struct

import pytest
from huggingface_hub import HfApi

from fake_hub import WRITE_TOKEN, FakeHub, hermetic_hub_client  # noqa: F401  (autouse here)
from specpack.converters.hub_files import HubFiles, parse
from specpack.converters.safetensors_header import read_header
from specpack.errors import ConversionError, InputError


@pytest.fixture
def hub(tiny_target):
    with FakeHub(lfs_threshold=4096) as h:
        api = HfApi(endpoint=h.url, token=WRITE_TOKEN)
        api.create_repo("org/release")
        api.upload_folder(repo_id="org/release", folder_path=tiny_target)
        h.bytes_served = 0
        yield h


def test_headers_by_range_equal_the_local_reader(hub, tiny_target):
    files = HubFiles.open("hf://org/release", endpoint=hub.url)
    assert files.commit == hub.repos["org/release"].refs["main"] and "model.safetensors" in files.list()
    assert files.json("config.json", "target config") == json.loads((tiny_target / "config.json").read_text())
    assert files.header("model.safetensors") == read_header(tiny_target / "model.safetensors")
    size = (tiny_target / "model.safetensors").stat().st_size
    (n,) = struct.unpack("<Q", (tiny_target / "model.safetensors").read_bytes()[:8])
    config = (tiny_target / "config.json").stat().st_size
    assert files.bytes_read == 8 + n + config == hub.bytes_served  # the header and the config, nothing else
    assert hub.bytes_served < size / 20 and files.requests == 2 + 3


def test_a_pinned_commit_and_a_branch_read_the_same(hub):
    commit = hub.repos["org/release"].refs["main"]
    assert HubFiles.open(f"hf://org/release@{commit}", endpoint=hub.url).commit == commit


def test_a_header_length_past_the_file_is_refused_before_it_is_read(hub, tiny_target):
    data = bytearray((tiny_target / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)
    hub.tamper("org/release", "model.safetensors", bytes(data))
    files = HubFiles.open("hf://org/release", endpoint=hub.url)
    with pytest.raises(ConversionError, match="exceeds the file"):
        files.header("model.safetensors")
    assert files.bytes_read == 8


def test_a_server_that_ignores_ranges_is_refused_not_read(hub):
    hub.ignore_ranges = True
    files = HubFiles.open("hf://org/release", endpoint=hub.url)
    with pytest.raises(InputError, match="does not honour byte ranges"):
        files.header("model.safetensors")
    assert files.bytes_read == 0


@pytest.mark.parametrize("spec, says", [("hf://org/nothing", "not found"), ("hf://org/release@v9", "revision 'v9'"),
                                        ("hf://org", "org/name"), ("org/release", "not a hub address")])
def test_what_is_not_there_is_named(hub, spec, says):
    with pytest.raises(InputError, match=says):
        HubFiles.open(spec, endpoint=hub.url)


def test_a_file_the_repository_lacks_is_named(hub):
    with pytest.raises(InputError, match="no such file"):
        HubFiles.open("hf://org/release", endpoint=hub.url).header("model-00001-of-00002.safetensors")


def test_parse():
    assert parse("hf://a/b@dev") == ("a/b", "dev") and parse("hf://a/b") == ("a/b", "main")


def test_the_hub_is_a_second_reader_of_the_same_checks(hub, tiny_target, tmp_path):
    """target_hf.headers_of takes either reader (release_files): a sharded release's index and every
    shard's header read on the hub give what the directory gives, for the headers' bytes only."""
    from specpack.converters.release_files import LocalFiles
    from specpack.converters.target_hf import headers_of
    import tiny

    sharded = tiny.make_target(tmp_path / "sharded", "llama", shards=3)
    HfApi(endpoint=hub.url, token=WRITE_TOKEN).create_repo("org/sharded")
    HfApi(endpoint=hub.url, token=WRITE_TOKEN).upload_folder(repo_id="org/sharded", folder_path=sharded)
    hub.bytes_served = 0
    remote = HubFiles.open("hf://org/sharded", endpoint=hub.url)
    files, tensors = headers_of(remote)
    assert (files, tensors) == headers_of(LocalFiles(sharded)) and len({f for f, _ in tensors.values()}) == 3
    weights = sum(p.stat().st_size for p in sharded.glob("*.safetensors"))
    assert hub.bytes_served == remote.bytes_read < weights / 20
    assert remote.sha256("config.json") == LocalFiles(sharded).sha256("config.json")


def test_inspect_checks_a_hub_release_before_downloading_it(hub, tiny_target, cli, monkeypatch):
    """`specpack inspect hf://org/name`: the target checked tensor by tensor from its headers, as
    `inspect`'s local checks do, the bytes a build would download and what the check read."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # as for push and pull (or --endpoint)
    code, out, err = cli("inspect", "hf://org/release", "--json")
    assert code == 0, err
    d = json.loads(out)
    from specpack.converters import target_hf

    local = target_hf.load(tiny_target).info.model_dump(mode="json", exclude_none=True)
    assert {k: v for k, v in d["target"].items() if k != "source"} == {k: v for k, v in local.items() if k != "source"}
    assert d["target"]["source"] == {"kind": "hub", "repo_id": "org/release", "revision": d["commit"]}
    assert d["bytes_read"] == hub.bytes_served < d["build_would_download_bytes"] / 20
    code, out, _ = cli("inspect", "hf://org/release")
    assert code == 0 and "every tensor checked from its header" in out and "requests" in out
    code, _, err = cli("inspect", "hf://org/missing")
    assert code == 2 and "not found" in err and "Traceback" not in err, err


def test_inspect_hub_agrees_with_inspect_dir_on_a_dspark_release(tmp_path, cli, monkeypatch):
    """The tiny DeepSeek-V4-Flash-DSpark release (family_fixtures, layout B) on the hub: `inspect hf://`
    binds the same stages as `inspect DIR` on the same files (the build's own check, run on headers read
    by range), reading a sliver of the repository."""
    import family_fixtures as ff

    release = ff.deepseek_v4_dspark(ff.make("deepseek_v4", tmp_path / "DeepSeek-V4-Flash-DSpark"))
    with FakeHub(lfs_threshold=4096) as hub:
        api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
        api.create_repo("deepseek-ai/v4-dspark")
        api.upload_folder(repo_id="deepseek-ai/v4-dspark", folder_path=release)
        hub.bytes_served = 0
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        code, out, err = cli("inspect", "hf://deepseek-ai/v4-dspark", "--json")
        served = hub.bytes_served
    assert code == 0, err
    remote = json.loads(out)
    local = json.loads(cli("inspect", release, "--json")[1])
    assert remote["drafter_bundled"] == local["drafter_bundled"] == "dspark-stages"
    assert [(b["layout"], b["kind"], b.get("drafter")) for b in remote["bundled"]] == \
        [(b["layout"], b["kind"], b.get("drafter")) for b in local["bundled"]]
    assert remote["target"]["arch"]["family"] == "deepseek_v4" and served == remote["bytes_read"]
    assert served < remote["repository_bytes"] / 20, (served, remote["repository_bytes"])
