"""Push and pull artifacts to OCI registries (`oci://host[:port]/repo[:tag|@sha256:…]`) with the
ORAS Python SDK (`oras`).

One layer per artifact file: media type `application/vnd.specpack.file.v1`, digest = the file's
SHA-256 from the verified manifest (no second hashing pass), annotation
`org.opencontainers.image.title` = its relative path. The config blob marks the image as a
specpack artifact. Pull checks the manifest's own digest (against `@sha256:` when given, else
against the registry's Docker-Content-Digest), streams each blob while hashing it, refuses every
blob whose bytes do not match its layer digest, then verifies the artifact (signature and digests)
before renaming it into place. Credentials come from the Docker config (`docker login`), as oras
reads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specpack._atomic import staging_dir
from specpack._paths import check_relpath
from specpack.errors import InputError, MissingDependencyError, SpecpackError, VerificationError
from specpack.packager.progress import byte_bar
from specpack.packager.transfer import (PullResult, PushResult, TransferError, check_download,
                                        files_to_upload, require_trust_choice)

log = logging.getLogger(__name__)

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.specpack.artifact.config.v1+json"
FILE_TYPE = "application/vnd.specpack.file.v1"
TITLE = "org.opencontainers.image.title"
CHUNK = 16 * 2**20
MAX_MANIFEST_BYTES = 4 * 2**20  # what the distribution registry itself accepts

_REF = re.compile(r"oci://(?P<registry>[^/@]+)/(?P<repo>[a-z0-9]+(?:[._-]+[a-z0-9]+)*"
                  r"(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*)"
                  r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?")


@dataclass(frozen=True)
class OciRef:
    registry: str
    repository: str
    tag: str = "latest"
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What the registry API addresses: the digest when pinned, else the tag."""
        return self.digest or self.tag

    def __str__(self) -> str:
        pin = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"oci://{self.registry}/{self.repository}{pin}"


def parse_reference(ref: str) -> OciRef:
    """Parse `oci://host[:port]/repo[/more][:tag][@sha256:hex]`; raise InputError otherwise."""
    m = _REF.fullmatch(str(ref))
    if not m:
        raise InputError(f"'{ref}' is not an OCI reference",
                         hint="use oci://HOST[:PORT]/REPO[:TAG] (lowercase repository, e.g. "
                              "oci://registry.example.com/models/llama-eagle3:v1)")
    return OciRef(m["registry"], m["repo"], m["tag"] or "latest", m["digest"])


def push_oci(artifact: Path, ref: str, plain_http: bool = False, progress: bool = True,
             public_key: Path | None = None) -> PushResult:
    """Verify `artifact`, upload one blob per file, then the manifest; returns its digest."""
    oref = parse_reference(ref)
    if oref.digest:
        raise InputError(f"cannot push to a digest ({oref})", hint="push to a tag: oci://HOST/REPO:TAG")
    artifact = Path(artifact)
    report, files = files_to_upload(artifact, public_key, progress)
    reg, container = _connect(oref, plain_http)
    layers = [{"mediaType": FILE_TYPE, "digest": f"sha256:{f.sha256}", "size": f.size,
               "annotations": {TITLE: f.path}} for f in files]
    with _registry_errors(oref), byte_bar(sum(f.size for f in files), "pushing", progress) as bar:
        for f, layer in zip(files, layers):
            _check(reg.upload_blob(str(artifact / f.path), container, layer, do_chunked=True,
                                   chunk_size=CHUNK), f"upload of {f.path}")
            bar.update(f.size)
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                    "config": _upload_config(reg, container, report.manifest), "layers": layers,
                    "annotations": {TITLE: report.manifest.name,
                                    "org.opencontainers.image.created": report.manifest.created}}
        resp = reg.upload_manifest(manifest, container)
        _check(resp, "manifest upload")
    digest = resp.headers.get("Docker-Content-Digest", "")
    log.info("pushed %s to %s (%s)", artifact, oref, digest)
    return PushResult(str(oref), digest, len(files), sum(f.size for f in files))


def pull_oci(ref: str, out: Path, public_key: Path | None = None, allow_unsigned: bool = False,
             plain_http: bool = False, force: bool = False, progress: bool = True) -> PullResult:
    """Download `ref` into a hidden dir beside `out`, check every blob against the manifest and
    the artifact's signature and digests, and only then rename it to `out`."""
    oref = parse_reference(ref)
    require_trust_choice(public_key, allow_unsigned, str(oref))
    reg, container = _connect(oref, plain_http)
    with staging_dir(Path(out), force) as tmp:
        with _registry_errors(oref):
            manifest, digest = _fetch_manifest(reg, container, oref)
            _download_layers(reg, container, _layer_paths(manifest, oref), tmp, oref, progress)
        report = check_download(tmp, public_key, allow_unsigned, f"{oref} ({digest[:19]})", progress)
    return PullResult(Path(out), str(oref), digest, report)


# ---- registry plumbing ----

def _connect(oref: OciRef, plain_http: bool):
    try:
        import oras.provider
    except ImportError:
        raise MissingDependencyError.for_module("oras", "oci") from None

    class _Registry(oras.provider.Registry):
        # oras retries every failed request with sleeps of 3 s to 80 s; fail fast instead
        def do_request(self, *args, **kwargs):
            return oras.provider.Registry.do_request.__wrapped__(self, *args, **kwargs)

    reg = _Registry(insecure=plain_http)
    container = reg.get_container(f"{oref.registry}/{oref.repository}:{oref.tag}")
    reg.auth.load_configs(container)
    return reg, container


def _check(resp, what: str) -> None:
    if resp.status_code not in (200, 201, 202):
        raise TransferError(f"registry refused the {what} (HTTP {resp.status_code}): "
                            f"{_registry_message(resp)}",
                            hint=_status_hint(resp.status_code))


def _registry_message(resp) -> str:
    try:
        return "; ".join(e.get("message", "") for e in resp.json().get("errors", [])) or resp.reason
    except ValueError:
        return resp.reason or ""


def _status_hint(status: int) -> str:
    if status in (401, 403):
        return "log in with `docker login HOST` (oras reads the Docker config)"
    if status == 404:
        return "check the repository and tag"
    return "retry; if it persists, check the registry's logs"


def _upload_config(reg, container, manifest) -> dict:
    data = json.dumps({"format": manifest.format, "format_version": manifest.format_version,
                       "name": manifest.name}, sort_keys=True).encode()
    layer = {"mediaType": CONFIG_TYPE, "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
             "size": len(data)}
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(data)
        f.flush()
        _check(reg.upload_blob(f.name, container, layer), "config upload")
    return layer


def _fetch_manifest(reg, container, oref: OciRef) -> tuple[dict, str]:
    url = f"{reg.prefix}://{container.manifest_url(oref.reference)}"
    with reg.do_request(url, "GET", headers={"Accept": MANIFEST_TYPE}, stream=True) as resp:
        if resp.status_code == 404:
            raise TransferError(f"{oref} does not exist", hint="check the repository and tag")
        _check(resp, "manifest request")
        content = _read_at_most(resp, MAX_MANIFEST_BYTES)
    if content is None:
        raise VerificationError(f"manifest of {oref} is larger than {MAX_MANIFEST_BYTES:,} bytes",
                                hint="the registry sent more than any manifest holds: do not use it")
    digest = "sha256:" + hashlib.sha256(content).hexdigest()
    expected = oref.digest or resp.headers.get("Docker-Content-Digest")
    if expected and expected != digest:
        raise VerificationError(f"manifest of {oref} does not match its digest",
                                problems=[f"expected {expected}, got {digest}"],
                                hint="the registry returned other bytes than it stored: do not use it")
    manifest = json.loads(content)
    if manifest.get("config", {}).get("mediaType") != CONFIG_TYPE:
        raise InputError(f"{oref} is not a specpack artifact (config media type "
                         f"{manifest.get('config', {}).get('mediaType')!r})",
                         hint="push it with `specpack push ARTIFACT oci://…`")
    return manifest, digest


def _layer_paths(manifest: dict, oref: OciRef) -> list[tuple[str, dict]]:
    """(relative path, layer) for every layer; every path is checked before anything is written."""
    out, problems = [], []
    for layer in manifest.get("layers", []):
        path = (layer.get("annotations") or {}).get(TITLE)
        try:
            out.append((check_relpath(path or "", f"{oref} layer {layer.get('digest')}"), layer))
        except InputError as exc:
            problems.append(exc.message)
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(layer.get("digest"))):
            problems.append(f"{path}: unsupported digest {layer.get('digest')!r}")
        size = layer.get("size")
        if type(size) is not int or size < 0:  # noqa: E721 - bool is an int too
            problems.append(f"{path}: size {size!r} is not a byte count")
    paths = [p for p, _ in out]
    if len(set(paths)) != len(paths):
        problems.append("two layers claim the same path")
    problems += [f"{p}: is both a file and a directory" for p in paths
                 if any(q.startswith(p + "/") for q in paths)]
    if problems:
        raise VerificationError(f"{oref} has a malformed manifest", problems=problems,
                                hint="it was not written by specpack, or was altered")
    return out


def _download_layers(reg, container, layers, tmp: Path, oref: OciRef, progress: bool) -> None:
    problems = []
    with byte_bar(sum(int(layer.get("size", 0)) for _, layer in layers), "pulling", progress) as bar:
        for path, layer in layers:
            problem = _download_blob(reg, container, layer, tmp / path, bar)
            if problem:
                problems.append(f"{path}: {problem}")
    if problems:
        raise VerificationError(f"blobs of {oref} do not match its manifest; the download was "
                                "removed", problems=problems,
                                hint="the registry's storage is corrupt or was tampered with")


def _download_blob(reg, container, layer: dict, dest: Path, bar) -> str | None:
    """Stream one blob to `dest`, hashing it, and never read past the size the manifest declares;
    return a problem, or None when it matches."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest, size, declared = hashlib.sha256(), 0, layer["size"]
    with reg.get_blob(container, layer["digest"], stream=True) as resp, open(dest, "wb") as f:
        _check(resp, f"download of {dest.name}")
        for chunk in resp.iter_content(chunk_size=2**20):
            if size + len(chunk) > declared:
                return f"the registry sent more than the {declared:,} bytes the manifest declares"
            digest.update(chunk)
            f.write(chunk)
            size += len(chunk)
            bar.update(len(chunk))
    if size != declared:
        return f"{size:,} bytes, the manifest says {declared:,}"
    got = "sha256:" + digest.hexdigest()
    if got != layer["digest"]:
        return f"blob bytes hash to {got[:19]}…, the manifest says {layer['digest'][:19]}…"
    return None


def _read_at_most(resp, limit: int) -> bytes | None:
    """The whole body of a streamed response, or None as soon as it passes `limit` bytes."""
    data = bytearray()
    for chunk in resp.iter_content(chunk_size=2**16):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


@contextlib.contextmanager
def _registry_errors(oref: OciRef):
    import requests

    try:
        yield
    except SpecpackError:
        raise
    except requests.ConnectionError as exc:
        raise TransferError(f"cannot reach the registry {oref.registry}: {exc.__class__.__name__}",
                            hint="is it running and reachable? For a plain-HTTP registry pass "
                                 "--plain-http") from None
    except requests.RequestException as exc:
        raise TransferError(f"transfer with {oref.registry} failed: {exc}",
                            hint="retry; nothing was written") from None
    except ValueError as exc:  # oras raises ValueError for refused auth and bad session replies
        raise TransferError(f"registry {oref.registry} refused the request: {exc}",
                            hint=_status_hint(401)) from None
