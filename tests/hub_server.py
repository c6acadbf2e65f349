"""pytest plugin: a synthetic Hugging Face hub on loopback, speaking what huggingface_hub 2.4 calls.

Endpoints (as the real hub answers them):

- ``GET /api/models/{org}/{repo}/revision/{rev}?blobs=true`` (``HfApi.model_info``): ``sha`` of
  the commit ``rev`` names (branch, tag or full sha) and ``siblings`` with sizes, blob ids, LFS.
  Private repos answer 401 ``X-Error-Code: RepoNotFound`` without a token, 401 "Invalid
  credentials" with a wrong one; unknown revisions 404 ``RevisionNotFound``.
- ``GET|HEAD /{org}/{repo}/resolve/{rev}/{file}``: small files directly; ``*.safetensors``
  (LFS on the hub) 302 to a second server on another port standing in for the CDN, as the real
  hub redirects to signed CDN URLs. Both carry ``X-Repo-Commit``, ``ETag`` and honour ``Range``
  (206 + ``Content-Range``, 416 past the end).

Every request is logged (method, path, Range, whether an Authorization header came and if it
was the right token) so tests can assert reads were ranged and the token never left the hub.
``faults`` injects failures into CDN range reads of at least ``fault_min_bytes``: ``"503"``
answers 503, ``"cut"`` sends the headers and half the body, then drops the connection;
``"stall"`` sends the headers and half the body, then nothing for ``stall_seconds``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

TOKEN = "hf_TestSecretToken_0123456789abcdefXYZ"  # what the fake hub accepts for private repos


@dataclass
class Commit:
    sha: str
    files: dict[str, Path]  # name -> file on disk (served by range, never loaded whole)


@dataclass
class Repo:
    private: bool = False
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha


@dataclass
class Logged:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    range: str | None
    auth: str  # "none", "valid" or "invalid"
    status: int = 0
    fault: str | None = None


class FakeHub:
    """State shared by the hub and CDN servers; tests add repos and read the request log."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[Logged] = []
        self.faults: list[str] = []
        self.stall_seconds = 30.0  # how long a "stall" fault keeps the connection silent
        self.fault_min_bytes = 4096  # faults hit tensor reads, not the 8-byte header-length reads
        self.lock = threading.Lock()
        self.endpoint = self.cdn = ""
        self.client_env: dict[str, str] = {}  # set per test by the ``hub`` fixture

    def add_commit(self, repo_id: str, directory: Path | str, *, branch: str = "main", tags: tuple[str, ...] = (),
                   private: bool = False) -> str:
        """Publish the files of ``directory`` as a new commit on ``branch``; returns its sha."""
        directory = Path(directory)
        files = {p.name: p for p in sorted(directory.iterdir()) if p.is_file()}
        digest = hashlib.sha1(repo_id.encode())
        for name, path in files.items():
            digest.update(name.encode() + _blob_id(path).encode())
        repo = self.repos.setdefault(repo_id, Repo())
        repo.private = repo.private or private
        digest.update(str(len(repo.commits)).encode())
        sha = digest.hexdigest()
        repo.commits[sha] = Commit(sha, files)
        for ref in (branch, *tags):
            repo.refs[ref] = sha
        return sha

    def clear_log(self) -> None:
        with self.lock:
            self.log.clear()

    def requests(self, server: str | None = None) -> list[Logged]:
        with self.lock:
            return [entry for entry in self.log if server in (None, entry.server)]

    def env(self, home: Path) -> dict[str, str]:
        """Environment for a client process: this hub, no saved token, no telemetry."""
        return {"HF_ENDPOINT": self.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _blob_id(path: Path) -> str:
    return hashlib.sha256(f"{path.stat().st_size}:{path.stat().st_mtime_ns}:{path}".encode()).hexdigest()


def _is_lfs(name: str) -> bool:
    return name.endswith(".safetensors")


def _handler(hub: FakeHub, role: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _auth(self) -> str:
            header = self.headers.get("Authorization")
            if header is None:
                return "none"
            return "valid" if header == f"Bearer {TOKEN}" else "invalid"

        def _record(self) -> Logged:
            entry = Logged(role, self.command, urlsplit(self.path).path, self.headers.get("Range"), self._auth())
            with hub.lock:
                hub.log.append(entry)
            return entry

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            entry = self._record()
            path = unquote(urlsplit(self.path).path)
            if role == "cdn":
                match = re.fullmatch(r"/blobs/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)", path)
                if not match:
                    return self._error(entry, 404, "EntryNotFound")
                repo = hub.repos.get(match[1])
                commit = repo and repo.commits.get(match[2])
                if not commit or match[3] not in commit.files:
                    return self._error(entry, 404, "EntryNotFound")
                return self._file(entry, commit, match[3], body, faults=True)
            match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path)
            if match:
                return self._model_info(entry, match[1], match[2])
            match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if match:
                return self._resolve(entry, match[1], match[2], match[3], body)
            self._error(entry, 404, None)

        def _repo(self, entry: Logged, repo_id: str, rev: str) -> tuple[Repo, Commit] | None:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and entry.auth == "none"):
                self._error(entry, 401, "RepoNotFound")
                return None
            if entry.auth == "invalid":
                self._error(entry, 401, None, message="Invalid credentials in Authorization header")
                return None
            sha = repo.refs.get(rev, rev)
            if sha not in repo.commits:
                self._error(entry, 404, "RevisionNotFound")
                return None
            return repo, repo.commits[sha]

        def _model_info(self, entry: Logged, repo_id: str, rev: str) -> None:
            found = self._repo(entry, repo_id, rev)
            if found is None:
                return
            repo, commit = found
            siblings = []
            for name, path in commit.files.items():
                size = path.stat().st_size
                sibling = {"rfilename": name, "size": size, "blobId": _blob_id(path)[:40]}
                if _is_lfs(name):
                    sibling["lfs"] = {"sha256": _blob_id(path), "size": size, "pointerSize": 134}
                siblings.append(sibling)
            self._json(entry, {"_id": "x", "id": repo_id, "modelId": repo_id, "sha": commit.sha,
                               "private": repo.private, "siblings": siblings, "tags": []})

        def _resolve(self, entry: Logged, repo_id: str, rev: str, name: str, body: bool) -> None:
            found = self._repo(entry, repo_id, rev)
            if found is None:
                return
            _, commit = found
            if name not in commit.files:
                return self._error(entry, 404, "EntryNotFound", commit=commit.sha)
            if not _is_lfs(name):
                return self._file(entry, commit, name, body, faults=False)
            size = commit.files[name].stat().st_size
            entry.status = 302
            self.send_response(302)
            self.send_header("Location", f"{hub.cdn}/blobs/{repo_id}/{commit.sha}/{name}")
            self.send_header("X-Repo-Commit", commit.sha)
            self.send_header("X-Linked-Size", str(size))
            self.send_header("X-Linked-Etag", f'"{_blob_id(commit.files[name])}"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _file(self, entry: Logged, commit: Commit, name: str, body: bool, faults: bool) -> None:
            path = commit.files[name]
            size = path.stat().st_size
            start, end, status = 0, size - 1, 200
            requested = self.headers.get("Range")
            if requested:
                match = re.fullmatch(r"bytes=(\d+)-(\d*)", requested.strip())
                if not match or int(match[1]) >= size:
                    self.send_response(416)
                    entry.status = 416
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end, status = int(match[1]), min(int(match[2] or size - 1), size - 1), 206
            fault = None
            if faults and body and requested and end - start + 1 >= hub.fault_min_bytes:
                with hub.lock:
                    fault = entry.fault = hub.faults.pop(0) if hub.faults else None
            if fault == "503":
                return self._error(entry, 503, None, message="injected fault")
            entry.status = status
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit.sha)
            self.send_header("ETag", f'"{_blob_id(path)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if not body:
                return
            length = end - start + 1 if fault not in ("cut", "stall") else (end - start + 1) // 2
            with open(path, "rb") as f:
                f.seek(start)
                while length > 0:
                    chunk = f.read(min(length, 1 << 20))
                    self.wfile.write(chunk)
                    length -= len(chunk)
            if fault == "cut":
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
            if fault == "stall":  # half the body, then silence with the connection open
                self.wfile.flush()
                time.sleep(hub.stall_seconds)
                self.close_connection = True

        def _json(self, entry: Logged, payload: dict) -> None:
            data = json.dumps(payload).encode()
            entry.status = 200
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, entry: Logged, status: int, code: str | None, message: str | None = None,
                   commit: str | None = None) -> None:
            data = json.dumps({"error": message or code or "error"}).encode()
            entry.status = status
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            if message:
                self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


@pytest.fixture(scope="session")
def fake_hub():
    """A running fake hub (+ CDN) on loopback; yields the :class:`FakeHub` (``.endpoint``, ``.env()``)."""
    hub = FakeHub()
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, role)) for role in ("hub", "cdn")]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name=f"fake-hub-{server.server_port}", daemon=True).start()
    hub.endpoint = f"http://127.0.0.1:{servers[0].server_port}"
    hub.cdn = f"http://127.0.0.1:{servers[1].server_port}"
    try:
        yield hub
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def hub(fake_hub, tmp_path, monkeypatch):
    """The session's fake hub with a clean log and no faults; ``client_env`` is for CLI processes.

    ``HF_TOKEN`` is removed from this process (CLI children inherit it) so only tests that
    pass a token send one.
    """
    fake_hub.clear_log()
    fake_hub.faults.clear()
    home = tmp_path / "hf-home"
    home.mkdir()
    fake_hub.client_env = fake_hub.env(home)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return fake_hub
