"""A release on the Hugging Face hub, read by range requests: the commit a revision resolves to, its
files with sizes and LFS sha256, small JSON files whole, and safetensors headers by two byte ranges
each (the 8-byte length, then the JSON), never a tensor's bytes (issue 61).

    files = HubFiles.open("hf://org/name@rev")       # resolves the revision to its commit
    files.list() / files.exists(rel) / files.json(rel, what) / files.header(rel) / files.sha256(rel)
                                                      # release_files' interface, plus size(rel)
    files.requests, files.bytes_read                  # what reading cost

The hub's own conventions hold: HF_TOKEN or the saved login, HF_ENDPOINT for a mirror, gated and
private repositories (huggingface_hub's client: HfApi.list_repo_tree / model_info, hf_hub_url,
build_hf_headers). A header's length is bounded by the file's size and MAX_HEADER_BYTES before it is
trusted (safetensors_header.header_length), and a server that answers a range request with the
whole file is refused, not read.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpack.converters.release_files import json_object
from specpack.converters.safetensors_header import TensorMeta, header_length, parse_header
from specpack.errors import InputError

SCHEME = "hf://"
MAX_JSON_BYTES = 16 * 2**20  # a config or index larger than this is not one


@dataclass(frozen=True)
class Entry:
    size: int
    sha256: str | None  # the LFS object's sha256 (None: a small file kept in git)


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
        entries = {e.path: Entry(int(e.size), e.lfs.sha256 if getattr(e, "lfs", None) else None)
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

    def _entry(self, rel: str) -> Entry:
        if rel not in self.entries:
            raise InputError(f"{self.label(rel)}: no such file in the repository at this commit",
                             hint="the index or config names a file the repository does not have")
        return self.entries[rel]

    def _get(self, rel: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of `rel`: one range request, at most `length` bytes read."""
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
