"""The destination protocol on a Hugging Face Hub repo (``hf://org/repo[@branch]``), for ``export``.

A branch of a Hub repo changes only by commits, and a commit is atomic: it is Orbax's final small
step already. The protocol's steps (:mod:`ckptconv.write.destination`) map onto it so:

1. **look** (:meth:`HubDestination.look`): the branch head and what it holds; our record
   (:data:`RECORD_NAME`, committed with the files it names) says which export is there and each
   file's size and sha256. A head whose record has this export's fingerprint and whose files all
   match the record holds this exact export: nothing to do. Files not exported by ckptconv (beyond
   a new repo's ``.gitattributes`` and a model card) are refused without ``--overwrite``.
2. **hold**: the files are staged in a local directory under its lock (the ordinary export, which
   resumes its own work); on the Hub the commit names the head it looked at as its parent, so a
   branch that moved meanwhile refuses it rather than mixing two writers.
3. **stage**: each staged file is hashed (sha256, one read) and its bytes uploaded by
   huggingface_hub (LFS: single PUT or multipart chunks; Xet where ``hf_xet`` is installed and not
   disabled), streamed from disk, file by file: memory never holds a file. Blobs a failed run
   already uploaded are known to the Hub by their sha256 and not sent again.
4. **prove and commit**: the Hub checks each blob's sha256 as it takes it; the one commit adds
   every file and the record (and, replacing an old export, deletes its files the new one does
   not have). Until that commit the branch shows what it showed before; after it, everything.

The token (``--hf-token-file``, else ``HF_TOKEN`` or a saved login) goes only into request
headers; messages carry no header and no URL with a signature.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptconv import __version__
from ckptconv.errors import BadInputError, DestinationExistsError, RemoteError, stop_if_terminated
from ckptconv.read.hub import hub_token, parse_hub_uri
from ckptconv.read.ranged import one_line

log = logging.getLogger("ckptconv")

RECORD_NAME = "ckptconv-export.json"  # committed with the export: its fingerprint and every file's sha256
NEVER_IN_THE_WAY = (".gitattributes", "README.md")  # what a new repo holds, and a model card: kept, never refused
COMMIT_OID = re.compile(r"[0-9a-f]{7,40}")
HASH_BLOCK = 8 << 20  # bytes read at a time while hashing a staged file
UPLOAD_BATCH = 5  # files uploaded together (huggingface_hub's threads); SIGTERM is heard between batches


@dataclass(frozen=True)
class StagedFile:
    """One file of the export as staged locally, with the digests the Hub will report for it."""

    name: str
    path: str
    size: int
    sha256: str
    git_sha1: str  # what the Hub reports as blobId for a regular (non-LFS) file

    def to_json(self) -> dict:
        return {"size": self.size, "sha256": self.sha256, "git_sha1": self.git_sha1}


def stage_file(name: str, path: str) -> StagedFile:
    """Hash ``path`` in one pass (blocks of :data:`HASH_BLOCK`): its sha256 and its git blob id."""
    size = os.path.getsize(path)
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            sha256.update(block)
            sha1.update(block)
    return StagedFile(name, path, size, sha256.hexdigest(), sha1.hexdigest())


@dataclass
class HubDestination:
    """``hf://org/repo[@branch]`` as an export's destination; :meth:`look` before anything else."""

    uri: str
    hf_token_file: str | None = None
    repo: str = field(init=False)
    branch: str = field(init=False)
    head: str | None = field(init=False, default=None)
    files: dict[str, object] = field(init=False, default_factory=dict)  # name -> huggingface_hub RepoSibling
    record: dict | None = field(init=False, default=None)
    created: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        from huggingface_hub import HfApi, constants

        self.uri = self.uri.rstrip("/")
        self.repo, self.branch = parse_hub_uri(self.uri)
        token = hub_token(self.hf_token_file)
        if not token:
            raise BadInputError(f"{self.uri}: uploading needs a Hugging Face token with write access (HF_TOKEN, "
                                "`hf auth login` or --hf-token-file); none found, nothing uploaded")
        self._api = HfApi(endpoint=constants.ENDPOINT, token=token)

    # --- look ------------------------------------------------------------------------------

    def look(self) -> None:
        """Find the branch head (creating the repo, private, if it does not exist), check the token
        may write there, and read what the head holds and our record, if any."""
        from huggingface_hub.errors import RepositoryNotFoundError

        with self._translated("looking at the repo"):
            try:
                refs = self._api.list_repo_refs(self.repo)
            except RepositoryNotFoundError:
                self._create()
                refs = self._api.list_repo_refs(self.repo)
            branches = {ref.name: ref.target_commit for ref in refs.branches}
            if self.branch not in branches:
                tags = {ref.name for ref in refs.tags}
                what = ("a tag" if self.branch in tags else "a commit" if COMMIT_OID.fullmatch(self.branch)
                        else "no branch of the repo")
                raise BadInputError(f"{self.uri}: {self.branch!r} is {what}; an export commits to an existing "
                                    f"branch (branches: {', '.join(sorted(branches)) or 'none'}); nothing uploaded")
            self.head = branches[self.branch]
            self._check_writable()
            info = self._api.model_info(self.repo, revision=self.head, files_metadata=True)
            self.files = {sibling.rfilename: sibling for sibling in info.siblings or []}
            self.record = self._read_record() if RECORD_NAME in self.files else None

    def _create(self) -> None:
        """A repo that does not exist is created private (making it public is the owner's decision)."""
        from huggingface_hub.errors import HfHubHTTPError

        try:
            self._api.create_repo(self.repo, private=True)
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            if status in (401, 403, 409):  # 409: it exists, but this token cannot see it
                raise BadInputError(f"{self.uri}: repository not found, and this token cannot create it (HTTP "
                                    f"{status}); check the name and the token's access; nothing uploaded") from None
            raise
        self.created = True
        log.warning("ckptconv: %s: created the repository (private)", self.uri)

    def _check_writable(self) -> None:
        from huggingface_hub.errors import HfHubHTTPError

        try:
            self._api.auth_check(self.repo, write=True)
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            if status in (401, 403):
                raise BadInputError(f"{self.uri}: the token may not write to this repository (HTTP {status}); "
                                    "use a token with write access to it; nothing uploaded") from None
            raise

    def _read_record(self) -> dict | None:
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = f"{self._api.endpoint}/{self.repo}/resolve/{self.head}/{RECORD_NAME}"
        response = get_session().get(url, headers=build_hf_headers(token=self._api.token), follow_redirects=True)
        hf_raise_for_status(response)
        try:
            record = json.loads(response.content)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    # --- judge -----------------------------------------------------------------------------

    def holds(self, fingerprint: str) -> bool:
        """Whether the head is this exact export: our record with this fingerprint, and every file it
        names on the branch with the size and digest it recorded."""
        record = self.record
        if not record or record.get("fingerprint") != fingerprint or not isinstance(record.get("files"), dict):
            return False
        return all(self._matches(name, facts) for name, facts in record["files"].items())

    def _matches(self, name: str, facts: dict) -> bool:
        sibling = self.files.get(name)
        if sibling is None or sibling.size != facts.get("size"):
            return False
        lfs = getattr(sibling, "lfs", None)
        return lfs.sha256 == facts.get("sha256") if lfs else sibling.blob_id == facts.get("git_sha1")

    def check_replaceable(self, fingerprint: str, overwrite: bool) -> None:
        """Refuse (one line, nothing uploaded) to commit over what is not ours, or over another
        export of ours, unless ``--overwrite``."""
        if overwrite:
            return
        if self.record is not None and self.record.get("kind") == "export":
            if self.record.get("fingerprint") != fingerprint:
                raise DestinationExistsError(f"{self.uri}: holds an export of another checkpoint or with other "
                                             "options; pass --overwrite to replace it")
            return
        others = sorted(name for name in self.files if name not in NEVER_IN_THE_WAY)
        if others:
            raise DestinationExistsError(f"{self.uri}: holds files not exported by ckptconv ({others[0]}"
                                         f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}); pass "
                                         "--overwrite to replace its weights, config and tokenizer files")

    # --- stage, prove, commit --------------------------------------------------------------

    def commit(self, staged: list[StagedFile], record: dict, exported: Callable[[str], bool],
               message: str) -> dict:
        """Upload every staged file and commit them with ``record`` in one commit on the branch
        head we looked at; the export's old files the new one lacks are deleted in it. Returns
        the commit's figures (commit id, seconds, bytes)."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        names = {file.name for file in staged} | {RECORD_NAME}
        operations: list = []
        for file in staged:
            add = CommitOperationAdd(path_in_repo=file.name, path_or_fileobj=file.path)
            add.upload_info.sha256 = bytes.fromhex(file.sha256)  # hashed once, by us
            operations.append(add)
        record_bytes = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
        operations.append(CommitOperationAdd(path_in_repo=RECORD_NAME, path_or_fileobj=record_bytes))
        stale = sorted(name for name in self.files if exported(name) and name not in names)
        operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
        started = time.monotonic()
        additions = operations[:len(staged)]
        with self._translated("uploading"):
            for first in range(0, len(additions), UPLOAD_BATCH):  # a stop request is heard between batches
                stop_if_terminated()
                self._api.preupload_lfs_files(self.repo, additions=additions[first:first + UPLOAD_BATCH],
                                              revision=self.branch, free_memory=False)
            stop_if_terminated()  # the last moment a stop leaves the branch as it was
            info = self._api.create_commit(self.repo, operations, commit_message=message,
                                           commit_description=f"fingerprint {record['fingerprint']}",
                                           revision=self.branch, parent_commit=self.head)
        seconds = time.monotonic() - started
        sent = sum(file.size for file in staged)
        return {"repo": self.repo, "branch": self.branch, "parent": self.head, "commit": info.oid,
                "created_repo": self.created, "deleted": stale, "files": len(staged) + 1, "bytes": sent,
                "upload_seconds": round(seconds, 3),
                "upload_mib_per_s": round(sent / 2**20 / seconds, 2) if seconds > 0 else None}

    def _translated(self, doing: str):
        return _HubFailures(self.uri, doing)


class _HubFailures:
    """Failures of huggingface_hub calls as one line each: refusals (401/403, a branch that moved)
    as bad input, the rest as a remote failure a rerun resumes (nothing is committed half)."""

    def __init__(self, uri: str, doing: str) -> None:
        self.uri, self.doing = uri, doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        from huggingface_hub.errors import HfHubHTTPError

        if err is None or not isinstance(err, Exception) or isinstance(err, (BadInputError, RemoteError)):
            return False
        cause = err
        while isinstance(cause, RuntimeError) and cause.__cause__ is not None:  # "Error while uploading X"
            cause = cause.__cause__
        status = cause.response.status_code if isinstance(cause, HfHubHTTPError) and cause.response is not None \
            else None
        if status in (401, 403):
            raise BadInputError(f"{self.uri}: {self.doing}: access denied (HTTP {status}); check the token's write "
                                "access; nothing was committed") from None
        if status == 412:
            raise RemoteError(f"{self.uri}: the branch moved while uploading (another commit landed); nothing was "
                              "committed; rerun to look again") from None
        if isinstance(cause, HfHubHTTPError) or _network_failure(cause):
            then = ("nothing was committed, a rerun resumes (blobs already uploaded are not sent again)"
                    if self.doing == "uploading" else "nothing was uploaded")
            raise RemoteError(f"{self.uri}: {self.doing}: {_unsigned(one_line(cause))}; {then}") from None
        return False


def _unsigned(text: str) -> str:
    """``text`` without URL query strings: an upload URL's query is its signature, a credential."""
    return re.sub(r"\?[^\s'\"]*", "?...", text)


def _network_failure(err: BaseException) -> bool:
    import httpx2

    return isinstance(err, (httpx2.HTTPError, OSError))


def export_record(fingerprint: str, staged: list[StagedFile], facts: dict) -> dict:
    """What the Hub keeps beside the export: no local path, no host, no time of this machine's."""
    return {"tool": f"ckptconv {__version__}", "kind": "export", "fingerprint": fingerprint, **facts,
            "files": {file.name: file.to_json() for file in staged}}
