"""The Prefect UI shows what we publish: a real ``prefect server start`` and a real headless Chromium.

A flow run publishes a model page (with its RSS plot as an inline SVG image) and a zoo page; the
browser opens the run page (which names the artifact), the model page (the plot is an image of
non-zero size, decoded by the browser) and the zoo page (its model links to the model page), and a
screenshot of the model page is kept and checked not to be blank.

Needs Debian's ``chromium`` (``apt-get install -y chromium``); skipped, saying so, without it.
Chromium is driven over its DevTools protocol (websockets, already a Prefect dependency).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from tests.prefect_fixtures import stop_server

HTTP = httpx.Client()  # one client for the polls: each httpx.get would load the CA certificates again

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1600", "--remote-debugging-port=0")
# CI installs chromium (.ci/run) and sets CKPTCONV_REQUIRE_BROWSER=1: there a missing browser fails, never skips.
REQUIRED = os.environ.get("CKPTCONV_REQUIRE_BROWSER") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None and not REQUIRED,
    reason="Debian's chromium is not installed (apt-get install -y chromium): no browser to look with")]

PUBLISH = textwrap.dedent("""
    import json, sys
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.runtime import flow_run
    from flows.artifacts import publish_model_artifacts, publish_zoo_summary, zoo_row
    from tasks.job import Conversion
    from tests.test_artifacts import REPORT, VERIFIED

    @flow(name="artifact-page-probe")
    def probe():
        job = Conversion("/src/qwen3", "/dst/qwen3", devices=4, name="ui-probe")
        page = publish_model_artifacts(job, {"predicted_peak_rss_bytes": 428 * 2**20}, REPORT, VERIFIED, "13 leaves")
        key = publish_zoo_summary("ui-zoo", [zoo_row(job, REPORT, None, 1, 428 * 2**20, page),
                                             zoo_row(Conversion("/s", "/d/bad", name="bad"), None, "BadInputError: no", 1)])
        with get_client(sync_client=True) as client:
            zoo = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        return {"artifact": page, "zoo": str(zoo[0].id), "flow_run": str(flow_run.id)}

    print(json.dumps(probe()))
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(check, timeout: float, what: str):
    """Poll ``check`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        return HTTP.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def prefect_ui(tmp_path_factory):
    """A real ``prefect server start`` whose UI talks to its own API on a free port; stopped by PID."""
    tmp_path = tmp_path_factory.mktemp("prefect-ui")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_API_URL": f"{base}/api",
           "PREFECT_UI_API_URL": f"{base}/api", "PREFECT_UI_URL": base,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: server.poll() is not None or _healthy(f"{base}/api/health"), 120, "the Prefect server")
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        yield base, env
    finally:
        stop_server(server)


class Chromium:
    """Headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(self, profile: Path) -> None:
        assert CHROMIUM, "CKPTCONV_REQUIRE_BROWSER=1 but chromium is not installed (apt-get install -y chromium)"
        self.log = open(profile.parent / "chromium.log", "wb")
        self.proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        active = profile / "DevToolsActivePort"
        _wait(lambda: active.exists() and active.read_text().strip(), 60, "Chromium's DevTools port")
        port = active.read_text().split()[0]
        pages = _wait(lambda: [t for t in HTTP.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
                               if t["type"] == "page"], 30, "a Chromium page")
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        request = next(self.ids)
        self.ws.send(json.dumps({"id": request, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == request:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str, ready: str, what: str, timeout: float = 90):
        """Go to ``url`` and wait until the JS expression ``ready`` is truthy (the Vue app renders late)."""
        self.call("Page.navigate", url=url)
        return _wait(lambda: self.evaluate(ready), timeout, f"{what} at {url}")

    def close(self) -> None:
        self.ws.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


ARTIFACTS_TAB = """(() => {
  const tab = [...document.querySelectorAll('.p-tab, [role=tab]')].find(e => e.innerText.trim() === 'Artifacts');
  if (tab) tab.click();
  return document.body.innerText.includes('conversion-ui-probe');
})()"""
PLOT = """(() => {
  const img = document.querySelector('img[src^="data:image/svg+xml"]');
  if (!img || !img.complete || !img.naturalWidth) return null;
  const r = img.getBoundingClientRect();
  img.scrollIntoView();
  const s = img.getBoundingClientRect();
  return {width: r.width, height: r.height, natural: img.naturalWidth, x: s.x, y: s.y, alt: img.alt};
})()"""


def _png_pixels_vary(png: bytes) -> int:
    """How many distinct byte values the PNG's pixel data holds (a blank capture: a handful)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    data, offset = b"", 8
    while offset < len(png):
        length, kind = struct.unpack(">I4s", png[offset:offset + 8])
        if kind == b"IDAT":
            data += png[offset + 8:offset + 8 + length]
        offset += 12 + length
    return len(set(zlib.decompress(data)))


def test_the_prefect_ui_shows_the_rss_plot_and_the_zoo_links_to_it(prefect_ui, tmp_path):
    base, env = prefect_ui
    done = subprocess.run([sys.executable, "-c", PUBLISH], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    published = json.loads(done.stdout.strip().splitlines()[-1])

    browser = Chromium(tmp_path / "profile")
    try:
        # the run page lists the model's page under its Artifacts tab
        browser.open(f"{base}/runs/flow-run/{published['flow_run']}", ARTIFACTS_TAB, "the run page's artifact")
        # the model page: headline, stage table, and the plot decoded and laid out by the browser
        plot = browser.open(f"{base}/artifacts/artifact/{published['artifact']}", PLOT, "the RSS plot")
        assert plot["natural"] == 720 and plot["width"] > 300 and plot["height"] > 100, plot
        text = browser.evaluate("document.body.innerText")
        assert "1.2 GiB in 1 min 15 s, peak RSS 340 MiB" in text and "wall time" in text
        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png", clip={
            "x": plot["x"], "y": plot["y"], "width": plot["width"], "height": plot["height"], "scale": 1})["data"])
        (tmp_path / "rss-plot-in-prefect-ui.png").write_bytes(shot)
        assert len(shot) > 5000 and _png_pixels_vary(shot) > 50, "the plot's screenshot is blank"
        # the zoo page: eight columns, the model's name links to its page
        links = browser.open(f"{base}/artifacts/artifact/{published['zoo']}",
                             "[...document.querySelectorAll('a')].map(a => a.getAttribute('href'))"
                             ".filter(h => h && h.includes('/artifacts/artifact/'))", "the zoo page's model link")
        assert links == [f"{base}/artifacts/artifact/{published['artifact']}"]
        headers = browser.evaluate("[...document.querySelectorAll('th')].map(th => th.innerText.trim())")
        assert headers[:3] == ["model", "status", "error or headline"] and len(headers) <= 8
    finally:
        browser.close()
