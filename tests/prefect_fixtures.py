"""Prefect for the tests: a private PREFECT_HOME, no telemetry, and one session-wide test server.

Registered from ``conftest.py``'s ``pytest_plugins``. Prefect reads its settings when it is
first imported, so the environment is set in ``pytest_configure``, before test modules load.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import uuid

import pytest

_HOME: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    home = tempfile.mkdtemp(prefix="ckptconv-prefect-home-")
    _HOME.append(home)
    os.environ.update({
        "PREFECT_HOME": home,
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3",
    })
    os.environ.pop("PREFECT_API_URL", None)  # never a server configured outside the tests


def pytest_unconfigure(config: pytest.Config) -> None:
    for home in _HOME:
        shutil.rmtree(home, ignore_errors=True)


class _Harness:
    """The session's temporary Prefect server (``prefect_test_harness``: SQLite, a server subprocess), started on
    first use and stopped once the modules that use it are done: left up, it would keep its services and its
    worker's event loop running for the rest of the session (measured idle: 1.1 s of a core a minute)."""

    def __init__(self) -> None:
        self._running: contextlib.ExitStack | None = None
        self.modules: set = set()  # the test modules with a test that asks for ``prefect_server``

    def start(self) -> None:
        if self._running is None:
            from prefect.testing.utilities import prefect_test_harness

            running = contextlib.ExitStack()
            running.enter_context(prefect_test_harness(server_startup_timeout=90))
            self._running = running

    def stop(self) -> None:
        if self._running is not None:
            running, self._running = self._running, None
            running.close()


_SERVER = _Harness()


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server (SQLite) for every flow and task test in the session; stopped after the last
    test of the modules that use it (``pytest_runtest_teardown``), started again should one of theirs come later."""
    _SERVER.start()
    yield
    _SERVER.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _SERVER.modules.update(item.path for item in items if "prefect_server" in item.fixturenames)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if "prefect_server" in item.fixturenames:  # the session fixture is set up once: this restarts a stopped server
        _SERVER.start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the test's fixtures are torn down: the server stops when the next test is not in a module that uses it
    (`make test` runs those modules one after another on one worker: conftest's PREFECT_SERVER_MODULES)."""
    try:
        return (yield)
    finally:
        if nextitem is None or nextitem.path not in _SERVER.modules:
            _SERVER.stop()


@pytest.fixture
def memory_limit(monkeypatch):
    """Factory: point conversions at a fresh memory limit of ``gb`` GB; returns its name."""

    def make(gb: int = 8) -> str:
        name = f"ckptconv-memory-gb-test-{uuid.uuid4().hex[:8]}"
        # the environment, as a deployment sets it, for the test's synchronous flow calls; undone when it ends
        monkeypatch.setenv("CKPTCONV_MEMORY_LIMIT", name)
        monkeypatch.setenv("CKPTCONV_MEMORY_GB", str(gb))
        return name

    return make


def latest_artifact(key: str):
    """The newest artifact stored under ``key``, read back through the Prefect client."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                      sort=ArtifactSort.CREATED_DESC, limit=1)
    assert found, f"no artifact with key {key!r}"
    return found[0]


def task_runs(flow_run_id) -> dict[str, object]:
    """Task runs of one flow run by name (nested ones included)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run for run in runs}


def stop_server(server: subprocess.Popen, grace_seconds: float = 20) -> None:
    """Stop a ``prefect server start`` child: SIGTERM, then SIGKILL after ``grace_seconds``."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
