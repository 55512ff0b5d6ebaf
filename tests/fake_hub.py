"""A small Hugging Face hub on 127.0.0.1 for tests: just the endpoints the real `huggingface_hub`
client (2.x) calls for create_repo / create_branch / create_commit (preupload, LFS batch + basic
PUT, NDJSON commit), for repo_info / list_repo_tree / resolve downloads, and the OIDC token
exchange (`/oauth/token`, answered with the read token).

Read from the client's source (huggingface_hub 2.4): hf_api.py (create_repo, create_commit,
model_info, list_repo_tree), _commit_api.py (_fetch_upload_modes, _send_commit), lfs.py
(post_lfs_batch_info, _upload_single_part) and file_download.py (get_hf_file_metadata: the
X-Repo-Commit, ETag / X-Linked-Etag and Content-Length headers). Errors carry the X-Error-Code
header that `hf_raise_for_status` maps to typed exceptions. Xet is not served: tests that make
files go through LFS set `huggingface_hub.constants.HF_HUB_DISABLE_XET`.

State lives in memory. `gated[repo] = {tokens}` gates a repository: reads without a granted token get the
hub's 403 with X-Error-Code GatedRepo. `tamper()` rewrites a stored file as a malicious or broken server would;
`faults` makes downloads of a path stop early ("drop_once": half the body, once; "drop_download_once": the
same for a download, not a closed range such as a header read; "dead": no body) or
arrive altered ("corrupt": the file's last byte flipped, its listed sha256 unchanged, as a bad mirror).
Downloads honour `Range: bytes=a-b` and `bytes=a-` (206 with Content-Range), unless `ignore_ranges` is set
(a server that answers 200 with the whole file); `bytes_served` counts the body bytes sent.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import pytest

WRITE_TOKEN = "hf_specpack_write"
READ_TOKEN = "hf_specpack_read"


def git_blob_sha1(data) -> str:
    if isinstance(data, Sparse):
        return data.blob_id
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_sha256(data) -> str:
    return data.sha256 if isinstance(data, Sparse) else hashlib.sha256(data).hexdigest()


class Sparse:
    """A file of `size` bytes that begins with `prefix` and is zeros after it (a weight file whose header is
    written at full size and whose weights are left out): ranges are made on request, the file never held.
    Its listed sha256 stands for it (derived from prefix and size), since nothing downloads it whole."""

    def __init__(self, prefix: bytes, size: int):
        self.prefix, self.size = prefix, size
        self.sha256 = hashlib.sha256(prefix + str(size).encode()).hexdigest()
        self.blob_id = hashlib.sha1(prefix + str(size).encode()).hexdigest()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, s: slice) -> bytes:
        start, stop = s.start or 0, min(self.size, self.size if s.stop is None else s.stop)
        head = self.prefix[start:stop]
        return head + bytes(max(0, stop - max(start, len(self.prefix))))


@dataclass
class Repo:
    private: bool
    refs: dict = field(default_factory=dict)  # branch -> commit sha
    commits: dict = field(default_factory=dict)  # sha -> {path: (bytes, is_lfs)}


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class FakeHub:
    """`with FakeHub() as hub:` serves on `hub.url` until the block ends."""

    def __init__(self, lfs_threshold: int = 10 * 2**20):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.announced: set[str] = set()
        self.tokens = {WRITE_TOKEN: "write", READ_TOKEN: "read"}
        self.lfs_threshold = lfs_threshold
        self.faults: dict[str, str] = {}
        self.requests: list[str] = []
        self.ignore_ranges = False
        self.gated: dict[str, set[str]] = {}  # repo -> the tokens granted access (reads by others: 403 GatedRepo)
        self.bytes_served = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- test helpers ----

    def files(self, repo_id: str, revision: str = "main") -> dict:
        repo = self.repos[repo_id]
        return repo.commits[repo.refs.get(revision, revision)]

    def add_virtual(self, repo_id: str, files: dict) -> str:
        """A public repository at one commit holding `files` (path -> bytes, or (prefix, size) for a Sparse
        file), without an upload; its commit sha."""
        stored = {p: (Sparse(*d), True) if isinstance(d, tuple) else (d, len(d) > self.lfs_threshold)
                  for p, d in files.items()}
        self.create_repo(repo_id, private=False)
        repo = self.repos[repo_id]
        sha = _commit_sha(stored, repo.refs["main"], "virtual")
        repo.commits[sha], repo.refs["main"] = stored, sha
        return sha

    def tamper(self, repo_id: str, path: str, data: bytes, revision: str = "main") -> None:
        """Replace a stored file's bytes in place (same commit), as a compromised server would."""
        files = self.files(repo_id, revision)
        files[path] = (data, files[path][1])

    # ---- state changes (called by the handler, under the lock) ----

    def create_repo(self, repo_id: str, private: bool) -> None:
        if repo_id in self.repos:
            raise HubError(409, "You already created this model repo")
        repo = Repo(private)
        sha = _commit_sha({}, None, "initial commit")
        repo.commits[sha], repo.refs["main"] = {}, sha
        self.repos[repo_id] = repo

    def commit(self, repo_id: str, branch: str, lines: list[dict]) -> str:
        repo = self._repo(repo_id)
        if branch not in repo.refs:
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        parent = repo.refs[branch]
        files = dict(repo.commits[parent])
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = (base64.b64decode(value["content"]), False)
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    raise HubError(422, f"LFS object {value['oid']} was never uploaded")
                files[value["path"]] = (self.lfs[value["oid"]], True)
            else:
                raise HubError(400, f"unsupported commit operation {line['key']}")
        sha = _commit_sha(files, parent, lines[0]["value"]["summary"])
        repo.commits[sha], repo.refs[branch] = files, sha
        return sha

    def _repo(self, repo_id: str) -> Repo:
        if repo_id not in self.repos:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return self.repos[repo_id]

    def resolve(self, repo_id: str, revision: str) -> tuple[str, dict]:
        repo = self._repo(repo_id)
        sha = repo.refs.get(revision, revision)
        if sha not in repo.commits:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return sha, repo.commits[sha]


def _commit_sha(files: dict, parent: str | None, summary: str) -> str:
    tree = sorted((p, git_blob_sha1(d)) for p, (d, _) in files.items())
    return hashlib.sha1(json.dumps([tree, parent, summary]).encode()).hexdigest()


_REPO = r"/api/models/(?P<repo>[^/]+/[^/]+)"
ROUTES = [
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("POST", _REPO + r"/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", _REPO + r"/commit/(?P<rev>[^/]+)", "commit"),
    ("POST", _REPO + r"/branch/(?P<rev>[^/]+)", "create_branch"),
    ("GET", _REPO, "repo_info"),
    ("GET", _REPO + r"/revision/(?P<rev>[^/]+)", "repo_info"),
    ("GET", _REPO + r"/tree/(?P<rev>[^/]+)(?P<path>/.*)?", "tree"),
    ("POST", r"/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch", "lfs_batch"),
    ("PUT", r"/lfs-upload/(?P<oid>[0-9a-f]{64})", "lfs_put"),
    ("GET", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ("HEAD", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ("POST", r"/oauth/token", "oauth_token"),
]
# the LFS upload href is a pre-signed URL: it carries no token, only an oid a batch announced
WRITES = {"create_repo", "preupload", "commit", "create_branch", "lfs_batch"}


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_GET(self):
            self._dispatch("GET")

        def do_HEAD(self):
            self._dispatch("HEAD")

        def do_POST(self):
            self._dispatch("POST")

        def do_PUT(self):
            self._dispatch("PUT")

        def _dispatch(self, method: str) -> None:
            url = urlparse(self.path)
            hub.requests.append(f"{method} {url.path}" + (f" [{self.headers['Range']}]" if "Range" in self.headers else ""))
            for verb, pattern, name in ROUTES:
                m = re.fullmatch(pattern, url.path)
                if verb == method and m:
                    args = {k: unquote(v) for k, v in m.groupdict().items() if v is not None}
                    try:
                        self._auth(name, args.get("repo"))
                        body = self._body() if method in ("POST", "PUT") else b""
                        with hub._lock:
                            result = getattr(self, name)(body, parse_qs(url.query), **args)
                        if result is not None:
                            self._json(200, result)
                    except HubError as exc:
                        self._error(exc)
                    return
            self._error(HubError(404, f"no route for {method} {url.path}"))

        # ---- plumbing ----

        def _token(self) -> str | None:
            auth = self.headers.get("Authorization", "")
            return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None

        def _auth(self, name: str, repo_id: str | None) -> None:
            token = self._token()
            if token is not None and token not in hub.tokens:
                raise HubError(401, "Invalid credentials in Authorization header")
            if name in WRITES and token is None:
                raise HubError(401, "You must be authenticated to do this")
            if name in WRITES and hub.tokens[token] != "write":
                raise HubError(403, "You don't have the rights to write to this repo")
            repo = hub.repos.get(repo_id or "")
            if repo is not None and repo.private and token is None:
                raise HubError(401, "Repository not found", "RepoNotFound")
            if repo_id in hub.gated and name not in WRITES and token not in hub.gated[repo_id]:
                raise HubError(403, f"Access to model {repo_id} is restricted. You must have access to it and be "
                                    "authenticated to access it. Please log in.", "GatedRepo")

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _json(self, status: int, data, headers: dict | None = None) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(raw)

        def _error(self, exc: HubError) -> None:
            headers = {"X-Error-Message": exc.message}
            if exc.code:
                headers["X-Error-Code"] = exc.code
            self._json(exc.status, {"error": exc.message}, headers)

        # ---- endpoints ----

        def create_repo(self, body, query):
            req = json.loads(body)
            repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            hub.create_repo(repo_id, req.get("visibility") == "private" or bool(req.get("private")))
            return {"url": f"{hub.url}/{repo_id}", "name": repo_id}

        def validate_yaml(self, body, query):
            return {"errors": [], "warnings": []}

        def create_branch(self, body, query, repo, rev):
            r = hub._repo(repo)
            if rev in r.refs:
                raise HubError(409, f"Branch {rev} already exists")
            r.refs[rev] = r.refs["main"]
            return {}

        def preupload(self, body, query, repo, rev):
            _, files = hub.resolve(repo, rev)
            out = []
            for f in json.loads(body)["files"]:
                lfs = f["size"] >= hub.lfs_threshold
                old = files.get(f["path"])
                oid = None if old is None else (hashlib.sha256(old[0]).hexdigest() if lfs
                                                 else git_blob_sha1(old[0]))
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                            "shouldIgnore": False, "oid": oid})
            return {"files": out}

        def lfs_batch(self, body, query, repo):
            hub._repo(repo)
            hub.announced.update(o["oid"] for o in json.loads(body)["objects"])
            objects = [{"oid": o["oid"], "size": o["size"],
                        "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}}
                       for o in json.loads(body)["objects"] if o["oid"] not in hub.lfs]
            return {"transfer": "basic", "objects": objects}

        def lfs_put(self, body, query, oid):
            if oid not in hub.announced:
                raise HubError(403, "no upload was announced for this oid")
            if hashlib.sha256(body).hexdigest() != oid:
                raise HubError(400, "uploaded bytes do not match the LFS oid")
            hub.lfs[oid] = body
            return {}

        def commit(self, body, query, repo, rev):
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            sha = hub.commit(repo, rev, lines)
            return {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha}

        def oauth_token(self, body, query):
            """OIDC token exchange (Trusted Publishers): any id token gets the read token."""
            if not json.loads(body).get("subject_token"):
                raise HubError(400, "subject_token is missing")
            return {"access_token": READ_TOKEN, "token_type": "bearer", "expires_in": 3600}

        def repo_info(self, body, query, repo, rev="main"):
            sha, files = hub.resolve(repo, rev)
            return {"id": repo, "sha": sha, "private": hub.repos[repo].private,
                    "siblings": [{"rfilename": p} for p in sorted(files)]}

        def tree(self, body, query, repo, rev, path=""):
            _, files = hub.resolve(repo, rev)
            prefix = path.strip("/")
            entries, dirs = [], set()
            for p, (data, lfs) in sorted(files.items()):
                if prefix and not p.startswith(prefix + "/"):
                    continue
                dirs.update("/".join(p.split("/")[:i]) for i in range(1, p.count("/") + 1))
                entry = {"type": "file", "path": p, "size": len(data), "oid": git_blob_sha1(data)}
                if lfs:
                    entry["lfs"] = {"oid": lfs_sha256(data), "size": len(data),
                                    "pointerSize": 134}
                entries.append(entry)
            entries += [{"type": "directory", "path": d, "oid": "0" * 40, "size": 0}
                        for d in sorted(dirs) if d.startswith(prefix)]
            return entries

        def resolve(self, body, query, repo, rev, path):
            sha, files = hub.resolve(repo, rev)
            if path not in files:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
            data, lfs = files[path]
            start, end = (0, len(data)) if hub.ignore_ranges else self._range(len(data))
            part = data[start:end]
            if hub.faults.get(path) == "corrupt" and part and end == len(data):
                part = part[:-1] + bytes([part[-1] ^ 0xFF])
            ranged = "Range" in self.headers and not hub.ignore_ranges
            self.send_response(206 if ranged or start else 200)
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("X-Repo-Commit", sha)
            etag = lfs_sha256(data) if lfs else git_blob_sha1(data)
            self.send_header("X-Linked-Etag" if lfs else "ETag", f'"{etag}"')
            if lfs:
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", str(len(part)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if self.command == "GET":
                self._send_body(path, part)

        def _range(self, size: int) -> tuple[int, int]:
            """[start, end) of `Range: bytes=a-b` or `bytes=a-` (the whole file without one)."""
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if not m:
                return 0, size
            return int(m.group(1)), min(size, int(m.group(2)) + 1) if m.group(2) else size

        def _send_body(self, path: str, part: bytes) -> None:
            fault = hub.faults.get(path) if hub.faults.get(path) != "corrupt" else None
            if fault == "drop_download_once" and re.fullmatch(r"bytes=\d+-\d+", self.headers.get("Range", "")):
                fault = None  # a closed range (a header read), not a download
            if fault in ("drop_once", "drop_download_once"):
                del hub.faults[path]
                part = part[: len(part) // 2]
            elif fault == "dead":
                part = b""
            hub.bytes_served += len(part)  # the handler runs under hub._lock already
            self.wfile.write(part)
            if fault:
                self.wfile.flush()
                self.close_connection = True

    return Handler


@pytest.fixture(autouse=True)
def hermetic_hub_client(monkeypatch, tmp_path):
    """No token from the environment or ~/.cache, and LFS instead of Xet (the fake has no Xet): a hub
    test module imports it (`from fake_hub import hermetic_hub_client`) to make it autouse there."""
    import huggingface_hub.constants as constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # never the user's cache
