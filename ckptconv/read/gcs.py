"""Sources on Google Cloud Storage (``gs://bucket/dir``).

The directory is listed once, when opened, and every later read is pinned to the object
generations that listing saw: a conversion reads one consistent snapshot even if someone
uploads mid-run, and its report says exactly which (``provenance()``). Reads are ranged
(:mod:`ckptconv.read.ranged`). Credentials: Application Default Credentials
(``google.auth.default``).
"""

from __future__ import annotations


from ckptconv.errors import BadInputError, RemoteError
from ckptconv.read.waits import Deadlines, announced
from ckptconv.read.ranged import Retries, RetryPolicy, Sink, SinkFile, checkpoint_files, one_line, ranged_read

GCS_ENDPOINT = "https://storage.googleapis.com"  # where clients go when no emulator is configured


class GcsSource:
    """``gs://bucket/dir``, read through google-cloud-storage with generation-pinned ranged GETs."""

    retry = RetryPolicy()

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        bucket, _, prefix = self.uri[len("gs://"):].partition("/")
        if not bucket:
            raise BadInputError(f"{uri}: expected gs://BUCKET/DIR")
        self._prefix = f"{prefix}/" if prefix else ""
        self.deadlines = Deadlines.from_env()
        self._client = gcs_client(uri)
        self.endpoint = str(getattr(self._client, "api_endpoint", None) or GCS_ENDPOINT)
        self._bucket = self._client.bucket(bucket)
        self._blobs = {blob.name[len(self._prefix):]: blob for blob in self._list(uri)}
        if not self._blobs:
            raise BadInputError(f"{uri}: no files there (empty or missing GCS directory)")

    @classmethod
    def open(cls, uri: str, *, hf_token_file: str | None = None) -> GcsSource:
        """Open ``uri`` with Application Default Credentials (``hf_token_file`` is for hf:// only)."""
        return cls(uri)

    def _list(self, uri: str) -> list:
        from google.api_core import exceptions as gexc
        from google.cloud.storage.retry import _should_retry

        retries = Retries(uri, self.endpoint, self.retry, self.deadlines)
        timeout = self.deadlines.request_seconds
        while True:
            try:
                with announced(f"the listing of {uri} from {self.endpoint}", self.deadlines):
                    blobs = self._client.list_blobs(self._bucket, prefix=self._prefix, delimiter="/", retry=None,
                                                    timeout=(timeout, timeout))
                    return [blob for blob in blobs if not blob.name.endswith("/")]
            except (gexc.Forbidden, gexc.Unauthorized) as err:
                raise BadInputError(f"{uri}: permission denied listing the directory ({one_line(err)}); "
                                    "check the Application Default Credentials") from None
            except gexc.NotFound:
                raise BadInputError(f"{uri}: bucket not found") from None
            except Exception as err:
                if not _should_retry(err):
                    raise RemoteError(f"{uri}: listing failed at {self.endpoint}: {one_line(err)}") from None
                retries.failed(err)

    def _blob(self, name: str):
        blob = self._blobs.get(name)
        if blob is None:
            raise BadInputError(f"{self.uri}/{name}: file not found")
        return blob

    def exists(self, name: str) -> bool:
        return name in self._blobs

    def size(self, name: str) -> int:
        return int(self._blob(name).size)

    def read_range(self, name: str, offset: int, length: int) -> bytearray | memoryview:
        from google.api_core import exceptions as gexc
        from google.cloud.storage.retry import _should_retry  # the library's own "transient" test

        where = f"{self.uri}/{name}"
        listed = self._blob(name)
        if offset + length > listed.size:
            raise BadInputError(f"{where}: file ends at byte {listed.size}, expected {length} bytes "
                                f"from offset {offset} (truncated?)")
        if length == 0:
            return bytearray()
        pinned = self._bucket.blob(listed.name, generation=listed.generation)

        def fetch(start: int, count: int, sink: Sink) -> None:
            try:
                pinned.download_to_file(SinkFile(sink), start=start, end=start + count - 1, raw_download=True,
                                        checksum=None, retry=None, timeout=(timeout, timeout))
            except gexc.NotFound:
                raise RemoteError(f"{where}: generation {listed.generation} is gone "
                                    "(the object changed during the conversion?)") from None
            except (gexc.Forbidden, gexc.Unauthorized) as err:
                raise BadInputError(f"{where}: permission denied ({one_line(err)}); "
                                    "check the Application Default Credentials") from None

        timeout = self.deadlines.request_seconds
        return ranged_read(where, offset, length, fetch, _should_retry, self.retry, self.deadlines, self.endpoint)

    def list_names(self) -> list[str]:
        return sorted(self._blobs)

    def provenance(self) -> dict:
        return {"uri": self.uri, "kind": "gcs",
                "generations": {name: int(self._blobs[name].generation) for name in checkpoint_files(self._blobs)}}


def gcs_client(uri: str):
    """A storage client on ADC; reads need no project, so none is required."""
    import google.auth.exceptions
    from google.cloud import storage

    try:
        return storage.Client(project=None)
    except google.auth.exceptions.DefaultCredentialsError as err:
        raise BadInputError(f"{uri}: no Google credentials ({one_line(err)}); run "
                            "`gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS") from None
