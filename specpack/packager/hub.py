"""Push and pull artifacts on the Hugging Face hub (or any hub-compatible endpoint).

    push(ART, "org/name")       verify → create the repo → one commit with every file
    pull("org/name", OUT, public_key=PUB)
                                download the files the manifest lists (nothing else) into a
                                hidden dir beside OUT → verify signature and digests → rename to
                                OUT; on any failure nothing is left

An artifact directory is already a valid model repo (README.md is its model card with the hub
YAML header), so files are uploaded as they are. Tokens come from `token=`, else HF_TOKEN or the
token saved by `hf auth login`; the endpoint from `endpoint=`, else HF_ENDPOINT. With `endpoint=`,
no other host is contacted (see `_client_settings`), and no message shows its credentials.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import shutil
from pathlib import Path

from specpack._atomic import staging_dir
from specpack._paths import check_relpath
from specpack._redact import redact
from specpack.errors import InputError, VerificationError
from specpack.packager.artifact import read_manifest
from specpack.packager.transfer import (PullResult, PushResult, TransferError, check_download,
                                        files_to_upload, require_trust_choice)
from specpack.schemas import MANIFEST_NAME, SIGNATURE_NAME

log = logging.getLogger(__name__)

LOGIN_HINT = "set HF_TOKEN to a token with access to the repo (write access to push), or run " \
             "`hf auth login` (`huggingface-cli login` in older clients)"


def validate_repo_id(repo_id: str) -> str:
    """Return `repo_id` if it is a valid `namespace/name`, else raise InputError."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hf_validate

    problems = [] if str(repo_id).count("/") == 1 else ["a repo id is NAMESPACE/NAME (one '/')"]
    try:
        hf_validate(repo_id)
    except HFValidationError as exc:
        problems.append(str(exc).splitlines()[0])
    if problems:
        raise InputError(f"'{repo_id}' is not a valid Hugging Face repo id", problems=problems,
                         hint="e.g. my-org/llama-3.1-8b-eagle3: letters, digits, '-', '_', '.', "
                              "at most 96 characters per part")
    return repo_id


def push(artifact: Path, repo_id: str, revision: str | None = None, private: bool = False,
         token: str | None = None, endpoint: str | None = None, progress: bool = True,
         public_key: Path | None = None) -> PushResult:
    """Verify `artifact`, then upload all its files to `repo_id` in one commit on `revision`
    (a branch; created from main when missing). `public_key` also checks the signature first."""
    from huggingface_hub import CommitOperationAdd, HfApi

    validate_repo_id(repo_id)
    artifact = Path(artifact)
    report, files = files_to_upload(artifact, public_key, progress)
    ops = [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(artifact / f.path))
           for f in files]
    with _client_settings(endpoint), _hub_errors(repo_id, revision), _progress_bars(progress):
        api = HfApi(endpoint=endpoint, token=_require_token(token))
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, ops, revision=revision,
                                 commit_message=f"specpack: {report.manifest.name}",
                                 commit_description=_commit_description(report))
    log.info("pushed %s to %s@%s (%s)", artifact, repo_id, revision or "main", info.oid)
    return PushResult(f"hf://{repo_id}@{revision or 'main'}", info.oid, len(files),
                      sum(f.size for f in files), url=redact(info.commit_url))


def pull(repo_id: str, out: Path, revision: str | None = None, public_key: Path | None = None,
         allow_unsigned: bool = False, token: str | None = None, endpoint: str | None = None,
         force: bool = False, progress: bool = True) -> PullResult:
    """Download `repo_id` at `revision`, verify it, and only then move it to `out`."""
    validate_repo_id(repo_id)
    source = f"hf://{repo_id}@{revision or 'main'}"
    require_trust_choice(public_key, allow_unsigned, source)
    with staging_dir(Path(out), force) as tmp:
        with _client_settings(endpoint), _hub_errors(repo_id, revision), _progress_bars(progress):
            commit = _download(repo_id, revision, tmp, token, endpoint)
        report = check_download(tmp, public_key, allow_unsigned, f"{source} ({commit[:12]})",
                                progress)
    return PullResult(Path(out), source, commit, report)


def _download(repo_id: str, revision: str | None, tmp: Path, token, endpoint) -> str:
    """Resolve `revision` to a commit; download that commit's specpack.json and model.sig, then
    exactly the files the manifest lists, as real files into `tmp` (a private cache inside it,
    removed after); return the commit sha. Other files of the repo (the .gitattributes the hub
    adds, anything else) are never downloaded: nothing unlisted reaches the artifact."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    info = HfApi(endpoint=endpoint, token=token).repo_info(repo_id, revision=revision)
    _check_names([s.rfilename for s in info.siblings or []], f"hf://{repo_id}@{info.sha}")
    commit, in_repo = info.sha, {s.rfilename for s in info.siblings or []}
    cache = tmp / ".cache"
    where = dict(repo_id=repo_id, revision=commit, local_dir=tmp, cache_dir=cache / "hub", endpoint=endpoint,
                 token=token)
    for name in (MANIFEST_NAME, SIGNATURE_NAME):
        if name in in_repo:
            hf_hub_download(filename=name, **where)
    listed = _listed_files(tmp, f"hf://{repo_id}@{commit[:12]}")
    skipped = sorted(in_repo - set(listed) - {MANIFEST_NAME, SIGNATURE_NAME})
    if set(skipped) - {".gitattributes"}:
        log.warning("%s: not downloading %d files the manifest does not list: %s", repo_id, len(skipped),
                    ", ".join(skipped[:10]))
    snapshot_download(allow_patterns=[glob.escape(p) for p in listed], **where)
    shutil.rmtree(cache, ignore_errors=True)
    return commit


def _listed_files(tmp: Path, source: str) -> list[str]:
    """The plain relative paths the downloaded manifest lists (verify reports any other)."""
    try:
        manifest = read_manifest(tmp)
    except VerificationError as exc:
        raise VerificationError(f"{source} holds no valid {MANIFEST_NAME}: not a specpack artifact",
                                problems=exc.problems, hint="check the repo id and revision") from None
    listed = []
    for entry in manifest.files:
        with contextlib.suppress(InputError):
            if check_relpath(entry.path, MANIFEST_NAME) == entry.path:
                listed.append(entry.path)
    return listed


def _check_names(names: list[str], source: str) -> None:
    """Refuse, before any download, a repo listing a file name that would land outside OUT."""
    problems = []
    for name in names:
        try:
            check_relpath(name, source)
        except InputError:
            problems.append(f"{name!r} escapes the download directory")
    if problems:
        raise VerificationError(f"{source} lists files with unsafe names; nothing was downloaded",
                                problems=problems, hint="the repo was not written by specpack, or was "
                                                        "altered: do not use it")


@contextlib.contextmanager
def _client_settings(endpoint: str | None):
    """Make huggingface_hub talk to `endpoint` only, while a transfer runs.

    The client reads some settings from import-time constants, not from `endpoint=`: the agent
    registry behind its user agent (telemetry) is fetched from huggingface.co, and the token
    exchange of HF_OIDC_RESOURCE goes to `constants.ENDPOINT`. Telemetry is switched off, and the
    constants point at `endpoint` as if HF_ENDPOINT had been set at start (restored after; not
    thread-safe, like the rest of huggingface_hub's global settings)."""
    from huggingface_hub import constants

    names = ("HF_HUB_DISABLE_TELEMETRY", "ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE")
    saved = {name: getattr(constants, name) for name in names}
    constants.HF_HUB_DISABLE_TELEMETRY = True
    if endpoint:
        constants.ENDPOINT = endpoint.rstrip("/")
        constants.HUGGINGFACE_CO_URL_TEMPLATE = constants.ENDPOINT + "/{repo_id}/resolve/{revision}/{filename}"
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(constants, name, value)


def _require_token(token: str | None) -> str:
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise TransferError("no Hugging Face token: pushing needs one with write access",
                            hint=LOGIN_HINT)
    return token


def _commit_description(report) -> str:
    m = report.manifest
    signed = "signed" if report.signed else "unsigned"
    return (f"specpack artifact format v{m.format_version} ({m.drafter.kind} drafter, {signed}, "
            f"{len(m.files)} files), pushed by specpack {m.specpack_version}")


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    was_disabled = are_progress_bars_disabled()
    if not enabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            enable_progress_bars()


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None):
    """Turn the client's exceptions into errors a user can act on."""
    import httpx2
    from huggingface_hub import errors

    oidc_error = getattr(errors, "OIDCError", ())  # newer clients only
    try:
        yield
    except errors.RevisionNotFoundError:
        raise TransferError(f"revision '{revision}' does not exist in {repo_id}",
                            hint="check the branch, tag or commit on the hub, or omit "
                                 "--revision for main") from None
    except errors.RepositoryNotFoundError:
        raise TransferError(f"repo {repo_id} does not exist or this token cannot see it",
                            hint="check the repo id; for a private repo " + LOGIN_HINT) from None
    except errors.HfHubHTTPError as exc:
        raise _http_error(exc, repo_id) from None
    except oidc_error as exc:
        raise TransferError(f"no token from HF_OIDC_RESOURCE: {redact(exc)}",
                            hint="unset HF_OIDC_RESOURCE, or set HF_OIDC_ID_TOKEN") from None
    except (httpx2.ConnectError, httpx2.TimeoutException) as exc:
        raise TransferError(f"cannot reach the hub ({repo_id}): {redact(exc)}",
                            hint="check the network, HF_ENDPOINT or --endpoint") from None
    except httpx2.RemoteProtocolError as exc:
        raise TransferError(f"the connection to the hub was lost ({repo_id}): {redact(exc)}",
                            hint="try again; a pull leaves nothing behind and a push commits "
                                 "all files or none") from None
    except RuntimeError as exc:  # the client wraps failed LFS uploads in a RuntimeError
        if "Error while uploading" not in str(exc):
            raise
        raise TransferError(redact(f"upload to {repo_id} failed: {exc}: {exc.__cause__}"),
                            hint="push again; the hub keeps no partial commit") from None
    except OSError as exc:
        if "Consistency check failed" not in str(exc):
            raise  # local disk problems are reported by staging_dir
        raise TransferError(f"download from {repo_id} was incomplete: {redact(str(exc).splitlines()[0])}",
                            hint="pull again; nothing was written") from None
    except ValueError as exc:  # the listing changed under us: the client's own name check caught it
        if "Invalid filename" not in str(exc):
            raise
        raise VerificationError(f"hf://{repo_id} lists a file with an unsafe name: {redact(exc)}",
                                hint="the repo was not written by specpack, or was altered: do "
                                     "not use it") from None


def _http_error(exc, repo_id: str) -> TransferError:
    status = exc.response.status_code if exc.response is not None else None
    server = redact((exc.server_message or str(exc)).strip().splitlines()[0])
    if status in (401, 403):
        return TransferError(f"the hub refused the request for {repo_id} (HTTP {status}): {server}",
                             hint=LOGIN_HINT)
    return TransferError(f"the hub failed the request for {repo_id} (HTTP {status}): {server}",
                         hint="retry later; if it persists, check the hub's status")
