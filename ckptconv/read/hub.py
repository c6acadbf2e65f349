"""Sources on the Hugging Face hub (``hf://org/repo[@rev]``), and its local cache when offline.

The revision is resolved to one commit when opened, and every later read is pinned to it, so
a conversion reads one consistent snapshot and its report says which. Reads are ranged
(:mod:`ckptconv.read.ranged`). Without the hub (``HF_HUB_OFFLINE=1``, or no connection at all)
an ``hf://`` source is read from the local Hugging Face cache instead (:class:`CachedHubSource`),
as huggingface_hub itself would.

Credentials: the token in ``hf_token_file`` if given, else huggingface_hub's own lookup
(``HF_TOKEN``, then a saved ``hf auth login``). The token lives only in request headers: it is
never part of a message, a ``repr``, the provenance or anything written.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import quote

from ckptconv.errors import BadInputError, CkptConvError, RemoteError
from ckptconv.read.sources import check_regular
from ckptconv.read.waits import Deadlines, announced
from ckptconv.read.ranged import (
    CHECKPOINT_SUFFIXES, CONFIG_FILE, Retries, RetryPolicy, Sink, checkpoint_files, one_line, ranged_read,
)

log = logging.getLogger("ckptconv")


class HubSource:
    """``hf://org/repo[@revision]``: the revision resolved once to a commit, files read by HTTP range."""

    retry = RetryPolicy()
    transient_status = frozenset({408, 429, 500, 502, 503, 504})

    def __init__(self, uri: str, token: str | None = None) -> None:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.utils import build_hf_headers

        self.uri = uri.rstrip("/")
        self.repo, self.revision = parse_hub_uri(self.uri)
        self._endpoint = constants.ENDPOINT
        self.deadlines = Deadlines.from_env()
        self._headers = build_hf_headers(token=token)  # holds the token; never printed
        info = self._model_info(HfApi(endpoint=self._endpoint), token)
        self.commit = info.sha
        if not self.commit:
            raise RemoteError(f"{self.uri}: the hub did not say which commit {self.revision!r} is")
        self._sizes = {s.rfilename: s.size for s in info.siblings or [] if "/" not in s.rfilename}
        self._blob_ids = {s.rfilename: (s.lfs.sha256 if s.lfs else s.blob_id) for s in info.siblings or []}

    @classmethod
    def open(cls, uri: str, *, hf_token_file: str | None = None) -> HubSource | CachedHubSource:
        """Open ``uri``; the token comes from ``hf_token_file``, else HF_TOKEN or a saved login.

        Offline (``HF_HUB_OFFLINE=1``), or when the hub cannot be reached at all, the revision is
        resolved from the local Hugging Face cache as huggingface_hub resolves it, and a line says
        so; without a cached copy, one line says that instead.
        """
        from huggingface_hub import constants

        repo, revision = parse_hub_uri(uri.rstrip("/"))
        if constants.HF_HUB_OFFLINE:
            return CachedHubSource.find(uri, repo, revision, why="HF_HUB_OFFLINE is set", missing=BadInputError)
        token = hub_token(hf_token_file)
        try:
            return cls(uri, token)
        except _Unreachable as err:
            return CachedHubSource.find(uri, repo, revision, why=f"cannot reach {err.endpoint} ({err.reason})",
                                        missing=RemoteError)

    def _model_info(self, api, token: str | None):
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                            RevisionNotFoundError)

        retries = Retries(self.uri, self._endpoint, self.retry, self.deadlines)
        while True:
            try:
                with announced(f"the file list of {self.uri} from {self._endpoint}", self.deadlines):
                    return api.model_info(self.repo, revision=self.revision, files_metadata=True, token=token,
                                          timeout=self.deadlines.request_seconds)
            except RevisionNotFoundError:
                raise BadInputError(f"{self.uri}: revision {self.revision!r} not found") from None
            except GatedRepoError:
                raise BadInputError(f"{self.uri}: gated repository; accept its terms on the hub and pass a token "
                                    "(HF_TOKEN or --hf-token-file)") from None
            except RepositoryNotFoundError:
                raise BadInputError(f"{self.uri}: repository not found, or private and the token (HF_TOKEN or "
                                    "--hf-token-file) is missing or lacks access") from None
            except HfHubHTTPError as err:
                status = err.response.status_code if err.response is not None else None
                if status in (401, 403):
                    raise BadInputError(f"{self.uri}: access denied (HTTP {status}); check the token") from None
                if status not in self.transient_status:
                    raise RemoteError(f"{self.uri}: hub API error: {one_line(err)}") from None
                error: BaseException = err
            except Exception as err:
                if not self._transient(err):
                    raise
                if _unreachable(err):  # no network: the cache's copy, or one line saying there is none
                    raise _Unreachable(self._endpoint, one_line(err)) from None
                error = err
            retries.failed(error)

    def _transient(self, err: BaseException) -> bool:
        import httpx2

        return isinstance(err, (httpx2.TransportError, _TransientStatus))

    def _url(self, name: str) -> str:
        return f"{self._endpoint}/{self.repo}/resolve/{self.commit}/{quote(name)}"

    def exists(self, name: str) -> bool:
        return name in self._sizes

    def size(self, name: str) -> int:
        if name not in self._sizes:
            raise BadInputError(f"{self.uri}/{name}: file not found at commit {self.commit}")
        size = self._sizes[name]
        if size is None:
            raise RemoteError(f"{self.uri}/{name}: the hub did not report the file size")
        return size

    def read_range(self, name: str, offset: int, length: int) -> bytearray | memoryview:
        from huggingface_hub.utils import get_session

        where = f"{self.uri}/{name}"
        size = self.size(name)
        if offset + length > size:
            raise BadInputError(f"{where}: file ends at byte {size}, expected {length} bytes from offset {offset} "
                                "(truncated?)")
        if length == 0:
            return bytearray()
        url = self._url(name)

        def fetch(start: int, count: int, sink: Sink) -> None:
            headers = {**self._headers, "Range": f"bytes={start}-{start + count - 1}"}
            with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                      timeout=self.deadlines.request_seconds) as response:
                status = response.status_code
                if status in self.transient_status:
                    raise _TransientStatus(f"HTTP {status}")
                if status in (401, 403, 404):
                    raise BadInputError(f"{where}: HTTP {status} reading commit {self.commit} "
                                        "(token missing or lacks access?)")
                whole = status == 200 and start == 0 and count == size
                if status != 206 and not whole:
                    raise RemoteError(f"{where}: expected 206 Partial Content for a range read, got HTTP {status}")
                for chunk in response.iter_bytes():  # as it arrives: a cut keeps what came
                    sink(chunk)

        return ranged_read(where, offset, length, fetch, self._transient, self.retry, self.deadlines, self._endpoint)

    def list_names(self) -> list[str]:
        return sorted(self._sizes)

    def provenance(self) -> dict:
        return {"uri": self.uri, "kind": "hf", "repo": self.repo, "revision": self.revision,
                "commit": self.commit,
                "files": {name: self._blob_ids.get(name) for name in checkpoint_files(self._sizes)}}


class _TransientStatus(Exception):
    """A 429/5xx answer to a ranged read: worth another try."""


class _Unreachable(Exception):
    """No connection to the hub at all: not retried (as huggingface_hub, the cache is asked instead;
    a Prefect task retries the whole run)."""

    def __init__(self, endpoint: str, reason: str) -> None:
        super().__init__(reason)
        self.endpoint, self.reason = endpoint, reason


def _unreachable(err: BaseException) -> bool:
    """No connection could be made (refused, no route, no DNS, connect timeout): the network is
    missing, not the hub slow. The same failures make huggingface_hub fall back to its cache."""
    import httpx2

    return isinstance(err, (httpx2.ConnectError, httpx2.ConnectTimeout))


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_snapshot(repo: str, revision: str) -> str | None:
    """The cached snapshot directory of ``repo`` at ``revision`` (a branch, tag or commit), found as
    huggingface_hub finds it offline (``refs/`` then ``snapshots/``, under ``HF_HUB_CACHE``, which
    follows ``HF_HOME``); None if there is none or its checkpoint files are known to be incomplete."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo, revision=revision, local_files_only=True, allow_patterns=CACHED_FILES)
    except LocalEntryNotFoundError:  # IncompleteSnapshotError too: a download that stopped half way
        return None


CACHED_FILES = [CONFIG_FILE, *(f"*{suffix}" for suffix in CHECKPOINT_SUFFIXES)]  # what a cached copy must hold


class CachedHubSource:
    """``hf://org/repo[@revision]`` read from the local Hugging Face cache (offline, or no network).

    The files are the snapshot's links into the cache's blobs, read as a local directory. The
    provenance is the hub's (repo, revision, commit, per-file blob ids, which the cache names its
    blobs by), so a conversion from the cache and one from the hub at the same commit agree.
    """

    def __init__(self, uri: str, repo: str, revision: str, snapshot: str) -> None:
        from ckptconv.read.sources import LocalSource

        self.uri, self.repo, self.revision, self.snapshot = uri.rstrip("/"), repo, revision, snapshot
        self.commit = os.path.basename(snapshot.rstrip("/"))
        self._local = LocalSource(snapshot)

    @classmethod
    def find(cls, uri: str, repo: str, revision: str, why: str, missing: type[CkptConvError]) -> CachedHubSource:
        """The cached copy, announced in one line; ``missing`` (exit 2 offline, 1 without network) if none."""
        snapshot = cached_snapshot(repo, revision)
        if snapshot is None:
            raise missing(f"{uri}: {why}, and the Hugging Face cache ({_hub_cache()}) has no complete copy of {repo} "
                          f"at {revision!r}; download it once with network access (`hf download {repo}"
                          f"{'' if revision == 'main' else ' --revision ' + revision}`)")
        source = cls(uri, repo, revision, snapshot)
        log.warning("%s: %s; using the cached snapshot of commit %s in %s", uri, why, source.commit, snapshot)
        return source

    def exists(self, name: str) -> bool:
        return self._local.exists(name)

    def size(self, name: str) -> int:
        return self._local.size(name)

    def read_range(self, name: str, offset: int, length: int) -> memoryview:
        return self._local.read_range(name, offset, length)

    def list_names(self) -> list[str]:
        return self._local.list_names()

    def provenance(self) -> dict:
        files = {name: os.path.basename(os.path.realpath(os.path.join(self.snapshot, name)))
                 for name in checkpoint_files(self.list_names())}
        return {"uri": self.uri, "kind": "hf", "repo": self.repo, "revision": self.revision, "commit": self.commit,
                "files": files}

    def close(self) -> None:
        self._local.close()


def parse_hub_uri(uri: str) -> tuple[str, str]:
    """``hf://org/repo[@revision]`` -> ``("org/repo", revision or "main")``."""
    repo, _, revision = uri[len("hf://"):].partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        raise BadInputError(f"{uri}: expected hf://ORG/REPO or hf://ORG/REPO@REVISION")
    return repo, revision or "main"


def hub_token(hf_token_file: str | None) -> str | None:
    """The token of ``--hf-token-file`` if given, else huggingface_hub's own (None if there is none)."""
    return read_token_file(hf_token_file) if hf_token_file else _ambient_token()


def _ambient_token() -> str | None:
    """huggingface_hub's own token (HF_TOKEN, else a saved login), checked like a token file's."""
    from huggingface_hub import get_token

    token = get_token()
    if token:
        check_token(token, "the hub token from HF_TOKEN or the saved login")
    return token


def read_token_file(path: str) -> str:
    """The hub token stored in ``path`` (surrounding whitespace removed); errors never show it."""
    try:
        check_regular(path, os.stat(path).st_mode)  # a FIFO here would block the open forever
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as err:
        raise BadInputError(f"{path}: cannot read the hub token file ({err.strerror})") from None
    except UnicodeDecodeError:
        raise BadInputError(f"{path}: the hub token file is not text") from None
    if not token:
        raise BadInputError(f"{path}: the hub token file is empty")
    check_token(token, f"{path}: the hub token file")
    return token


def check_token(token: str, what: str) -> None:
    """One line of printable ASCII, or refused before any request: an HTTP library that meets a
    newline or a NUL in a header prints the header, token included, in its error."""
    bad = next((i for i, c in enumerate(token) if not " " < c <= "~"), None)
    if bad is not None:
        kind = "a line break" if token[bad] in "\r\n" else "a space" if token[bad] == " " else "a non-printable or non-ASCII character"
        raise BadInputError(f"{what} holds {kind} at character {bad + 1}; a token is one line of printable ASCII "
                            "(its value is not shown)")
