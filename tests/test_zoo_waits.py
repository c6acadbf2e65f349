"""The zoo's deployment ships its schedule switched off."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_every_shipped_schedule_is_inactive():
    """``prefect deploy --all`` must not start converting into the example buckets every night."""
    config = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
    schedules = [(d["name"], s) for d in config["deployments"] for s in d.get("schedules") or []]
    assert schedules, "prefect.yaml ships no schedule at all"
    assert [name for name, s in schedules if s.get("active") is not False] == []
