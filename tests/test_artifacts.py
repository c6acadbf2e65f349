"""What people read: human units, the RSS timeline and its plot, the model page, the zoo page, the demo's check.

No Prefect server here (the builders are pure); the browser test (tests/test_artifacts_browser.py) looks at
the same pages in the Prefect UI.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from types import SimpleNamespace

from ckptconv import rssplot
from ckptconv.commands import synth
from ckptconv.monitor import RssSampler, StageTimer, run_figures
from ckptconv.units import human_bytes, human_seconds
from flows.artifacts import ZOO_COLUMNS, summary_markdown, zoo_markdown, zoo_row
from flows.demo import BRIEFS, print_artifacts
from tasks.job import Conversion

MIB, GIB = 2**20, 2**30
TIMELINE = {"rss": [[0.0, 50 * MIB], [1.0, 180 * MIB], [2.0, 310 * MIB], [3.0, 300 * MIB]],
            "spans": {"plan": [[0.0, 0.1]], "read": [[1.2, 2.6]], "transform": [[1.3, 2.6]], "write": [[1.1, 2.9]],
                      "commit": [[2.9, 3.0]]}}
REPORT = {"source": {"uri": "/src", "kind": "local"}, "devices": 4, "scan_layers": True, "dtype": "bfloat16",
          "family": "qwen3", "maxtext_decoder_block": "qwen3", "tensors": 24, "leaves": 13,
          "source_bytes": 1288490189, "output_bytes": 1288490189, "wall_seconds": 75.3, "peak_rss_bytes": 340 * MIB,
          "skipped": False, "cpu_seconds": 90.0, "cpu_seconds_per_gib": 75.0,
          "stage_seconds": {"commit": 0.4, "plan": 0.2, "read": 30.0, "transform": 40.0, "write": 70.0},
          "timeline": TIMELINE, "attempts": 1}
VERIFIED = {"leaves": 13, "tensors": 24, "bytes": 1288490189, "seconds": 12.0}


def test_human_units():
    assert [human_bytes(n) for n in (None, 500, 1536, 340 * MIB, 1288490189, 5.5 * 2**40)] == \
        ["-", "500 B", "1.5 KiB", "340 MiB", "1.2 GiB", "5.5 TiB"]
    assert [human_seconds(s) for s in (None, 0.042, 3.46, 42.3, 75.3, 3599.6, 7384)] == \
        ["-", "0.042 s", "3.5 s", "42 s", "1 min 15 s", "1 h 0 min", "2 h 3 min"]


def test_rss_samples_stay_bounded_and_keep_the_largest():
    # the readings are this sampler's own (rss=): patching monitor.current_rss_bytes would feed them to every
    # other sampler thread alive in the worker process too
    values = iter([7, 7] + [10, 90, 20, 30, 40, 50, 60, 70, 80, 15, 25, 35] * 10)
    sampler = RssSampler(clock=lambda: 0.0, interval=3600, max_points=8, rss=lambda: next(values))
    sampler.stop()  # the thread sampled once, stop() once more (the two 7s); from here on we drive it
    sampler.points.clear()
    for _ in range(100):
        sampler.sample()
    assert len(sampler.points) <= 8 and max(b for _, b in sampler.points) == 90
    assert sampler.interval > 3600  # thinning doubles the interval: a long run keeps as few points


def test_stage_spans_merge_into_bands_and_land_in_the_figures():
    timer = StageTimer(sample_rss=True)
    for _ in range(5):
        with timer.stage("read"):
            time.sleep(0.01)
    timer.add("write", 0.5, start=0.0)
    figures = run_figures(timer, 2**20)
    spans = figures["timeline"]["spans"]
    assert len(spans["read"]) == 1 and spans["write"] == [[0.0, 0.5]]  # tile after tile: one band
    assert figures["timeline"]["rss"] and all(b > 0 for _, b in figures["timeline"]["rss"])
    assert "timeline" not in run_figures(StageTimer(), 2**20)  # verify's timer samples nothing


def test_plot_has_rss_line_predicted_peak_and_a_band_per_stage():
    svg = rssplot.render(TIMELINE, 3.0, 320 * MIB, 428 * MIB)
    assert svg.startswith("<svg") and svg.count("<polyline") == 1
    assert "predicted peak 428 MiB" in svg and "measured peak (VmHWM) 320 MiB" in svg
    for stage in ("plan", "read", "transform", "write", "commit"):
        assert f">{stage}</text>" in svg
    assert rssplot.render_report({"wall_seconds": 1.0}) is None  # an older report: no picture, no error


def test_convert_saves_the_plot_beside_the_report(tmp_path):
    source, out = tmp_path / "hf", tmp_path / "out"
    synth.write_checkpoint(synth.SynthModel(), str(source))
    done = subprocess.run([sys.executable, "-m", "ckptconv", "convert", str(source), str(out), "--devices", "4",
                           "--progress", "none"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "ckptconv-report.json").read_text())
    assert report["predicted_peak_rss_bytes"] >= report["peak_rss_bytes"] > 0
    assert set(report["timeline"]["spans"]) == {"plan", "read", "transform", "write", "commit"}
    assert report["timeline"]["rss"][-1][0] <= report["wall_seconds"] + 1
    svg = (out / rssplot.PLOT_NAME).read_text()
    assert svg.startswith("<svg") and "predicted peak" in svg


def test_model_page_reads_at_a_glance():
    job = Conversion("/src", "/dst", devices=4, name="qwen3-0-6b")
    page = summary_markdown(job, {"predicted_peak_rss_bytes": 428 * MIB}, REPORT, VERIFIED, "13 leaves sharded")
    assert "**1.2 GiB in 1 min 15 s, peak RSS 340 MiB (79% of the predicted 428 MiB)**" in page
    assert "overlap the write's" in page and "| **wall time** | **1 min 15 s** |" in page
    assert "| read | 30 s | 1.2 GiB | 41 MiB/s |" in page
    assert "Output: [/dst](file:///dst)" in page and "| verify | OK: 13 leaves, 24 tensors, 1.2 GiB" in page
    svg = re.search(r"!\[[^]]*\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", page)
    assert svg and "predicted peak 428 MiB" in base64.b64decode(svg.group(1)).decode()
    assert "1288490189" not in page and "75.3" not in page  # no raw bytes or raw seconds


def test_zoo_page_leads_with_status_and_error_and_links_each_model():
    ok, skipped, failed, waiting = (Conversion("/s", f"/d/{n}", name=n) for n in ("ok", "again", "bad", "idle"))
    rows = [{**zoo_row(ok, REPORT, None, 2, 428 * MIB, "1111"), "pool": "cpu", "worker": "w1"},
            {**zoo_row(skipped, {**REPORT, "skipped": True, "child_seconds": 4.0}, None, 1), "pool": "cpu"},
            {**zoo_row(failed, None, "BadInputError: config.json | missing\n  traceback line", 1), "pool": None},
            {**zoo_row(waiting, None, "no worker polls pool 'tpu-pool'", 0), "status": "never started"}]
    page = zoo_markdown("nightly", rows, "http://ui:4200")
    table = [line for line in page.splitlines() if line.startswith("|")]
    assert all(line.count(" | ") + 1 <= 8 for line in table) and len(ZOO_COLUMNS) <= 8
    assert table[0].startswith("| model | status | error or headline |")
    body = table[2:]
    assert body[0].startswith("| bad | **failed** | BadInputError: config.json \\| missing |")  # problems first
    assert body[1].startswith("| idle | **never started** | no worker polls pool 'tpu-pool' |")
    assert "| [ok](http://ui:4200/artifacts/artifact/1111) | complete | verified, peak 79% of predicted 428 MiB | " \
           "1 min 15 s | 340 MiB | 1.2 GiB | cpu / w1 | 1 |" in page
    assert "## Zoo `nightly`: 2 of 4 models ok" in page and "traceback line" not in page
    assert zoo_row(ok, REPORT, None, 1)["artifact_id"] is None and zoo_row(ok, REPORT, None, 1)["peak_rss_mib"] == 340


def test_demo_fails_when_an_artifact_it_names_is_missing(tmp_path, capsys):
    plot = tmp_path / rssplot.PLOT_NAME
    plot.write_text("<svg/>")
    page = "## x\n\n**1 GiB in 3 s, peak RSS 300 MiB**\n\n![RSS](data:image/svg+xml;base64,PHN2Zy8+)\n"
    found = {"conversion-m": SimpleNamespace(type="markdown", data=page),
             "conversion-m-row": SimpleNamespace(type="table", data=json.dumps([{"status": "complete"}])),
             "conversion-m-progress": SimpleNamespace(type="progress", data=100.0)}
    assert set(BRIEFS) == {"", "-row", "-progress"}
    assert print_artifacts("m", found, plot) == 0
    assert "1 GiB in 3 s, peak RSS 300 MiB; with the RSS plot" in capsys.readouterr().out
    for key in found:
        assert print_artifacts("m", {k: v for k, v in found.items() if k != key}, plot) == 1, key
        assert f"{key:<34} MISSING" in capsys.readouterr().out
    assert print_artifacts("m", found, tmp_path / "nowhere.svg") == 1
    assert print_artifacts("m", {**found, "conversion-m": SimpleNamespace(type="markdown", data="no headline")},
                           plot) == 1


def test_model_page_says_what_a_host_pays_to_restore():
    """The report's ``restore`` figures (computed from the stored layout) are a row of the model's page."""
    job = Conversion("/src", "/dst", devices=16, name="qwen3-0-6b")
    restore = {"chunks": 1136, "data_files": 20, "largest_data_file_bytes": 50 * MIB, "btree_nodes": 1, "devices": 16,
               "device": 0, "device_chunks": 71, "device_data_files": 16, "device_reads": 23,
               "device_read_bytes": 55 * MIB, "all_devices_reads": 22, "all_devices_read_bytes": 887 * MIB,
               "coalescing_bytes": 1_000_000}
    page = summary_markdown(job, {}, {**REPORT, "restore": restore}, VERIFIED, "13 leaves sharded")
    row = next(line for line in page.splitlines() if line.startswith("| restore |"))
    assert "1136 chunks in 20 OCDBT data files (largest 50 MiB)" in row
    assert "device 0's shard makes 23 storage reads (55 MiB, 71 chunks in 16 data files)" in row
    assert "all 16 shards 22" in row
    assert "| restore | - |" in summary_markdown(job, {}, REPORT, VERIFIED, "13 leaves sharded")  # older reports
    row = zoo_row(job, {**REPORT, "restore": restore}, None, 1)
    assert (row["data_files"], row["device_restore_reads"]) == (20, 23)
    assert (zoo_row(job, REPORT, None, 1)["data_files"], zoo_row(job, None, "x", 1)["device_restore_reads"]) == (None, None)
    failed = summary_markdown(job, {}, {**REPORT, "restore": {"error": "OSError: gone"}}, VERIFIED, "x")
    assert "| restore | layout not read: OSError: gone |" in failed
    timed = {**restore, "device_read_seconds": 0.41, "device_decoded_bytes": 70 * MIB}
    row = next(line for line in summary_markdown(job, {}, {**REPORT, "restore": timed}, VERIFIED, "x").splitlines()
               if line.startswith("| restore |"))
    assert "device 0's shard read back from the output in 0.41 s from the converting worker" in row
    assert zoo_row(job, {**REPORT, "restore": timed}, None, 1)["device_restore_seconds"] == 0.41
    sampled = {**timed, "device_decoded_bytes": 256 * MIB, "device_shard_bytes": 1024 * MIB}
    row = next(line for line in summary_markdown(job, {}, {**REPORT, "restore": sampled}, VERIFIED, "x").splitlines()
               if line.startswith("| restore |"))
    assert "device 0's shard (an even sample, 256 MiB of 1 GiB) read back from the output in 0.41 s" in row
