"""Make docs/img/zoo-page.png and docs/img/model-page.png: the Prefect UI showing a real zoo run's artifacts.

    .venv/bin/python docs/img/screenshots.py        # needs Debian's chromium (apt-get install -y chromium)

Starts ``prefect server start`` on a free port (state in a temporary folder), runs the ``convert-zoo`` flow in a
child process against it on a manifest of two small synthesised Qwen3 models and one broken source (so the zoo
page shows a failure first), then opens the zoo page and the first model's page in headless Chromium (the
browser test's driver, tests/test_artifacts_browser.py) and saves each as a PNG of the page's content, scaled
down to stay small. Not a test: the pictures are for the README.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.prefect_fixtures import stop_server  # noqa: E402
from tests.test_artifacts_browser import Chromium, _free_port, _healthy, _wait  # noqa: E402

RUN_ZOO = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from ckptconv.commands import synth
    from flows.zoo import convert_zoo
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    work = Path(sys.argv[1])
    models = []
    for name, layers in (("qwen3-small", 4), ("qwen3-deeper", 8)):
        synth.write_checkpoint(synth.SynthModel(vocab_size=32000, hidden_size=512, num_layers=layers, num_heads=8,
                                                num_kv_heads=4, head_dim=64, intermediate_size=1536),
                               str(work / "hf" / name))
        models.append({"name": name, "source": str(work / "hf" / name), "destination": str(work / "out" / name)})
    (work / "hf" / "broken").mkdir()
    (work / "hf" / "broken" / "config.json").write_text('{"model_type": "qwen3"}')
    models.append({"name": "broken-upload", "source": str(work / "hf" / "broken"),
                   "destination": str(work / "out" / "broken")})
    manifest = work / "zoo.yaml"
    manifest.write_text(json.dumps({"name": "docs", "defaults": {"devices": 16}, "models": models}))
    convert_zoo(manifest=str(manifest), return_state=True)
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["zoo-docs", "conversion-qwen3-small"])))
    print(json.dumps({artifact.key: str(artifact.id) for artifact in found}))
""")

# The artifact's own content: from its title to the bottom of its first table (the zoo page) or to the top of the
# heading `stop` (the model page), and from the title's left edge to the right edge of the artifact's column.
FIT = """(() => {
  if (!document.body.innerText.includes(%s)) return null;
  const headings = [...document.querySelectorAll('h1, h2, h3')];
  const title = headings.find(h => h.innerText.trim().startsWith(%s));
  const table = document.querySelector('table');
  if (!title || !table) return null;
  const stop = %s ? headings.find(h => h.innerText.trim() === %s) : null;
  const crumb = document.querySelector('.page-heading, header') || title;
  const column = title.parentElement.getBoundingClientRect();
  const top = crumb.getBoundingClientRect().y + window.scrollY - 8;
  const edge = stop ? stop.getBoundingClientRect().top - 4 : table.getBoundingClientRect().bottom + 12;
  const bottom = edge + window.scrollY;
  return {x: column.x - 8, y: top, width: column.width + 16, height: bottom - top};
})()"""


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        work = Path(tmp)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PREFECT_HOME": str(work / "home"), "PREFECT_API_URL": f"{base}/api",
               "PREFECT_UI_API_URL": f"{base}/api", "PREFECT_UI_URL": base,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
        with open(work / "server.log", "wb") as log:
            server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                       "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(lambda: server.poll() is not None or _healthy(f"{base}/api/health"), 120, "the Prefect server")
            done = subprocess.run([sys.executable, "-c", RUN_ZOO, str(work)], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=900)
            ids = json.loads(done.stdout.strip().splitlines()[-1])
            browser = Chromium(work / "profile")
            try:
                for key, name, marker, title, stop, width, scale in (
                        ("zoo-docs", "zoo-page.png", "broken-upload", "Zoo", "", 2000, 0.6),
                        ("conversion-qwen3-small", "model-page.png", "peak RSS", "Conversion", "Details", 1400, 0.7)):
                    browser.call("Emulation.setDeviceMetricsOverride", width=width, height=1500, deviceScaleFactor=1,
                                 mobile=False)
                    fit = FIT % (json.dumps(marker), json.dumps(title), json.dumps(stop), json.dumps(stop))
                    box = browser.open(f"{base}/artifacts/artifact/{ids[key]}", fit, key)
                    browser.evaluate("new Promise(r => setTimeout(r, 1500))")
                    box = browser.evaluate(fit)
                    shot = browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip={
                        **box, "scale": scale})
                    (ROOT / "docs" / "img" / name).write_bytes(base64.b64decode(shot["data"]))
                    print(f"docs/img/{name}: {len(base64.b64decode(shot['data'])) // 1024} KiB")
            finally:
                browser.close()
        finally:
            stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
