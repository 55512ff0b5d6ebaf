"""A release on the Hugging Face hub, read by range requests: the commit a revision resolves to, its
files with sizes and LFS sha256, small JSON files whole, and safetensors headers by two byte ranges
each (the 8-byte length, then the JSON), never a tensor's bytes (issue 61).

    files = HubFiles.open("hf://org/name@rev")       # resolves the revision to its commit
    files.list() / files.exists(rel) / files.json(rel, what) / files.header(rel) / files.sha256(rel)
                                                      # release_files' interface, plus size(rel)
    files.requests, files.bytes_read                  # what reading cost
    root = files.download(rels, say)                  # into the hub cache, each file verified (build hf://)

The hub's own conventions hold: HF_TOKEN or the saved login, HF_ENDPOINT for a mirror, gated and
private repositories (huggingface_hub's client: HfApi.list_repo_tree / model_info, hf_hub_url,
build_hf_headers). A header's length is bounded by the file's size and MAX_HEADER_BYTES before it is
trusted (safetensors_header.header_length), and a server that answers a range request with the
whole file is refused, not read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from specpack._paths import check_relpath
from specpack.converters.release_files import json_object
from specpack.converters.safetensors_header import TensorMeta, header_length, parse_header
from specpack.errors import InputError

SCHEME = "hf://"
ATTEMPTS = 3  # tries per file download (a dropped connection resumes)
MAX_JSON_BYTES = 16 * 2**20  # a config or index larger than this is not one
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    size: int
    sha256: str | None  # the LFS object's sha256 (None: a small file kept in git)
    blob_id: str | None = None  # its git blob sha1 (what a file kept in git is checked against)


@dataclass
class HubFiles:
    repo_id: str
    revision: str
    commit: str
    entries: dict[str, Entry]
    endpoint: str | None = None
    token: str | bool | None = None
    requests: int = 0
    bytes_read: int = 0
    read: dict = field(default_factory=dict)  # (file, start, length) -> bytes: the commit is fixed, so read once

    @classmethod
    def open(cls, spec: str, endpoint: str | None = None, token: str | bool | None = None) -> "HubFiles":
        """`hf://org/name[@revision]` at the commit its revision names now (branch, tag or commit)."""
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        repo_id, revision = parse(spec)
        endpoint = endpoint or constants.ENDPOINT  # HF_ENDPOINT, as the client read it
        api = HfApi(endpoint=endpoint, token=token)
        try:
            info = api.model_info(repo_id, revision=revision)
            tree = list(api.list_repo_tree(repo_id, revision=info.sha, recursive=True))
        except GatedRepoError:
            raise InputError(f"{spec}: the repository is gated and this token has no access",
                             hint=f"accept its terms on the hub page of {repo_id}, then log in (`hf auth login`) or "
                                  "set HF_TOKEN") from None
        except RevisionNotFoundError:
            raise InputError(f"{spec}: revision {revision!r} not found in {repo_id}",
                             hint="name a branch, tag or commit the repository has") from None
        except RepositoryNotFoundError:
            raise InputError(f"{spec}: repository {repo_id} not found (or private, and this token cannot see it)",
                             hint="check the name; for a private repository log in or set HF_TOKEN") from None
        entries = {e.path: Entry(int(e.size), e.lfs.sha256 if getattr(e, "lfs", None) else None, e.blob_id)
                   for e in tree if getattr(e, "size", None) is not None and hasattr(e, "blob_id")}
        return cls(repo_id, revision, info.sha, entries, endpoint, token, requests=2)

    @property
    def source(self):
        from specpack.schemas import Source

        return Source(kind="hub", repo_id=self.repo_id, revision=self.commit)

    def list(self) -> list[str]:
        return sorted(self.entries)

    def exists(self, rel: str) -> bool:
        return rel in self.entries

    def sha256(self, rel: str) -> str:
        """The hub's LFS sha256 (no byte read), or a small git-kept file's, read whole."""
        import hashlib

        entry = self._entry(rel)
        return entry.sha256 or hashlib.sha256(self._get(rel, 0, entry.size)).hexdigest()

    def size(self, rel: str) -> int:
        return self._entry(rel).size

    def json(self, rel: str, what: str) -> dict:
        """A small JSON file, whole (bounded by MAX_JSON_BYTES)."""
        size = self._entry(rel).size
        if size > MAX_JSON_BYTES:
            raise InputError(f"{self.label(rel)}: {what} is {size} bytes, too large to be a config")
        return json_object(self._get(rel, 0, size), what, self.label(rel))

    def header(self, rel: str) -> dict[str, TensorMeta]:
        """A safetensors file's header by two ranges, checked as a local one is (every entry inside the file)."""
        size, where = self._entry(rel).size, self.label(rel)
        n = header_length(self._get(rel, 0, min(8, size)), size, where)
        return parse_header(self._get(rel, 8, n), n, size, where)

    def label(self, rel: str = "") -> str:
        return f"{SCHEME}{self.repo_id}@{self.commit[:12]}" + (f"/{rel}" if rel else "")

    def download(self, rels: list[str], say=lambda line: None) -> Path:
        """Download `rels` at this commit into the hub cache (huggingface_hub's: a cached file is not fetched
        again, a partial one resumes), retrying a dropped connection; each file checked against the hub's LFS
        sha256 or git blob id before it is used. The cache's snapshot directory of the commit."""
        for rel in rels:  # a listing is the server's word: no name may leave the snapshot directory
            check_relpath(rel, self.label())
        total, done, root = sum(self.size(r) for r in rels), 0, None
        for i, rel in enumerate(rels, 1):
            say(f"[{i}/{len(rels)}] {rel} ({self.size(rel) / 2**20:,.1f} MiB; {done / 2**20:,.1f} of "
                f"{total / 2**20:,.1f} MiB done)")
            path = self._fetch(rel)
            self._verify(rel, path)
            done += self.size(rel)
            root = path.parents[len(Path(rel).parts) - 1]
        say(f"downloaded and verified {len(rels)} files, {total / 2**20:,.1f} MiB, at commit {self.commit[:12]}")
        return root

    def _fetch(self, rel: str) -> Path:
        from huggingface_hub import hf_hub_download

        return self._retrying(rel, "the download", lambda: Path(hf_hub_download(
            self.repo_id, rel, revision=self.commit, endpoint=self.endpoint, token=self.token)))

    def _retrying(self, rel: str, what: str, action):
        """`action()`, tried again (ATTEMPTS in all) where the connection dropped: a download resumes its partial
        file, a range is read again. An InputError, or the hub refusing the request (4xx), is not retried."""
        from huggingface_hub.errors import HfHubHTTPError

        for attempt in range(1, ATTEMPTS + 1):
            try:
                return action()
            except InputError:
                raise
            except HfHubHTTPError as exc:
                status = exc.response.status_code if exc.response is not None else None
                if status is not None and status < 500 or attempt == ATTEMPTS:
                    raise InputError(f"{self.label(rel)}: {what} failed ({exc})") from None
            except Exception as exc:  # a dropped connection
                if attempt == ATTEMPTS:
                    raise InputError(f"{self.label(rel)}: {what} failed {ATTEMPTS} times ({exc})",
                                     hint="check the connection and run again: what arrived is kept and resumed") from None
            log.warning("%s: %s interrupted (try %d of %d); again", self.label(rel), what, attempt, ATTEMPTS)
        raise AssertionError("unreachable")

    def _verify(self, rel: str, path: Path) -> None:
        """The file's bytes against the hub's LFS sha256 (or a git-kept file's blob id); a copy that differs
        is removed from the cache, so that the next run fetches it again."""
        import hashlib

        entry = self._entry(rel)
        digest = hashlib.sha256() if entry.sha256 else hashlib.sha1()
        if entry.sha256 is None:
            if entry.blob_id is None:
                raise InputError(f"{self.label(rel)}: the hub states neither an LFS sha256 nor a git blob id")
            digest.update(b"blob %d\0" % path.stat().st_size)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
        want = entry.sha256 or entry.blob_id
        if digest.hexdigest() != want:
            path.resolve().unlink()
            raise InputError(f"{self.label(rel)}: the downloaded bytes hash to {digest.hexdigest()[:16]}…, the hub "
                             f"lists {want[:16]}… ({'sha256' if entry.sha256 else 'git blob id'})",
                             hint="a corrupted download or a mirror serving other bytes: the bad copy was removed "
                                  "from the hub cache; run again, or check HF_ENDPOINT")

    def _entry(self, rel: str) -> Entry:
        if rel not in self.entries:
            raise InputError(f"{self.label(rel)}: no such file in the repository at this commit",
                             hint="the index or config names a file the repository does not have")
        return self.entries[rel]

    def _get(self, rel: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of `rel`: one range request (again, where the connection dropped),
        at most `length` bytes read; a range read before (a config every check reads) is not asked again."""
        key = (rel, start, length)
        if key not in self.read:
            self.read[key] = self._retrying(rel, f"reading bytes {start}-{start + length - 1}",
                                            lambda: self._get_once(rel, start, length))
        return self.read[key]

    def _get_once(self, rel: str, start: int, length: int) -> bytes:
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        if length <= 0:
            return b""
        url = hf_hub_url(self.repo_id, rel, revision=self.commit, endpoint=self.endpoint)
        headers = {**build_hf_headers(token=self.token), "Range": f"bytes={start}-{start + length - 1}",
                   "Accept-Encoding": "identity"}
        self.requests += 1
        with get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
            if response.status_code == 200 and length < self.entries[rel].size:
                raise InputError(f"{self.label(rel)}: the server does not honour byte ranges (it answered a "
                                 f"{length}-byte range with the whole {self.entries[rel].size}-byte file)",
                                 hint="use a hub or mirror that serves ranges, or download the release and pass its "
                                      "directory")
            if response.status_code not in (200, 206):
                raise InputError(f"{self.label(rel)}: the hub answered {response.status_code} to a range request")
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk[: length - len(data)]
                if len(data) >= length:
                    break
        self.bytes_read += len(data)
        if len(data) != length:
            raise InputError(f"{self.label(rel)}: {len(data)} of the {length} bytes asked for arrived")
        return bytes(data)


def parse(spec: str) -> tuple[str, str]:
    """(repo_id, revision) of `hf://org/name[@revision]` (revision default: main)."""
    if not spec.startswith(SCHEME):
        raise InputError(f"{spec!r} is not a hub address", hint="write hf://org/name or hf://org/name@revision")
    repo, _, revision = spec[len(SCHEME):].partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        raise InputError(f"{spec!r}: the repository must be org/name", hint="write hf://org/name[@revision]")
    return repo, revision or "main"
