"""Push and pull through a REAL OCI registry on loopback: Debian's `docker-registry` (the CNCF
distribution registry), started here with filesystem storage in a temp dir. Skipped, with the
reason, when the binary is absent (`apt-get install -y docker-registry`)."""

import contextlib
import hashlib
import json
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from specpack.errors import InputError, VerificationError
from specpack.packager import keygen
from specpack.packager.oci import parse_reference, pull_oci, push_oci
from specpack.packager.transfer import TransferError
from test_hub import assert_identical_dirs, assert_nothing_left, build_signed

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """(host:port, storage root) of a registry serving on 127.0.0.1 until the module ends."""
    if not shutil.os.access(REGISTRY_BIN, shutil.os.X_OK):
        pytest.skip(f"{REGISTRY_BIN} not found: apt-get install -y docker-registry")
    root = tmp_path_factory.mktemp("registry")
    port = _free_port()
    (root / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: error\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        "  maintenance:\n    uploadpurging:\n      enabled: false\n"
        f"http:\n  addr: 127.0.0.1:{port}\n")
    log = root / "registry.log"  # a file, not a pipe: an unread pipe fills up and blocks the server
    with open(log, "wb") as log_file:
        proc = subprocess.Popen([REGISTRY_BIN, "serve", str(root / "config.yml")],
                                stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/v2/", proc, log)
        yield f"127.0.0.1:{port}", root / "data"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _wait_ready(url: str, proc, log, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"registry exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"registry not ready after {seconds}s")


@pytest.fixture(scope="module")
def signed(tmp_path_factory, tiny_target, tiny_cfg, keypair):
    return build_signed(tmp_path_factory.mktemp("oci"), tiny_target, tiny_cfg, keypair)


def _ref(registry, name):
    return f"oci://{registry[0]}/specpack/{name}:v1"


def _pull(ref, out, **kw):
    return pull_oci(ref, out, plain_http=True, progress=False, **kw)


def _blob(registry, digest: str):
    hexd = digest.removeprefix("sha256:")
    return registry[1] / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


@contextlib.contextmanager
def _tampered(path, edit):
    """Edit a blob in the registry's storage, restoring it after: blobs are content-addressed and
    shared by every repository of the registry."""
    original = path.read_bytes()
    path.write_bytes(edit(original))
    try:
        yield
    finally:
        path.write_bytes(original)


def _flip(data: bytes) -> bytes:
    data = bytearray(data)
    data[len(data) // 2] ^= 0x01
    return bytes(data)


def test_round_trip_is_byte_identical_and_verifies(registry, signed, keypair, tmp_path):
    ref = _ref(registry, "round-trip")
    pushed = push_oci(signed, ref, plain_http=True, progress=False)
    assert pushed.revision.startswith("sha256:") and pushed.files == len(list(
        p for p in signed.rglob("*") if p.is_file()))
    pulled = _pull(ref, tmp_path / "by-tag", public_key=keypair.public)
    assert pulled.revision == pushed.revision and pulled.report.signature_checked
    assert_identical_dirs(signed, tmp_path / "by-tag")
    pinned = ref.rsplit(":", 1)[0] + "@" + pushed.revision
    assert _pull(pinned, tmp_path / "by-digest", public_key=keypair.public).report.signature_checked


def test_one_layer_per_file_with_its_path(registry, signed):
    ref = _ref(registry, "layers")
    pushed = push_oci(signed, ref, plain_http=True, progress=False)
    manifest = json.loads(_blob(registry, pushed.revision).read_bytes())
    layers = {layer["annotations"]["org.opencontainers.image.title"]: layer for layer in manifest["layers"]}
    assert "drafter/model.safetensors" in layers and "specpack.json" in layers and "model.sig" in layers
    entry = next(f for f in json.loads((signed / "specpack.json").read_text())["files"]
                 if f["path"] == "drafter/model.safetensors")
    assert layers["drafter/model.safetensors"]["digest"] == f"sha256:{entry['sha256']}"
    assert manifest["config"]["mediaType"] == "application/vnd.specpack.artifact.config.v1+json"


def test_tampered_blob_is_refused_and_removed(registry, signed, keypair, tmp_path):
    ref = _ref(registry, "tampered")
    push_oci(signed, ref, plain_http=True, progress=False)
    digest = hashlib.sha256((signed / "drafter/model.safetensors").read_bytes()).hexdigest()
    with _tampered(_blob(registry, f"sha256:{digest}"), _flip):  # same size, other bytes
        with pytest.raises(VerificationError, match="do not match its manifest") as err:
            _pull(ref, tmp_path / "pulled", public_key=keypair.public)
    assert any(p.startswith("drafter/model.safetensors:") for p in err.value.problems)
    assert_nothing_left(tmp_path / "pulled")


def test_tampered_manifest_is_refused(registry, signed, keypair, tmp_path):
    ref = _ref(registry, "tampered-manifest")
    pushed = push_oci(signed, ref, plain_http=True, progress=False)
    with _tampered(_blob(registry, pushed.revision), lambda data: data + b" "):
        with pytest.raises(VerificationError, match="manifest .* does not match its digest"):
            _pull(ref, tmp_path / "pulled", public_key=keypair.public)
    assert_nothing_left(tmp_path / "pulled")


def test_untrusted_key_and_missing_tag(registry, signed, tmp_path):
    ref = _ref(registry, "keys")
    push_oci(signed, ref, plain_http=True, progress=False)
    other = keygen(tmp_path / "other")
    with pytest.raises(VerificationError, match="does not verify"):
        _pull(ref, tmp_path / "a", public_key=other.public)
    assert_nothing_left(tmp_path / "a")
    with pytest.raises(TransferError, match="does not exist"):
        _pull(ref.replace(":v1", ":v9"), tmp_path / "b", public_key=other.public)
    assert_nothing_left(tmp_path / "b")
    with pytest.raises(VerificationError, match="no public key"):
        _pull(ref, tmp_path / "c")
    assert_nothing_left(tmp_path / "c")


def test_broken_artifact_is_never_pushed(registry, signed, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(signed, copy)
    (copy / "README.md").write_text("edited")
    with pytest.raises(VerificationError, match="refusing to publish"):
        push_oci(copy, _ref(registry, "broken"), plain_http=True, progress=False)
    with urllib.request.urlopen(f"http://{registry[0]}/v2/_catalog") as resp:
        assert "specpack/broken" not in json.loads(resp.read())["repositories"]


def test_unreachable_registry_fails_fast(signed, keypair, tmp_path):
    ref = f"oci://127.0.0.1:{_free_port()}/specpack/none:v1"
    start = time.monotonic()
    with pytest.raises(TransferError, match="cannot reach the registry"):
        _pull(ref, tmp_path / "x", public_key=keypair.public)
    assert time.monotonic() - start < 10
    assert_nothing_left(tmp_path / "x")


@pytest.mark.parametrize("ref", ["registry/repo:tag", "oci://host", "oci://host/Upper:tag",
                                 "oci://host/repo:bad tag", "oci://host/repo@sha256:xyz"])
def test_malformed_references(ref):
    with pytest.raises(InputError, match="not an OCI reference"):
        parse_reference(ref)


def test_reference_parsing():
    r = parse_reference("oci://127.0.0.1:5000/org/model-x:v1.2")
    assert (r.registry, r.repository, r.tag, r.digest) == ("127.0.0.1:5000", "org/model-x", "v1.2", None)
    assert parse_reference("oci://host/repo").tag == "latest"
    pinned = parse_reference("oci://host/repo@sha256:" + "a" * 64)
    assert pinned.reference == "sha256:" + "a" * 64


def test_manifest_with_an_escaping_path_writes_nothing(registry, signed, keypair, tmp_path):
    """A manifest someone else wrote, whose layer title leaves the output dir, is refused before
    any file is written."""
    ref = _ref(registry, "escape")
    pushed = push_oci(signed, ref, plain_http=True, progress=False)
    manifest = json.loads(_blob(registry, pushed.revision).read_bytes())
    manifest["layers"][0]["annotations"]["org.opencontainers.image.title"] = "../escaped"
    url = f"http://{registry[0]}/v2/specpack/escape/manifests/evil"
    req = urllib.request.Request(url, data=json.dumps(manifest).encode(), method="PUT",
                                 headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    urllib.request.urlopen(req).close()
    with pytest.raises(VerificationError, match="malformed manifest") as err:
        _pull(ref.replace(":v1", ":evil"), tmp_path / "out", public_key=keypair.public)
    assert any("escapes its directory" in p for p in err.value.problems)
    assert not (tmp_path / "escaped").exists()
    assert_nothing_left(tmp_path / "out")


def _push_manifest(registry, repo, tag, manifest):
    url = f"http://{registry[0]}/v2/specpack/{repo}/manifests/{tag}"
    req = urllib.request.Request(url, data=json.dumps(manifest).encode(), method="PUT",
                                 headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    urllib.request.urlopen(req).close()


def test_extra_layer_is_refused_and_nothing_kept(registry, signed, keypair, tmp_path):
    """A layer the artifact's manifest does not list (here .git/config, whose fsmonitor runs on the
    next `git status`) fails verification; the download is removed (issue 13, item 1)."""
    ref = _ref(registry, "extra")
    pushed = push_oci(signed, ref, plain_http=True, progress=False)
    manifest = json.loads(_blob(registry, pushed.revision).read_bytes())
    extra = dict(manifest["layers"][0], annotations={"org.opencontainers.image.title": ".git/config"})
    manifest["layers"].append(extra)
    _push_manifest(registry, "extra", "evil", manifest)
    with pytest.raises(VerificationError) as err:
        _pull(ref.replace(":v1", ":evil"), tmp_path / "out", public_key=keypair.public)
    assert ".git/config: extra file, not in the manifest" in err.value.problems
    assert_nothing_left(tmp_path / "out")


def test_a_key_requires_a_signature_even_with_allow_unsigned(registry, tiny_target, keypair, tmp_path):
    from specpack.packager import BuildOptions, build

    unsigned = build(BuildOptions(target=tiny_target, drafter="ngram", out=tmp_path / "unsigned")).out
    ref = _ref(registry, "unsigned")
    push_oci(unsigned, ref, plain_http=True, progress=False)
    with pytest.raises(VerificationError, match="not signed"):
        _pull(ref, tmp_path / "out", public_key=keypair.public, allow_unsigned=True)
    assert_nothing_left(tmp_path / "out")


class _Stream:
    """A streamed `requests` response that yields `head`, then `extra` more chunks of `filler`,
    counting what the reader took."""

    def __init__(self, head: bytes, filler: bytes, extra: int):
        self.head, self.filler, self.extra = head, filler, extra
        self.status_code, self.headers, self.reason, self.taken = 200, {}, "OK", 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def iter_content(self, chunk_size=None):
        for chunk in [self.head] + [self.filler] * self.extra:
            self.taken += 1
            yield chunk


def test_blob_longer_than_declared_stops_at_its_size(registry, signed, keypair, tmp_path, monkeypatch):
    """A registry that streams on past a blob's declared size is cut off there, not read to the end."""
    import oras.provider

    ref = _ref(registry, "endless")
    push_oci(signed, ref, plain_http=True, progress=False)
    weights = (signed / "drafter/model.safetensors").read_bytes()
    digest = "sha256:" + hashlib.sha256(weights).hexdigest()
    real, streams = oras.provider.Registry.get_blob, []

    def get_blob(self, container, blob_digest, stream=False, head=False):
        if blob_digest != digest:
            return real(self, container, blob_digest, stream=stream, head=head)
        streams.append(_Stream(weights, b"\0" * 2**16, extra=200))
        return streams[-1]

    monkeypatch.setattr(oras.provider.Registry, "get_blob", get_blob)
    with pytest.raises(VerificationError, match="do not match its manifest") as err:
        _pull(ref, tmp_path / "pulled", public_key=keypair.public)
    assert any(p.startswith("drafter/model.safetensors: the registry sent more than") for p in err.value.problems)
    assert streams and streams[0].taken <= 2  # the blob, then one chunk too many: no further
    assert_nothing_left(tmp_path / "pulled")


def test_endless_manifest_is_refused(tmp_path, keypair, monkeypatch):
    import oras.provider

    streams = []

    def do_request(self, url, method="GET", data=None, headers=None, json=None, stream=False):
        streams.append(_Stream(b'{"schemaVersion": 2, "layers": [', b" " * 2**20, extra=64))
        return streams[-1]

    monkeypatch.setattr(oras.provider.Registry.do_request, "__wrapped__", do_request)
    with pytest.raises(VerificationError, match="manifest .* is larger than"):
        _pull(f"oci://127.0.0.1:{_free_port()}/specpack/endless:v1", tmp_path / "x", public_key=keypair.public)
    assert len(streams) == 1 and streams[0].taken <= 6  # 4 MiB and one chunk more
    assert_nothing_left(tmp_path / "x")


@pytest.mark.parametrize("size", [-1, "12", True, None, 1.5])
def test_layer_without_a_byte_count_is_refused(size):
    from specpack.packager.oci import _layer_paths

    layer = {"digest": "sha256:" + "a" * 64, "size": size,
             "annotations": {"org.opencontainers.image.title": "config.json"}}
    with pytest.raises(VerificationError, match="malformed manifest") as err:
        _layer_paths({"layers": [layer]}, parse_reference("oci://host/repo:v1"))
    assert err.value.problems == [f"config.json: size {size!r} is not a byte count"]
