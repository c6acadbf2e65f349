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

The write side, as ``HfApi.create_repo``, ``list_repo_refs``, ``auth_check`` and ``create_commit``
(git LFS path, ``HF_HUB_DISABLE_XET=1``) call it:

- ``GET /api/models/{repo}/refs``, ``GET /api/models/{repo}/auth-check/write`` (403 for the
  read-only :data:`READ_TOKEN`), ``POST /api/repos/create`` (a new repo's ``main`` holds
  ``.gitattributes``, as on the hub);
- ``POST /api/models/{repo}/preupload/{rev}``: ``lfs`` for ``*.safetensors`` and files over 10 MB,
  else ``regular``, with the oid the branch holds at that path (sha256 for LFS, git sha1 else);
- ``POST /{repo}.git/info/lfs/objects/batch``: no ``actions`` for a blob that repo already stores (what a
  rerun after a failure finds), a single PUT URL on the storage server below ``multipart_bytes``,
  else multipart (``chunk_size`` and one URL per part; completion POSTed back to the hub). Every
  stored blob's sha256 and size are checked against what was announced;
- ``POST /api/models/{repo}/commit/{rev}`` (NDJSON: header, ``file``, ``lfsFile``, ``deletedFile``):
  refused with 412 unless ``parentCommit`` is the branch head, 422 if an LFS blob is missing.

``write_faults`` holds ``(where, kind)`` pairs, each used once by the next request to ``where``:
``"put"`` (a single-part upload), ``"part"`` (a multipart part), ``"batch"``, ``"commit"``;
``kind`` ``"503"`` answers 503, ``"cut"`` takes half the body then drops the connection, ``"stall"``
takes half the body then waits ``stall_seconds`` before taking the rest, and for
``"commit"`` ``"lost"`` commits and then drops the connection before answering, ``"moved"`` lands
another writer's commit (a README) on the branch first.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

TOKEN = "hf_TestSecretToken_0123456789abcdefXYZ"  # what the fake hub accepts for private repos, and writes
READ_TOKEN = "hf_TestReadOnlyToken_0123456789abcdef"  # reads what TOKEN reads; every write is refused (403)
LFS_THRESHOLD = 10 * 1000 * 1000  # files over this go to LFS whatever their name, as on the hub


@dataclass
class Commit:
    sha: str
    files: dict[str, Path]  # name -> file on disk (served by range, never loaded whole)
    oids: dict[str, str] = field(default_factory=dict)  # name -> sha256 (LFS) or git sha1, for committed uploads
    parent: str | None = None
    message: str = ""


@dataclass
class Repo:
    private: bool = False
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    tags: set[str] = field(default_factory=set)  # which refs are tags


@dataclass
class Logged:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    range: str | None
    auth: str  # "none", "valid", "read" (READ_TOKEN) or "invalid"
    status: int = 0
    fault: str | None = None


class FakeHub:
    """State shared by the hub and CDN servers; tests add repos and read the request log."""

    STALL_SECONDS = 30.0  # a "stall" fault's silence, unless a test sets stall_seconds (the hub fixture resets it)

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[Logged] = []
        self.faults: list[str] = []
        self.stall_seconds = self.STALL_SECONDS  # how long a "stall" fault keeps the connection silent
        self.unstall = threading.Event()  # set: a stall ends now (a test that acts during one, then lets it go)
        self.fault_min_bytes = 4096  # faults hit tensor reads, not the 8-byte header-length reads
        self.lock = threading.Lock()
        self.endpoint = self.cdn = ""
        self.client_env: dict[str, str] = {}  # set per test by the ``hub`` fixture
        self.write_faults: list[tuple[str, str]] = []
        self.multipart_bytes = 64 * 1024  # LFS uploads from this size on are multipart
        self.part_bytes = 32 * 1024  # the chunk_size of a multipart upload
        self.storage = Path(tempfile.mkdtemp(prefix="fake-hub-blobs-"))  # uploaded blobs, by sha256
        self.blobs: dict[tuple[str, str], Path] = {}  # (repo, sha256) -> blob whose content was checked

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
        repo.tags.update(tags)
        return sha

    def head(self, repo_id: str, branch: str = "main") -> Commit:
        repo = self.repos[repo_id]
        return repo.commits[repo.refs[branch]]

    def create_repo(self, repo_id: str, private: bool = False) -> str:
        """A new repo as the hub makes it: ``main`` holding ``.gitattributes``."""
        directory = Path(tempfile.mkdtemp(prefix="fake-hub-new-", dir=self.storage))
        (directory / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
        return self.add_commit(repo_id, directory, private=private)

    def write_fault(self, where: str) -> str | None:
        with self.lock:
            for n, (place, kind) in enumerate(self.write_faults):
                if place == where:
                    del self.write_faults[n]
                    return kind
        return None

    def clear_log(self) -> None:
        with self.lock:
            self.log.clear()

    def requests(self, server: str | None = None) -> list[Logged]:
        with self.lock:
            return [entry for entry in self.log if server in (None, entry.server)]

    def env(self, home: Path) -> dict[str, str]:
        """Environment for a client process: this hub, no saved token, no telemetry."""
        return {"HF_ENDPOINT": self.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_XET": "1"}


def git_sha1(data: bytes) -> str:
    """The git blob id of ``data`` (what the hub reports for a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _blob_id(path: Path) -> str:
    return hashlib.sha256(f"{path.stat().st_size}:{path.stat().st_mtime_ns}:{path}".encode()).hexdigest()


def _is_lfs(name: str, size: int = 0) -> bool:
    return name.endswith(".safetensors") or size > LFS_THRESHOLD


REPO = r"([^/]+/[^/]+)"
WRITE_ROUTES = {  # path pattern -> handler method, tried before the read side's routes
    "GET": ((rf"/api/models/{REPO}/refs", "_refs"), (rf"/api/models/{REPO}/auth-check/write", "_auth_check")),
    "POST": ((r"/api/repos/create", "_create_repo"), (rf"/api/models/{REPO}/preupload/(.+)", "_preupload"),
             (rf"/{REPO}\.git/info/lfs/objects/batch", "_lfs_batch"),
             (rf"/{REPO}\.git/info/lfs/complete_multipart/([0-9a-f]{{64}})", "_complete_multipart"),
             (rf"/api/models/{REPO}/commit/(.+)", "_commit")),
}


def _handler(hub: FakeHub, role: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _auth(self) -> str:
            header = self.headers.get("Authorization")
            if header is None:
                return "none"
            return {f"Bearer {TOKEN}": "valid", f"Bearer {READ_TOKEN}": "read"}.get(header, "invalid")

        def _record(self) -> Logged:
            entry = Logged(role, self.command, urlsplit(self.path).path, self.headers.get("Range"), self._auth())
            with hub.lock:
                hub.log.append(entry)
            return entry

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_POST(self) -> None:
            entry = self._record()
            path = unquote(urlsplit(self.path).path)
            if role == "hub":
                for pattern, method in WRITE_ROUTES["POST"]:
                    match = re.fullmatch(pattern, path)
                    if match:
                        return getattr(self, method)(entry, *match.groups())
            self._drain()
            self._error(entry, 404, None)

        def do_PUT(self) -> None:
            entry = self._record()
            path = unquote(urlsplit(self.path).path)
            match = re.fullmatch(r"/upload/([^/]+/[^/]+)/([0-9a-f]{64})(?:/part/(\d+))?", path)
            if role != "cdn" or not match:
                self._drain()
                return self._error(entry, 404, None)
            self._put(entry, match[1], match[2], int(match[3]) if match[3] else None)

        # --- the write side -------------------------------------------------------------

        def _body(self) -> Iterator[bytes]:
            """The request body as it arrives (Content-Length or chunked), never whole in memory."""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return
                    left = size
                    while left:
                        chunk = self.rfile.read(min(left, 1 << 20))
                        if not chunk:
                            return
                        left -= len(chunk)
                        yield chunk
                    self.rfile.readline()
            else:
                left = int(self.headers.get("Content-Length") or 0)
                while left:
                    chunk = self.rfile.read(min(left, 1 << 20))
                    if not chunk:
                        return
                    left -= len(chunk)
                    yield chunk

        def _drain(self) -> None:
            for _ in self._body():
                pass

        def _json_body(self) -> dict:
            return json.loads(b"".join(self._body()) or b"{}")

        def _writer(self, entry: Logged, repo_id: str | None = None) -> bool:
            """Whether the request may write (``repo_id``, if given, must exist); else answers it."""
            if entry.auth in ("none", "invalid"):
                self._error(entry, 401, None, message="Invalid credentials in Authorization header")
                return False
            if repo_id is not None and repo_id not in hub.repos:
                self._error(entry, 404, "RepoNotFound")
                return False
            if entry.auth == "read":
                self._error(entry, 403, None, message="You don't have the rights to write to this repo")
                return False
            return True

        def _refs(self, entry: Logged, repo_id: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and entry.auth == "none") or entry.auth == "invalid":
                return self._error(entry, 404 if entry.auth in ("valid", "read") else 401, "RepoNotFound")
            branches, tags = [], []
            for name, sha in repo.refs.items():
                kind = "tags" if name in repo.tags else "heads"
                (tags if kind == "tags" else branches).append(
                    {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": sha})
            self._json(entry, {"branches": branches, "tags": tags, "converts": [], "pullRequests": []})

        def _auth_check(self, entry: Logged, repo_id: str) -> None:
            if self._writer(entry, repo_id):
                self._json(entry, {})

        def _create_repo(self, entry: Logged) -> None:
            payload = self._json_body()
            if not self._writer(entry):
                return
            repo_id = f"{payload.get('organization')}/{payload.get('name')}"
            if repo_id in hub.repos:
                return self._error(entry, 409, None, message="You already created this model repo")
            hub.create_repo(repo_id, private=payload.get("visibility") == "private")
            self._json(entry, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})

        def _branch_head(self, entry: Logged, repo_id: str, rev: str) -> Commit | None:
            repo = hub.repos[repo_id]
            if rev not in repo.refs or rev in repo.tags:
                self._error(entry, 404, "RevisionNotFound")
                return None
            return repo.commits[repo.refs[rev]]

        def _preupload(self, entry: Logged, repo_id: str, rev: str) -> None:
            payload = self._json_body()
            if not self._writer(entry, repo_id):
                return
            head = self._branch_head(entry, repo_id, rev)
            if head is None:
                return
            files = []
            for item in payload.get("files", []):
                lfs = _is_lfs(item["path"], item["size"])
                files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                              "oid": head.oids.get(item["path"])})
            self._json(entry, {"files": files, "commitOid": head.sha})

        def _lfs_batch(self, entry: Logged, repo_id: str) -> None:
            payload = self._json_body()
            if not self._writer(entry, repo_id):
                return
            fault = hub.write_fault("batch")
            if fault:
                return self._error(entry, 503, None, message="injected fault")
            objects = []
            for item in payload.get("objects", []):
                oid, size = item["oid"], item["size"]
                answer: dict = {"oid": oid, "size": size, "authenticated": True}
                if (repo_id, oid) not in hub.blobs:
                    if size < hub.multipart_bytes:
                        answer["actions"] = {"upload": {"href": f"{hub.cdn}/upload/{repo_id}/{oid}"}}
                    else:
                        parts = -(-size // hub.part_bytes)
                        header = {"chunk_size": str(hub.part_bytes)}
                        header.update({f"{n:05d}": f"{hub.cdn}/upload/{repo_id}/{oid}/part/{n}"
                                       for n in range(1, parts + 1)})
                        answer["actions"] = {"upload": {
                            "href": f"{hub.endpoint}/{repo_id}.git/info/lfs/complete_multipart/{oid}?size={size}",
                            "header": header}}
                objects.append(answer)
            self._json(entry, {"transfer": "basic", "objects": objects})

        def _put(self, entry: Logged, repo_id: str, oid: str, part: int | None) -> None:
            fault = hub.write_fault("part" if part else "put")
            entry.fault = fault
            if fault == "503":
                self._drain()
                return self._error(entry, 503, None, message="injected fault")
            incoming = f"{repo_id.replace('/', '--')}-{oid}"
            name = f"{incoming}.part{part}" if part else f"{incoming}.{threading.get_ident()}"
            where = hub.storage / "incoming" / name
            where.parent.mkdir(exist_ok=True)
            expected = int(self.headers.get("Content-Length") or 0)
            taken = 0
            with open(where, "wb") as f:
                for chunk in self._body():
                    f.write(chunk)
                    taken += len(chunk)
                    if fault == "cut" and taken >= max(1, expected // 2):
                        self.close_connection = True  # half the body taken, then the connection drops
                        self.connection.shutdown(2)
                        return
                    if fault == "stall" and taken >= max(1, expected // 2):
                        entry.status = -1  # seen by tests: the upload is under way and now stalled
                        hub.unstall.wait(hub.stall_seconds)
                        fault = None
            if part:
                etag = hashlib.md5(where.read_bytes()).hexdigest()
                entry.status = 200
                self.send_response(200)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if not self._store(entry, repo_id, oid, where):
                return
            entry.status = 200
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _store(self, entry: Logged, repo_id: str, oid: str, where: Path) -> bool:
            """Keep an uploaded blob if its content is what its oid says (as the hub checks)."""
            if file_sha256(where) != oid:
                where.unlink()
                self._error(entry, 400, None, message="sha256 of the uploaded content does not match its oid")
                return False
            final = hub.storage / oid
            os.replace(where, final)
            with hub.lock:
                hub.blobs[(repo_id, oid)] = final
            return True

        def _complete_multipart(self, entry: Logged, repo_id: str, oid: str) -> None:
            payload = self._json_body()  # no token: the URL the batch handed out is the authority (signed on the hub)
            parts = sorted(payload.get("parts", []), key=lambda p: p["partNumber"])
            incoming = f"{repo_id.replace('/', '--')}-{oid}"
            where = hub.storage / "incoming" / f"{incoming}.whole"
            with open(where, "wb") as out:
                for n, part in enumerate(parts, 1):
                    piece = hub.storage / "incoming" / f"{incoming}.part{n}"
                    if part["partNumber"] != n or not piece.exists() or \
                            f'"{hashlib.md5(piece.read_bytes()).hexdigest()}"' != part["etag"]:
                        return self._error(entry, 400, None, message=f"part {n} missing or its etag differs")
                    out.write(piece.read_bytes())
            if self._store(entry, repo_id, oid, where):
                self._json(entry, {})

        def _commit(self, entry: Logged, repo_id: str, rev: str) -> None:
            lines = [json.loads(line) for line in b"".join(self._body()).splitlines() if line.strip()]
            if not self._writer(entry, repo_id):
                return
            head = self._branch_head(entry, repo_id, rev)
            if head is None:
                return
            fault = hub.write_fault("commit")
            entry.fault = fault
            if fault == "503":
                return self._error(entry, 503, None, message="injected fault")
            if fault == "moved":  # another writer's commit lands first
                readme = hub.storage / "git-someone-elses-readme"
                readme.write_text("# someone else's model card\n")
                moved = Commit(hashlib.sha1(f"{head.sha}-moved".encode()).hexdigest(),
                               {**head.files, "README.md": readme}, {**head.oids}, parent=head.sha)
                with hub.lock:
                    hub.repos[repo_id].commits[moved.sha] = moved
                    hub.repos[repo_id].refs[rev] = moved.sha
                head = moved
            header = lines[0]["value"] if lines and lines[0]["key"] == "header" else {}
            if header.get("parentCommit") not in (None, head.sha):
                return self._error(entry, 412, None,
                                   message="A commit has happened since. Please refresh and try again.")
            files, oids = dict(head.files), dict(head.oids)
            for line in lines[1:]:
                value = line["value"]
                name = value["path"]
                if line["key"] == "deletedFile":
                    files.pop(name, None)
                    oids.pop(name, None)
                elif line["key"] == "file":
                    data = base64.b64decode(value["content"])
                    blob = hub.storage / f"git-{git_sha1(data)}"
                    blob.write_bytes(data)
                    files[name], oids[name] = blob, git_sha1(data)
                elif line["key"] == "lfsFile":
                    blob = hub.blobs.get((repo_id, value["oid"]))
                    if blob is None or blob.stat().st_size != value.get("size", blob.stat().st_size):
                        return self._error(entry, 422, None, message=f"LFS object {value['oid']} not uploaded")
                    files[name], oids[name] = blob, value["oid"]
            repo = hub.repos[repo_id]
            digest = hashlib.sha1(f"{head.sha}{len(repo.commits)}".encode())
            for name in sorted(files):
                digest.update(name.encode() + oids.get(name, _blob_id(files[name])).encode())
            sha = digest.hexdigest()
            with hub.lock:
                repo.commits[sha] = Commit(sha, files, oids, parent=head.sha, message=header.get("summary", ""))
                repo.refs[rev] = sha
            if fault == "lost":  # committed, but the answer never arrives
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self._json(entry, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{sha}", "commitOid": sha,
                               "pullRequestUrl": None})

        def _serve(self, body: bool) -> None:
            entry = self._record()
            path = unquote(urlsplit(self.path).path)
            if role == "hub":
                for pattern, method in WRITE_ROUTES["GET"]:
                    match = re.fullmatch(pattern, path)
                    if match:
                        return getattr(self, method)(entry, *match.groups())
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
                oid = commit.oids.get(name)
                sibling = {"rfilename": name, "size": size, "blobId": (oid or _blob_id(path))[:40]}
                if _is_lfs(name, size):
                    sibling["lfs"] = {"sha256": oid or _blob_id(path), "size": size, "pointerSize": 134}
                    sibling["blobId"] = git_sha1(f"oid sha256:{sibling['lfs']['sha256']}".encode())
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
        shutil.rmtree(hub.storage, ignore_errors=True)


@pytest.fixture
def hub(fake_hub, tmp_path, monkeypatch):
    """The session's fake hub with a clean log and no faults; ``client_env`` is for CLI processes.

    ``HF_TOKEN`` is removed from this process (CLI children inherit it) so only tests that
    pass a token send one.
    """
    fake_hub.clear_log()
    fake_hub.faults.clear()
    fake_hub.write_faults.clear()
    fake_hub.stall_seconds = FakeHub.STALL_SECONDS  # a test may change it for itself
    fake_hub.unstall.clear()
    home = tmp_path / "hf-home"
    home.mkdir()
    fake_hub.client_env = fake_hub.env(home)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return fake_hub
