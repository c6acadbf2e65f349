"""``python -m bench tpu-restore`` on CPU, as CI can run it: its tiny smoke shape with every option, so the bench a
TPU host runs (docs/tpu.md) still runs when the pins move. ``--diagnose`` puts an instrumented copy of Orbax 0.12.8's
per-shard read-and-put in place of Orbax's own; a change to that private function's signature fails here, not on
the chip. ``--batched``'s restore is checked leaf by leaf against the stored data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_tpu_restore_bench_runs_every_variant_and_its_leaves_check(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "bench.tpu_restore", "--shapes", "tiny", "--rounds", "1",
                           "--layouts", "16-by-device,1-device-uncompressed", "--batched", "--diagnose",
                           "--diagnose-reps", "1", "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    runs = {run["case"]: run for run in results["runs"]}
    for layout in ("16-by-device", "1-device-uncompressed"):
        assert runs[layout]["ok"] and runs[layout]["leaves_checked"] == runs[layout]["leaves"] == 14
        assert runs[f"{layout}, batched"]["ok"] and runs[f"{layout}, batched"]["leaves_checked"] == 14
    assert runs["floor: safetensors read + device_put"]["bytes"] > 0
    assert [d["case"] for d in results["diagnosis"]] == ["16-by-device", "1-device-uncompressed"]
    for diagnosis in results["diagnosis"]:
        variants = diagnosis["orbax"]
        assert set(variants) >= {"orbax as is", "read(): no np.zeros + copy", "device_put off the event loop",
                                 "restore_concurrent_gb=1"}
        timed = variants["orbax as is"][0]
        # every shard went through the instrumented copy (13 weights and the step, at least one shard each)
        assert timed["shards"] >= 14 and timed["seconds"] >= timed["reads_span_s"] >= 0
        assert variants["np.zeros -> 4096-aligned buffer"][0]["misaligned_4096"] == 0
        assert all(len(times) == 1 for way, times in diagnosis["device_put"].items() if way != "alignment_mod_4096")
    assert "Orbax's restore with one part changed" in (out / "table.md").read_text()
