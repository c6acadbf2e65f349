"""``make demo``: run the ``convert-model`` flow on a synthesised small Qwen3, with no setup.

Prefect starts a temporary local server for the run (state in ./.prefect); the flow converts
./demo-out/hf (synthesised here) into ./demo-out/maxtext. Afterwards this prints the
checkpoint's layout (``ckptconv inspect``), the conversion report and the artifacts as the
server stored them, and how to look at them again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path("demo-out")
SETTINGS = {  # before Prefect is imported: it reads its settings once
    "PREFECT_HOME": str(ROOT / ".prefect"),
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "60",
}
GIB = 1024**3


def demo_model():
    """A small Qwen3 (about 60 MB) that converts in a few seconds but still shows progress."""
    from ckptconv import synth

    return synth.SynthModel(vocab_size=32000, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                            head_dim=64, intermediate_size=1536)


def main() -> int:
    os.environ.update(SETTINGS)
    os.environ.pop("PREFECT_API_URL", None)  # always the temporary local server, never a configured one
    from ckptconv import synth

    from flows.model import convert_model

    source, destination = (OUT / "hf").resolve(), (OUT / "maxtext").resolve()
    print(f"synthesising a small Qwen3 checkpoint in {source} ...", flush=True)
    synth.write_checkpoint(demo_model(), str(source))
    row = convert_model(source=str(source), destination=str(destination), devices=16, scan_layers=True,
                        dtype="bfloat16", overwrite=True, name="demo-qwen3")
    print("\n== ckptconv inspect", destination, flush=True)
    subprocess.run([sys.executable, "-m", "ckptconv", "inspect", str(destination)], check=False)
    print("\n== report", destination / "ckptconv-report.json")
    print(_report_summary(json.loads((destination / "ckptconv-report.json").read_text())))
    print("\n== artifacts (read back from the Prefect server)")
    for artifact in _artifacts(row["model"]):
        print(f"  {artifact.key:<34} {artifact.type:<9} {_brief(artifact)}")
    print(f"\nPrefect state is in {SETTINGS['PREFECT_HOME']}. To browse the run and its artifacts:\n"
          f"  PREFECT_HOME={SETTINGS['PREFECT_HOME']} {sys.executable} -m prefect server start   # then open http://127.0.0.1:4200/artifacts\n"
          f"  PREFECT_HOME={SETTINGS['PREFECT_HOME']} {sys.executable} -m prefect artifact inspect conversion-{row['model']}")
    return 0


def _report_summary(report: dict) -> str:
    from flows.artifacts import STAGES

    stages = ", ".join(f"{name} {report['stage_seconds'][name]:.2f}s" for name in STAGES if name in report["stage_seconds"])
    return (f"  {report['family']}: {report['tensors']} tensors -> {report['leaves']} leaves, "
            f"{report['output_bytes'] / GIB:.3f} GiB on {report['devices']} devices (scan_layers={report['scan_layers']})\n"
            f"  wall {report['wall_seconds']:.2f}s ({stages})\n"
            f"  peak RSS {report['peak_rss_bytes'] / GIB:.2f} GiB (the conversion's own high-water mark)")


def _artifacts(slug: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=f"conversion-{slug}")))
    latest = {}
    for artifact in sorted(found, key=lambda a: a.created):
        latest[artifact.key] = artifact
    return [latest[key] for key in sorted(latest)]


def _brief(artifact) -> str:
    data = artifact.data
    if artifact.type == "table":
        rows = json.loads(data) if isinstance(data, str) else data
        total = next((r for r in rows if str(r.get("stage", "")).startswith("total")), None)
        if total is None:  # the zoo row (``-row``): one row of figures, not stages
            return f"{len(rows)} row(s): status {rows[0].get('status') if rows else '-'}"
        return f"{len(rows)} rows; total {total.get('seconds')} s, peak RSS {total.get('peak_rss_bytes')} bytes"
    if artifact.type == "markdown" and artifact.key.endswith("-output"):
        return str(data)
    if artifact.type == "markdown":
        return next((line for line in str(data).splitlines() if line.startswith("| sharding")), "").strip("| ")
    return str(data)


if __name__ == "__main__":
    sys.exit(main())
