"""A local stand-in for the Hugging Face hub, for tests: no test that uses it reaches huggingface.co.

`HubServer` serves repos defined in Python (repo id -> files as bytes, branch/tag -> commit) on 127.0.0.1, on a
free port, answering the endpoints huggingface_hub (2.x) calls to download a model:

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]      model_info / repo_info (sizes and LFS with blobs)
    GET  /api/models/{repo}/tree/{rev}[/{path}][?recursive=..]  list_repo_tree (paginated with a Link header)
    HEAD|GET /{repo}/resolve/{rev}/{path}                       file metadata and bytes (Range: 206)

as the hub answers them: `X-Repo-Commit`, `ETag` (the git blob SHA-1; for LFS files the content's SHA-256, also in
`X-Linked-Etag`, with `X-Linked-Size`), errors as an HTTP status with `X-Error-Code` (`RepoNotFound`,
`RevisionNotFound`, `EntryNotFound`, `GatedRepo`). LFS files (by the suffixes of the hub's default .gitattributes)
are redirected (302) to a second server standing in for the CDN, as the hub redirects them; huggingface_hub does
not follow a redirect to another host on HEAD, so it reads their metadata from the 302 and GETs the CDN URL.

Per repo: `gated` (the API answers, as on the hub, but files answer 401 `GatedRepo`), `private` (everything answers
401 with no error code), `token` (the `Authorization: Bearer` token that opens a gated or private repo), and `cut`
({path: n}: the first GET of that file is cut after n bytes of body, the connection closed mid-file, to test resume).
A repo id that is not defined answers 404 `RepoNotFound`; a revision that is neither a defined branch/tag nor one of
the repo's commits answers 404 `RevisionNotFound`.

Every request is recorded (`HubServer.requests`: method, path, Range header, repo, file, status, whether it carried
a token) so tests can assert what was fetched. `HubServer.use(monkeypatch, ...)` points this process's
huggingface_hub at the server (`constants.ENDPOINT` and the resolve URL template, both read at import from
`HF_ENDPOINT`), turns offline mode off, and hides any token; `HubServer.env()` is the same for a subprocess.

Differences from the real hub: plain HTTP (huggingface_hub maps a 401 with no error code to RepositoryNotFoundError
only on https URLs; here it stays an HfHubHTTPError with status 401), no Xet (no `X-Xet-*` headers or `xetHash`, so
huggingface_hub downloads over plain HTTP), and every revision of a repo holds the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

# The hub's default .gitattributes: files stored with Git LFS (and .gguf, which repos add).
LFS_SUFFIXES = (".7z", ".arrow", ".bin", ".bz2", ".ckpt", ".ftz", ".gguf", ".gz", ".h5", ".joblib", ".lfs",
                ".mlmodel", ".model", ".msgpack", ".npy", ".npz", ".onnx", ".ot", ".parquet", ".pb", ".pickle",
                ".pkl", ".pt", ".pth", ".rar", ".safetensors", ".tar", ".tflite", ".tgz", ".wasm", ".xz", ".zip",
                ".zst")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the hub stores larger files with LFS whatever their name


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` as {repo path: bytes}, to define a repo from a saved model."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass
class HubRepo:
    """One repo. `revisions`: branch or tag -> commit (default: main -> a commit hash derived from the files)."""

    files: dict[str, bytes]
    revisions: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    token: str | None = None
    cut: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if not self.revisions:
            digest = hashlib.sha1()
            for path in sorted(self.files):
                digest.update(path.encode() + b"\0" + hashlib.sha1(self.files[path]).digest())
            self.revisions = {"main": digest.hexdigest()}
        self._meta = {path: _FileMeta.of(path, data) for path, data in self.files.items()}
        self._gets: dict[str, int] = {}

    def commit(self, revision: str) -> str | None:
        if revision in self.revisions:
            return self.revisions[revision]
        return revision if revision in self.revisions.values() else None


@dataclass(frozen=True)
class _FileMeta:
    size: int
    blob_id: str  # git object id: of the file, or of its LFS pointer
    sha256: str | None  # LFS files only
    pointer_size: int | None

    @classmethod
    def of(cls, path: str, data: bytes) -> _FileMeta:
        if is_lfs(path, data):
            pointer = lfs_pointer(data)
            return cls(len(data), git_blob_sha1(pointer), hashlib.sha256(data).hexdigest(), len(pointer))
        return cls(len(data), git_blob_sha1(data), None, None)


@dataclass(frozen=True)
class Request:
    """One request the server answered. `file`: the repo file it was for (resolve and CDN URLs), else None."""

    method: str
    path: str
    range: str | None
    repo: str | None
    file: str | None
    status: int
    authorized: bool  # it carried an Authorization header
    cdn: bool = False


class HubServer:
    """The stand-in hub (and its CDN), started on free ports of 127.0.0.1; use as a context manager or start/stop."""

    def __init__(self, repos: dict[str, HubRepo] | None = None, *, page_size: int = 1000, lfs_cdn: bool = True):
        self.repos: dict[str, HubRepo] = dict(repos or {})
        self.page_size = page_size  # entries per page of a tree listing
        self.lfs_cdn = lfs_cdn  # LFS files: 302 to the CDN server (as the hub does), else served from /resolve
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self._home = tempfile.TemporaryDirectory(prefix="hub-server-")
        self.no_token = Path(self._home.name) / "token"  # a token file that does not exist

    def add(self, repo_id: str, files: dict[str, bytes], **options) -> HubRepo:
        repo = self.repos[repo_id] = HubRepo(dict(files), **options)
        return repo

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> HubServer:
        for cdn in (False, True):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
            server.daemon_threads = True
            server.hub, server.cdn = self, cdn  # type: ignore[attr-defined]
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                      name=f"hub-server-{'cdn' if cdn else 'api'}")
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        try:  # close huggingface_hub's pooled connections to us, so no handler thread waits on them
            from huggingface_hub.utils import close_session

            close_session()
        except ImportError:
            pass
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(5)
        self._servers.clear()
        self._threads.clear()
        self._home.cleanup()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The endpoint (what HF_ENDPOINT would be)."""
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    # ---- pointing huggingface_hub at it --------------------------------------------------------------------

    def use(self, monkeypatch, token_path: Path | None = None) -> None:
        """Point this process's huggingface_hub at the server (undone with `monkeypatch`): online, no Xet, and no
        token: HF_TOKEN unset, and the saved token looked for at `token_path` (by default a file that does not
        exist)."""
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            self.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(token_path or self.no_token))
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        try:  # user-agent building looks up AI-agent harnesses at {ENDPOINT}/api/agent-harnesses: say none
            from huggingface_hub.utils import _detect_agent

            monkeypatch.setattr(_detect_agent, "_registry", {"standardEnvVars": [], "harnesses": {}})
        except ImportError:
            pass

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a subprocess that talks to this server (online, no Xet, no token: HF_TOKEN unset and
        HF_TOKEN_PATH a file that does not exist)."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        return {**env, "HF_ENDPOINT": self.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
                "HF_TOKEN_PATH": str(self.no_token)}

    # ---- what was asked ------------------------------------------------------------------------------------

    def file_requests(self, method: str | None = None) -> list[Request]:
        """Requests for repo files (resolve and CDN), optionally of one method."""
        with self._lock:
            return [r for r in self.requests if r.file is not None and (method is None or r.method == method)]

    def fetched(self) -> list[str]:
        """The files whose bytes were sent (a GET answered 200 or 206), in order, repeats included."""
        return [r.file for r in self.file_requests("GET") if r.status in (200, 206)]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


_API = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?P<sub>/.*)?)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_CDN = re.compile(r"^/lfs/(?P<sha>[0-9a-f]{64})$")


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60  # an idle keep-alive connection is closed after this many seconds
    server_version = "hub-stand-in"

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    def do_POST(self):
        self._handle(head=False)

    # ---- dispatch ------------------------------------------------------------------------------------------

    def _handle(self, head: bool) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self._repo = self._file = None
        self._recorded = False
        try:
            if self.server.cdn:  # type: ignore[attr-defined]
                self._cdn(url.path, query, head)
            elif m := _RESOLVE.match(url.path):
                self._resolve(m["repo"], unquote(m["rev"]), unquote(m["file"]), head)
            elif (m := _API.match(url.path)) and self.command != "POST":
                self._api(m, query, head)
            else:
                raise _HubError(404, None, "Sorry, we can't find the page you are looking for.")
        except _HubError as e:
            headers = {"X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            if e.commit:
                headers["X-Repo-Commit"] = e.commit
            self._send(e.status, json.dumps({"error": e.message}).encode(), head, "application/json", headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self._record(0)  # (no-op when the response was sent: it was recorded then)

    def _record(self, status: int) -> None:
        """Record this request, once; before its response goes out, so a client never sees a response that is not
        in `HubServer.requests` yet."""
        if self._recorded:
            return
        self._recorded = True
        self.hub._record(Request(self.command, self.path, self.headers.get("Range"), self._repo, self._file, status,
                                 "Authorization" in self.headers, cdn=self.server.cdn))  # type: ignore[attr-defined]

    def _repo_for(self, repo_id: str, *, files: bool) -> HubRepo:
        self._repo = repo_id
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "RepoNotFound", "Repository not found")
        authorized = repo.token is not None and self.headers.get("Authorization") == f"Bearer {repo.token}"
        if repo.private and not authorized:
            raise _HubError(401, None, "Invalid username or password.")
        if repo.gated and files and not authorized:
            raise _HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                                              f"and be authenticated to access it. Please log in.")
        return repo

    def _commit(self, repo: HubRepo, revision: str) -> str:
        commit = repo.commit(revision)
        if commit is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    # ---- /api/models -----------------------------------------------------------------------------------

    def _api(self, m: re.Match, query: dict, head: bool) -> None:
        repo_id = m["repo"]
        repo = self._repo_for(repo_id, files=False)
        revision = unquote(m["rev"]) if m["rev"] else "main"
        commit = self._commit(repo, revision)
        if m["kind"] == "tree":
            body, link = self._tree(repo, repo_id, commit, unquote(m["sub"] or "").strip("/"), query)
            headers = {"Link": link} if link else {}
            return self._send(200, json.dumps(body).encode(), head, "application/json", headers)
        if m["sub"]:
            raise _HubError(404, None, "Sorry, we can't find the page you are looking for.")
        blobs = query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for path in sorted(repo.files):
            sibling: dict = {"rfilename": path}
            if blobs:
                meta = repo._meta[path]
                sibling.update(blobId=meta.blob_id, size=meta.size)
                if meta.sha256:
                    sibling["lfs"] = {"sha256": meta.sha256, "size": meta.size, "pointerSize": meta.pointer_size}
            siblings.append(sibling)
        org = repo_id.split("/")[0] if "/" in repo_id else None
        info = {"_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
                "author": org, "sha": commit, "lastModified": "2025-01-01T00:00:00.000Z",
                "createdAt": "2025-01-01T00:00:00.000Z", "private": repo.private,
                "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": [], "library_name": "transformers", "siblings": siblings, "spaces": [],
                "usedStorage": sum(m.size for m in repo._meta.values())}
        self._send(200, json.dumps(info).encode(), head, "application/json")

    def _tree(self, repo: HubRepo, repo_id: str, commit: str, sub: str, query: dict) -> tuple[list, str | None]:
        recursive = query.get("recursive", "").lower() in ("1", "true")
        prefix = sub + "/" if sub else ""
        if sub and sub not in repo.files and not any(p.startswith(prefix) for p in repo.files):
            raise _HubError(404, "EntryNotFound", f"{sub} does not exist on \"{commit}\"", commit)
        entries: dict[str, dict] = {}
        for path in sorted(repo.files):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                folder = prefix + "/".join(parts[:depth])
                if (recursive or depth == 1) and folder not in entries:
                    entries[folder] = {"type": "directory", "oid": git_blob_sha1(folder.encode()), "size": 0,
                                       "path": folder}
            if recursive or len(parts) == 1:
                meta = repo._meta[path]
                entry = {"type": "file", "oid": meta.blob_id, "size": meta.size, "path": path}
                if meta.sha256:
                    entry["lfs"] = {"oid": meta.sha256, "size": meta.size, "pointerSize": meta.pointer_size}
                entries[path] = entry
        listing = sorted(entries.values(), key=lambda e: (e["type"] != "directory", e["path"]))
        start = int(query.get("cursor", 0))
        page = listing[start:start + self.hub.page_size]
        link = None
        if start + self.hub.page_size < len(listing):
            rest = "&".join(f"{k}={quote(v)}" for k, v in query.items() if k != "cursor")
            url = f"{self.hub.url}{urlsplit(self.path).path}?{rest}&cursor={start + self.hub.page_size}"
            link = f'<{url}>; rel="next"'
        return page, link

    # ---- /{repo}/resolve/{rev}/{file} and the CDN -----------------------------------------------------------

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        self._file = path
        repo = self._repo_for(repo_id, files=True)
        commit = self._commit(repo, revision)
        if path not in repo.files:
            raise _HubError(404, "EntryNotFound", f"Entry not found: {path}", commit)
        meta = repo._meta[path]
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if meta.sha256:
            headers.update({"X-Linked-Etag": f'"{meta.sha256}"', "X-Linked-Size": str(meta.size)})
            if self.hub.lfs_cdn:
                location = f"{self.hub.cdn_url}/lfs/{meta.sha256}?repo={quote(repo_id, safe='')}&file={quote(path)}"
                headers.update({"Location": location, "ETag": f'"{meta.blob_id}"'})
                body = f"Found. Redirecting to {location}".encode()
                return self._send(302, body, head, "text/plain; charset=utf-8", headers)
            headers["ETag"] = f'"{meta.sha256}"'
        else:
            headers["ETag"] = f'"{meta.blob_id}"'
        self._send_file(repo, path, head, headers)

    def _cdn(self, url_path: str, query: dict, head: bool) -> None:
        m = _CDN.match(url_path)
        repo = self.hub.repos.get(query.get("repo", ""))
        self._repo, self._file = query.get("repo"), query.get("file")
        if not m or repo is None or self._file not in repo.files or repo._meta[self._file].sha256 != m["sha"]:
            raise _HubError(403, None, "Access Denied")  # as S3/CloudFront answer a URL they did not sign
        self._send_file(repo, self._file, head, {"ETag": f'"{m["sha"]}"', "Accept-Ranges": "bytes"})

    def _send_file(self, repo: HubRepo, path: str, head: bool, headers: dict) -> None:
        data = repo.files[path]
        start, end = 0, len(data)
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
            if not m or int(m[1]) >= len(data):
                headers["Content-Range"] = f"bytes */{len(data)}"
                return self._send(416, b"", head, "text/plain", headers)
            start, end = int(m[1]), min(len(data), int(m[2]) + 1) if m[2] else len(data)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        cut = None
        if not head:
            with self.hub._lock:
                first = repo._gets.get(path, 0) == 0
                repo._gets[path] = repo._gets.get(path, 0) + 1
            if first and path in repo.cut and repo.cut[path] < end - start:
                cut = repo.cut[path]
        self._send(status, data[start:end], head, "application/octet-stream", headers, cut=cut)

    # ---- the response ---------------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, head: bool, content_type: str, headers: dict | None = None,
              cut: int | None = None) -> None:
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if head:
            return
        if cut is None:
            self.wfile.write(body)
            return
        self.wfile.write(body[:cut])  # then the connection drops, mid-file
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
