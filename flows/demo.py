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
    from ckptconv.commands import synth

    return synth.SynthModel(vocab_size=32000, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                            head_dim=64, intermediate_size=1536)


def main() -> int:
    os.environ.update(SETTINGS)
    os.environ.pop("PREFECT_API_URL", None)  # always the temporary local server, never a configured one
    from ckptconv import settings
    from ckptconv.commands import synth
    from ckptconv.rssplot import PLOT_NAME

    from flows.model import convert_model

    source, destination = (OUT / "hf").resolve(), (OUT / "maxtext").resolve()
    print(f"synthesising a small Qwen3 checkpoint in {source} ...", flush=True)
    synth.write_checkpoint(demo_model(), str(source))
    state = convert_model(source=str(source), destination=str(destination), devices=settings.DEVICES,
                          scan_layers=settings.SCAN_LAYERS, dtype=settings.DTYPE, overwrite=True, name="demo-qwen3",
                          return_state=True)
    row = state.result()
    print("\n== ckptconv inspect", destination, flush=True)
    subprocess.run([sys.executable, "-m", "ckptconv", "inspect", str(destination)], check=False)
    print("\n== report", destination / "ckptconv-report.json")
    print(_report_summary(json.loads((destination / "ckptconv-report.json").read_text())))
    print("\n== artifacts of this flow run (read back from the Prefect server)")
    status = print_artifacts(row["model"], _artifacts(row["model"], state.state_details.flow_run_id),
                             destination / PLOT_NAME)
    print(f"\nPrefect state is in {SETTINGS['PREFECT_HOME']}. To browse the run and its artifacts:\n"
          f"  PREFECT_HOME={SETTINGS['PREFECT_HOME']} {sys.executable} -m prefect server start   # then open http://127.0.0.1:4200/artifacts\n"
          f"  PREFECT_HOME={SETTINGS['PREFECT_HOME']} {sys.executable} -m prefect artifact inspect conversion-{row['model']}")
    return status


def print_artifacts(slug: str, artifacts: dict, plot: Path) -> int:
    """Print one line per artifact the flow promises (and the plot beside the report); 1 if any is missing.

    CI runs ``make demo`` after the tests: a renamed or lost artifact must fail it, not print nothing.
    """
    missing = []
    for suffix, brief in BRIEFS.items():
        key = f"conversion-{slug}{suffix}"
        artifact = artifacts.get(key)
        if artifact is None:
            missing.append(key)
            print(f"  {key:<34} MISSING")
            continue
        text = brief(artifact.data)
        if text is None:
            missing.append(f"{key} (unreadable)")
        print(f"  {key:<34} {artifact.type:<9} {text or 'UNREADABLE'}")
    if not plot.is_file() or plot.stat().st_size == 0:
        missing.append(str(plot))
    print(f"  {'RSS plot beside the report':<34} {'file':<9} {plot if str(plot) not in missing else 'MISSING'}")
    if missing:
        print(f"demo: missing: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


def _report_summary(report: dict) -> str:
    from ckptconv.settings import STAGES
    from ckptconv.units import human_bytes, human_seconds

    stages = ", ".join(f"{name} {human_seconds(report['stage_seconds'][name])}" for name in STAGES
                       if name in report["stage_seconds"])
    return (f"  {report['family']}: {report['tensors']} tensors -> {report['leaves']} leaves, "
            f"{human_bytes(report['output_bytes'])} on {report['devices']} devices (scan_layers={report['scan_layers']})\n"
            f"  wall {human_seconds(report['wall_seconds'])} (busy per stage, overlapping: {stages})\n"
            f"  peak RSS {human_bytes(report['peak_rss_bytes'])} (the conversion's own high-water mark)")


def _artifacts(slug: str, flow_run_id) -> dict:
    """This flow run's artifacts whose key starts with ``conversion-<slug>``, by key."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(like_=f"conversion-{slug}"), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {artifact.key: artifact for artifact in sorted(found, key=lambda a: a.created)}  # the latest per key


def _page_brief(data) -> str | None:
    """The page's headline (its bold line) and whether the RSS plot is embedded."""
    text = str(data or "")
    line = next((line for line in text.splitlines() if line.startswith("**")), None)
    if line is None:
        return None
    plot = "with the RSS plot" if "](data:image/svg+xml;base64," in text else "NO PLOT"
    return f"{line.split('**')[1]}; {plot}"


def _row_brief(data) -> str | None:
    rows = json.loads(data) if isinstance(data, str) else data
    if not rows:
        return None
    row = rows[0]
    from ckptconv.units import human_bytes, human_seconds

    peak = row.get("peak_rss_mib")
    return (f"status {row.get('status')}, wall {human_seconds(row.get('wall_seconds'))}, "
            f"peak RSS {human_bytes(None if peak is None else peak * 2**20)}")


def _progress_brief(data) -> str | None:
    return None if data is None else f"{float(data):.0f}%"


BRIEFS = {"": _page_brief, "-row": _row_brief, "-progress": _progress_brief}  # every artifact the flow promises


if __name__ == "__main__":
    sys.exit(main())
