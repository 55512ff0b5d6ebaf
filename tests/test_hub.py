"""Push and pull through the real `huggingface_hub` client against the local fake hub
(tests/fake_hub.py on 127.0.0.1): round trip, server-side tampering, missing revisions,
interrupted downloads, bad repo ids, missing or refused auth, broken artifacts."""

import filecmp
import hashlib
import json
import shutil

import pytest

import eagle_layouts
from fake_hub import READ_TOKEN, WRITE_TOKEN, FakeHub, hermetic_hub_client  # noqa: F401  (autouse here)
from specpack.errors import InputError, VerificationError
from specpack.packager import BuildOptions, build, keygen
from specpack.packager.hub import pull, push
from specpack.packager.transfer import TransferError


@pytest.fixture
def hub():
    with FakeHub(lfs_threshold=4096) as h:  # safetensors and tokenizer go through LFS, the rest inline
        yield h


def build_signed(tmp, tiny_target, tiny_cfg, keypair):
    """A signed EAGLE-3 artifact (never modify it in place: its target files are hard links)."""
    head = eagle_layouts.write_official(tmp / "head", eagle_layouts.random_head(tiny_cfg, 256), tiny_cfg)
    return build(BuildOptions(target=tiny_target, drafter=str(head), out=tmp / "art",
                              key=keypair.private)).out


@pytest.fixture(scope="module")
def signed(tmp_path_factory, tiny_target, tiny_cfg, keypair):
    return build_signed(tmp_path_factory.mktemp("hub"), tiny_target, tiny_cfg, keypair)


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory, tiny_target):
    return build(BuildOptions(target=tiny_target, drafter="ngram",
                              out=tmp_path_factory.mktemp("hub") / "ngram-art")).out


def _push(art, hub, repo="org/tiny", **kw):
    return push(art, repo, token=WRITE_TOKEN, endpoint=hub.url, progress=False, **kw)


def _pull(hub, out, repo="org/tiny", **kw):
    return pull(repo, out, endpoint=hub.url, progress=False, **kw)


def assert_nothing_left(out):
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*")), "a partial download was left behind"


def assert_identical_dirs(a, b):
    cmp = filecmp.dircmp(a, b)
    assert not (cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files), cmp.report()
    for sub in cmp.common_dirs:
        assert_identical_dirs(a / sub, b / sub)
    for name in cmp.common_files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_round_trip_is_byte_identical_and_verifies(signed, hub, keypair, tmp_path):
    result = _push(signed, hub)
    assert [r for r in hub.requests if "/commit/" in r] == ["POST /api/models/org/tiny/commit/main"]
    assert any(r.startswith("PUT /lfs-upload/") for r in hub.requests)  # large files went through LFS
    assert sorted(hub.files("org/tiny")) == sorted(p.relative_to(signed).as_posix()
                                                   for p in signed.rglob("*") if p.is_file())
    pulled = _pull(hub, tmp_path / "pulled", public_key=keypair.public)
    assert pulled.revision == result.revision
    assert pulled.report.signature_checked and pulled.trust == "signature and digests verified"
    assert_identical_dirs(signed, tmp_path / "pulled")
    assert not (tmp_path / "pulled/.cache").exists()


def test_model_card_carries_hub_metadata(signed, hub):
    _push(signed, hub)
    card = hub.files("org/tiny")["README.md"][0].decode()
    header = card.split("---")[1]
    assert "library_name: specpack" in header and "speculative-decoding" in header and "eagle3" in header


def _flip(data: bytes) -> bytes:
    data = bytearray(data)
    data[len(data) // 2] ^= 0x01
    return bytes(data)


def test_server_side_tamper_is_refused_and_removed(signed, hub, keypair, tmp_path):
    _push(signed, hub)
    weights, _ = hub.files("org/tiny")["drafter/model.safetensors"]
    hub.tamper("org/tiny", "drafter/model.safetensors", _flip(weights))
    with pytest.raises(VerificationError) as err:
        _pull(hub, tmp_path / "pulled", public_key=keypair.public)
    assert any(p.startswith("drafter/model.safetensors: changed") for p in err.value.problems)
    assert_nothing_left(tmp_path / "pulled")


def test_tamper_with_rewritten_manifest_is_caught_by_the_signature(signed, hub, keypair, tmp_path):
    """An attacker who also rewrites specpack.json passes the digest check, not the signature."""
    _push(signed, hub)
    files = hub.files("org/tiny")
    weights = _flip(files["drafter/model.safetensors"][0])
    manifest = json.loads(files["specpack.json"][0])
    entry = next(f for f in manifest["files"] if f["path"] == "drafter/model.safetensors")
    entry["sha256"] = hashlib.sha256(weights).hexdigest()
    hub.tamper("org/tiny", "drafter/model.safetensors", weights)
    hub.tamper("org/tiny", "specpack.json", json.dumps(manifest, indent=2).encode())
    with pytest.raises(VerificationError) as err:
        _pull(hub, tmp_path / "pulled", public_key=keypair.public)
    assert any("changed since signing" in p for p in err.value.problems)
    assert_nothing_left(tmp_path / "pulled")


def test_untrusted_key_is_refused(signed, hub, tmp_path):
    _push(signed, hub)
    other = keygen(tmp_path / "other")
    with pytest.raises(VerificationError, match="does not verify"):
        _pull(hub, tmp_path / "pulled", public_key=other.public)
    assert_nothing_left(tmp_path / "pulled")


def test_unsigned_needs_explicit_consent(unsigned, hub, keypair, tmp_path):
    _push(unsigned, hub)
    with pytest.raises(VerificationError, match="not signed"):
        _pull(hub, tmp_path / "a", public_key=keypair.public)
    assert_nothing_left(tmp_path / "a")
    before = len(hub.requests)
    with pytest.raises(VerificationError, match="no public key") as err:
        _pull(hub, tmp_path / "b")
    assert "--allow-unsigned" in err.value.hint and len(hub.requests) == before  # refused up front
    result = _pull(hub, tmp_path / "c", allow_unsigned=True)
    assert "UNSIGNED" in result.trust
    assert_identical_dirs(unsigned, tmp_path / "c")


def test_revision_branch_round_trip_and_missing_revision(signed, hub, keypair, tmp_path):
    _push(signed, hub, revision="v1")
    assert _pull(hub, tmp_path / "v1", revision="v1", public_key=keypair.public).report.signature_checked
    with pytest.raises(TransferError, match="revision 'v9' does not exist in org/tiny"):
        _pull(hub, tmp_path / "v9", revision="v9", public_key=keypair.public)
    assert_nothing_left(tmp_path / "v9")
    with pytest.raises(TransferError, match="does not exist or this token cannot see it"):
        _pull(hub, tmp_path / "none", repo="org/missing", public_key=keypair.public)
    assert_nothing_left(tmp_path / "none")


def test_interrupted_download_resumes_once_and_fails_cleanly_when_dead(signed, hub, keypair, tmp_path,
                                                                       monkeypatch):
    import huggingface_hub.file_download as fd

    monkeypatch.setattr(fd.time, "sleep", lambda s: None)  # the client waits 1 s between retries
    _push(signed, hub)
    hub.faults["model.safetensors"] = "drop_once"  # connection lost halfway: the client resumes
    assert _pull(hub, tmp_path / "resumed", public_key=keypair.public).report.signature_checked
    assert_identical_dirs(signed, tmp_path / "resumed")
    hub.faults["model.safetensors"] = "dead"  # headers, then nothing, every time
    with pytest.raises(TransferError, match="connection to the hub was lost|incomplete"):
        _pull(hub, tmp_path / "dead", public_key=keypair.public)
    assert_nothing_left(tmp_path / "dead")


@pytest.mark.parametrize("repo_id", ["noslash", "a/b/c", "org/bad name", "org/-dash", "org/a..b",
                                     "org/" + "x" * 97, ""])
def test_malformed_repo_id(repo_id, signed, hub, keypair, tmp_path):
    with pytest.raises(InputError, match="not a valid Hugging Face repo id"):
        push(signed, repo_id, token=WRITE_TOKEN, endpoint=hub.url, progress=False)
    with pytest.raises(InputError, match="not a valid Hugging Face repo id"):
        pull(repo_id, tmp_path / "x", public_key=keypair.public, endpoint=hub.url, progress=False)
    assert hub.requests == [] and not (tmp_path / "x").exists()


def test_missing_token_is_refused_before_any_request(signed, hub):
    with pytest.raises(TransferError, match="no Hugging Face token") as err:
        push(signed, "org/tiny", endpoint=hub.url, progress=False)
    assert "HF_TOKEN" in err.value.hint and "hf auth login" in err.value.hint
    assert hub.requests == []


@pytest.mark.parametrize("token, status", [("hf_not_a_real_token", 401), (READ_TOKEN, 403)])
def test_refused_token(token, status, signed, hub):
    with pytest.raises(TransferError, match=f"refused .*HTTP {status}") as err:
        push(signed, "org/tiny", token=token, endpoint=hub.url, progress=False)
    assert "HF_TOKEN" in err.value.hint
    assert "org/tiny" not in hub.repos


def test_token_from_environment(signed, hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    push(signed, "org/env", endpoint=hub.url, progress=False)
    assert "org/env" in hub.repos


def test_private_repo_needs_a_token_to_pull(signed, hub, keypair, tmp_path):
    _push(signed, hub, private=True)
    with pytest.raises(TransferError, match="cannot see it"):
        _pull(hub, tmp_path / "anon", public_key=keypair.public)
    assert_nothing_left(tmp_path / "anon")
    assert _pull(hub, tmp_path / "ok", public_key=keypair.public, token=READ_TOKEN)


def test_broken_artifact_is_never_pushed(signed, hub, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(signed, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    with pytest.raises(VerificationError, match="refusing to publish") as err:
        _push(copy, hub)
    assert any(p.startswith("config.json: changed") for p in err.value.problems)
    assert hub.requests == []


def test_existing_output_is_kept(signed, hub, keypair, tmp_path):
    from specpack.errors import OutputError

    _push(signed, hub)
    (tmp_path / "taken").mkdir()
    with pytest.raises(OutputError):
        _pull(hub, tmp_path / "taken", public_key=keypair.public)
    assert _pull(hub, tmp_path / "taken", public_key=keypair.public, force=True)
    assert_identical_dirs(signed, tmp_path / "taken")


def test_unreachable_hub(signed, keypair, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TransferError, match="cannot reach the hub"):
        pull("org/tiny", tmp_path / "x", public_key=keypair.public, endpoint=dead, progress=False)
    assert_nothing_left(tmp_path / "x")
    with pytest.raises(TransferError, match="cannot reach the hub"):
        push(signed, "org/tiny", token=WRITE_TOKEN, endpoint=dead, progress=False)


def test_pull_keeps_only_the_files_the_manifest_lists(signed, hub, keypair, tmp_path):
    """The hub adds .gitattributes to a repo, and a compromised repo may carry anything: a file the
    manifest does not list is never downloaded, so never kept (issue 13, item 1)."""
    _push(signed, hub)
    files = hub.files("org/tiny")
    files[".gitattributes"] = (b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False)
    files[".git/config"] = (b'[core]\n\tfsmonitor = "touch pwned"\n', False)
    result = _pull(hub, tmp_path / "pulled", public_key=keypair.public)
    assert result.report.signature_checked
    assert_identical_dirs(signed, tmp_path / "pulled")  # (filecmp ignores .git: checked below)
    assert not (tmp_path / "pulled/.git").exists() and not (tmp_path / "pulled/.gitattributes").exists()
    assert not [r for r in hub.requests if ".git" in r and "/resolve/" in r]


def test_a_key_requires_a_signature_even_with_allow_unsigned(unsigned, hub, keypair, tmp_path):
    """--allow-unsigned stands in for a missing key; it never lowers one that was given (item 14)."""
    _push(unsigned, hub)
    with pytest.raises(VerificationError, match="not signed") as err:
        _pull(hub, tmp_path / "a", public_key=keypair.public, allow_unsigned=True)
    assert "without --key" in err.value.hint
    assert_nothing_left(tmp_path / "a")


def test_stale_partial_download_is_removed_by_the_next_pull(signed, hub, keypair, tmp_path):
    from test_transactions import dead_pid

    _push(signed, hub)
    stale = tmp_path / f".pulled.{dead_pid()}.abcdefgh.partial"
    (stale / ".cache/huggingface/download").mkdir(parents=True)
    (stale / ".cache/huggingface/download/model.safetensors.incomplete").write_bytes(b"half")
    assert _pull(hub, tmp_path / "pulled", public_key=keypair.public).report.signature_checked
    assert not stale.exists()


@pytest.mark.parametrize("name", ["../evil", "a/../../b", "/etc/evil", "a\\..\\b"])
def test_pull_refuses_unsafe_names_before_downloading(name, unsigned, hub, tmp_path):
    """A listed name that would land outside OUT is a clear error (not the client's ValueError)."""
    _push(unsigned, hub)
    hub.files("org/tiny")[name] = (b"evil", False)
    before = len(hub.requests)
    with pytest.raises(VerificationError, match="unsafe names") as err:
        _pull(hub, tmp_path / "out" / "pulled", allow_unsigned=True)
    assert err.value.problems == [f"{name!r} escapes the download directory"]
    assert not any("/resolve/" in r for r in hub.requests[before:])  # nothing was downloaded
    assert_nothing_left(tmp_path / "out" / "pulled")
    assert [p.name for p in tmp_path.rglob("*")] == ["out"]


def test_unsafe_name_the_first_listing_hid_is_never_fetched(unsigned, hub, tmp_path, monkeypatch):
    """A server whose file tree lists more than its repo info: only the files the manifest lists are
    downloaded, so the unsafe name is never requested and nothing lands outside OUT."""
    import specpack.packager.hub as hub_module

    monkeypatch.setattr(hub_module, "_check_names", lambda names, source: None)
    _push(unsigned, hub)
    hub.files("org/tiny")["../evil"] = (b"evil", False)
    _pull(hub, tmp_path / "pulled", allow_unsigned=True)
    assert not (tmp_path / "evil").exists() and not list(tmp_path.rglob("evil"))
    assert not [r for r in hub.requests if "evil" in r and "/resolve/" in r]


@pytest.fixture
def only_loopback(monkeypatch, tmp_path):
    """Every host name resolved during the test; any but 127.0.0.1 fails. The client's agent
    registry (fetched from huggingface.co at most once a day) starts uncached and telemetry on."""
    import socket

    import huggingface_hub.constants as constants
    import huggingface_hub.utils._detect_agent as detect_agent

    monkeypatch.setattr(detect_agent, "_registry", None)
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agents.json"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hosts, resolve = [], socket.getaddrinfo

    def guarded(host, *args, **kwargs):
        hosts.append(host)
        if host != "127.0.0.1":
            raise OSError(f"test: no connection to {host}")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)
    return hosts


def test_only_the_given_endpoint_is_contacted(signed, hub, keypair, tmp_path, only_loopback):
    _push(signed, hub)
    assert _pull(hub, tmp_path / "pulled", public_key=keypair.public).report.signature_checked
    assert set(only_loopback) == {"127.0.0.1"}


def test_oidc_token_exchange_goes_to_the_given_endpoint(signed, hub, keypair, tmp_path, only_loopback,
                                                        monkeypatch):
    import huggingface_hub.utils._auth as auth

    _push(signed, hub, private=True)
    monkeypatch.setattr(auth, "_OIDC_TOKEN_CACHE", None)
    monkeypatch.setenv("HF_OIDC_RESOURCE", "org/tiny")
    monkeypatch.setenv("HF_OIDC_ID_TOKEN", "id-token-from-ci")
    assert _pull(hub, tmp_path / "pulled", public_key=keypair.public).report.signature_checked
    assert "POST /oauth/token" in hub.requests and set(only_loopback) == {"127.0.0.1"}


def test_endpoint_credentials_never_printed_or_logged(signed, unsigned, hub, tmp_path, cli, caplog,
                                                      monkeypatch):
    import logging

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    _push(unsigned, hub)
    endpoint = hub.url.replace("http://", "http://someone:s3cret-pw@")
    code, out, err = cli("-v", "pull", "org/tiny", "-o", tmp_path / "pulled", "--allow-unsigned",
                         "--endpoint", endpoint)
    assert code == 0, err
    code, out2, err2 = cli("-v", "push", signed, "org/other", "--endpoint", endpoint)
    assert code == 2 and "error:" in err2  # the URL's credentials replace the token: the fake refuses
    assert "someone:s3cret-pw" not in out + err + out2 + err2 + caplog.text
    assert "http://***@127.0.0.1" in caplog.text  # the requests are logged, their credentials are not


def test_redact():
    from specpack._redact import redact

    assert redact("GET http://u:p@ss@h:1/x?a=b@c and https://tok@hf.co/") == "GET http://***@h:1/x?a=b@c and " \
                                                                         "https://***@hf.co/"
    assert redact("no credentials: http://host/a@b, oci://host/repo:v1") == \
        "no credentials: http://host/a@b, oci://host/repo:v1"
