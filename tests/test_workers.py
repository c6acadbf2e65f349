"""Every core of the host (issue 38): parallel workers under a memory budget the prediction still bounds.

The producer's workers make the same tile stream as one worker, in the same order (so the writer writes the same
data files); the workers chosen are the most whose predicted peak fits the budget; a worker more is predicted to
hold what it holds; and a host without ``VmHWM`` (gVisor) reports a peak of its own, sampled, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ckptconv import host, monitor, settings
from ckptconv.commands import synth
from ckptconv.monitor import StageTimer
from ckptconv.plan import estimate
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from ckptconv.write.produce import produce_tiles

MiB = 2**20
GiB = 2**30


def _stream(plan, source, workers: int) -> list[tuple[int, tuple, bytes]]:
    options = settings.RunOptions(workers=workers)
    return [(index, tuple((s.start, s.stop) for s in region), data.dtype.str, data.tobytes())
            for index, region, data in produce_tiles(plan, source, StageTimer(), options)]


def test_workers_make_the_one_worker_stream_in_its_order(tmp_path, monkeypatch):
    """Small reads (4 KiB) cut a tiny model's tensors into many units; three workers hand over the very tiles one
    worker makes, in the same order."""
    synth.write_checkpoint(synth.SynthModel(num_layers=3), str(tmp_path))
    monkeypatch.setattr(settings, "IN_FLIGHT", dataclasses.replace(settings.IN_FLIGHT, read_bytes=4096))
    source = LocalSource(str(tmp_path))
    plan = make_plan(source, devices=4)
    one = _stream(plan, source, 1)
    assert len(one) > 2 * len(plan.leaves)  # many units: the order has something to keep
    assert _stream(plan, source, 3) == one


def test_no_more_units_than_the_transform_slots_are_transformed_at_once(tmp_path, monkeypatch):
    """Twelve workers (a 13-core host's) transform ``settings.TRANSFORM_SLOTS`` units at once, not half of them: the
    estimate counts that many units' float32 work (``RunOptions.transforming``), and the rest only read."""
    from ckptconv.write import produce

    synth.write_checkpoint(synth.SynthModel(num_layers=3), str(tmp_path))
    monkeypatch.setattr(settings, "IN_FLIGHT", dataclasses.replace(settings.IN_FLIGHT, read_bytes=4096))
    source = LocalSource(str(tmp_path))
    plan = make_plan(source, devices=4)
    options = settings.RunOptions(workers=12)
    assert options.transforming == settings.TRANSFORM_SLOTS < options.workers // 2
    assemble, lock, active, most = produce._assemble, threading.Lock(), [0], [0]

    def counted(*args):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.01)  # long enough for the other workers to come to their transform
            return assemble(*args)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(produce, "_assemble", counted)
    tiles = list(produce_tiles(plan, source, StageTimer(), options))
    assert len(tiles) > 2 * len(plan.leaves) and most[0] == settings.TRANSFORM_SLOTS, (len(tiles), most[0])


def test_an_error_in_a_worker_reaches_the_writer(tmp_path):
    synth.write_checkpoint(synth.SynthModel(), str(tmp_path))
    source = LocalSource(str(tmp_path))
    plan = make_plan(source, devices=4)
    with open(tmp_path / "model.safetensors", "r+b") as f:  # the data cut short after the header was read
        f.truncate(f.seek(0, os.SEEK_END) // 2)
    with pytest.raises(Exception, match="truncated|ends at"):
        _stream(plan, source, 3)


@pytest.fixture(scope="module")
def wide_plan(tmp_path_factory):
    """Llama-3-8B's widths with 2 layers, headers only (nothing to read: the estimate needs the plan alone)."""
    src = tmp_path_factory.mktemp("llama8b")
    synth.write_checkpoint(dataclasses.replace(synth.LLAMA3_8B, num_layers=2), str(src), header_only=True)
    return make_plan(LocalSource(str(src)), devices=16)


def _peak(plan, workers: int, **fields) -> int:
    return estimate.predicted_peak_bytes(plan, options=settings.RunOptions(workers=workers, **fields))


def test_each_worker_more_is_predicted_to_hold_its_unit_and_its_work(wide_plan):
    """A worker more holds one more unit's tiles and its read; every second one also a transform's work (half the
    workers transform at once: RunOptions.transforming)."""
    figures = estimate.job_figures(wide_plan)
    per_worker = min(f.unit + f.read for f in figures if f.unit)
    heaviest = max(figures, key=lambda f: f.work)
    peaks = [_peak(wide_plan, workers) for workers in range(2, 8)]
    assert all(b - a >= per_worker for a, b in zip(peaks, peaks[1:])), [p / MiB for p in peaks]
    assert all(b - a >= 2 * per_worker + heaviest.work - heaviest.read
               for a, b in zip(peaks, peaks[2:])), [p / MiB for p in peaks]
    # in the source's order more than one worker also gathers a data file while the last commits, and from four on
    # two lanes commit at once: a data file more each in the writer's term; by device each lane's own data file
    def writer(workers: int, by_device: bool) -> int:
        options = settings.RunOptions(workers=workers, data_files_by_device_asked=by_device)
        return estimate.peak_terms(wide_plan, options=options)["writer"]

    size = settings.IN_FLIGHT.data_file_bytes
    assert writer(2, False) - writer(1, False) >= size and writer(4, False) - writer(2, False) >= size
    assert writer(4, True) >= 2 * writer(1, True) and writer(2, True) >= writer(1, True)  # two lanes: a file each


def test_the_workers_are_the_most_the_budget_fits(wide_plan):
    host_has = {"host_cores": 8}
    between = (_peak(wide_plan, 3) + _peak(wide_plan, 4)) // 2
    fitted = estimate.choose_workers(wide_plan, settings.RunOptions(budget_bytes=between, budget_asked=True,
                                                                    **host_has))
    assert fitted.workers == 3 and "3 of 7" in fitted.why and "--memory-budget" in fitted.why, fitted.why
    assert estimate.predicted_peak_bytes(wide_plan, options=fitted) <= between
    roomy = estimate.choose_workers(wide_plan, settings.RunOptions(budget_bytes=64 * GiB, **host_has))
    assert roomy.workers == 7 and "of the 8 this process may use but the writer's" in roomy.why, roomy.why
    for cores, workers in ((1, 1), (2, 1), (3, 2), (13, 12)):  # a core is the writer's
        chosen = estimate.choose_workers(wide_plan, settings.RunOptions(budget_bytes=64 * GiB, host_cores=cores))
        assert chosen.workers == workers, (cores, chosen.why)
    asked = estimate.choose_workers(wide_plan, settings.RunOptions(workers_asked=2, budget_bytes=64 * GiB, **host_has))
    assert asked.workers == 2 and "asked" in asked.why
    tight = estimate.choose_workers(wide_plan, settings.RunOptions(budget_bytes=MiB, budget_asked=True, **host_has))
    assert tight.workers == 1 and "over --memory-budget" in tight.why, tight.why
    assert estimate.plan_summary(wide_plan, fitted)["run"]["workers"] == 3


def test_the_host_says_its_cores_and_memory():
    assert 1 <= host.cores() <= (os.cpu_count() or 1)
    assert host.available_bytes("MemTotal: 100 kB\nMemAvailable: 42 kB\n") == 42 * 1024
    assert host.available_bytes("MemTotal: 100 kB\n") is None
    options = host.run_options(workers=3)
    assert options.workers_asked == 3 and options.host_cores == host.cores() and not options.budget_asked
    assert options.budget_bytes == int(options.host_available_bytes * settings.BUDGET_SHARE_OF_AVAILABLE)
    assert host.run_options(budget_bytes=GiB).budget_asked


def test_a_peak_without_vmhwm_is_sampled_and_says_so(monkeypatch):
    """gVisor's /proc/self/status has VmRSS but no VmHWM: the peak then comes from VmRSS sampled in a thread (never
    ru_maxrss, which carries a parent's peak across exec), and the report names its source."""
    assert monitor.peak_source("Name: python\nVmPeak: 10 kB\nVmHWM: 8 kB\nVmRSS: 6 kB\n") == monitor.HWM
    assert monitor.peak_source("Name: python\nVmRSS: 6 kB\n") == monitor.SAMPLED
    assert monitor.peak_source(None) == monitor.MAXRSS
    watch = monitor.PeakWatch(interval=0.005)
    try:
        before = watch.sample()
        block = np.ones(256 * MiB // 8)  # touched: resident while it lives
        import time
        time.sleep(0.1)
        del block
        assert watch.sample() >= before + 200 * MiB  # seen by the thread, and kept after the block was freed
        # module state, for the synchronous peak_rss() below only (no thread reads either; undone at the end)
        monkeypatch.setattr(monitor, "_status", lambda: "Name: python\nVmRSS: 6 kB\n")
        monkeypatch.setattr(monitor, "_WATCH", [watch])
        peak, source = monitor.peak_rss()
        assert source == monitor.SAMPLED and peak >= before + 200 * MiB
    finally:
        watch.stop()  # else its thread samples every 5 ms for the rest of this worker's tests


CHILD = """
import json, sys
from ckptconv import monitor
monitor._status = lambda: "Name: python\\nVmRSS: 6 kB\\n"  # as gVisor's, before anything is measured
timer = monitor.StageTimer()
print(json.dumps(dict(zip(("peak", "source"), monitor.peak_rss()))))
"""


def test_a_child_of_a_big_parent_reports_its_own_peak_where_there_is_no_vmhwm():
    """A child started by this (big) test process, its /proc as gVisor's: its peak is its own (ru_maxrss would be at
    least this parent's)."""
    block = np.ones(512 * MiB // 8)  # the parent grows well past what the child will use
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    del block
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["source"] == monitor.SAMPLED
    assert report["peak"] < 300 * MiB, report


def test_a_kernel_without_vmhwm_plans_on_its_own_baseline(wide_plan):
    """On gVisor the runtime alone is resident at about 0.5 GiB (measured on the TPU host); the prediction there
    starts from that kernel's baseline, the same run's elsewhere from ours, and counts the freed buffers the heap keeps
    there (its mmap threshold is larger: ``monitor.tune_malloc``)."""
    here, there = (estimate.peak_terms(wide_plan, options=settings.RunOptions(sandboxed=s)) for s in (False, True))
    assert here["baseline"] == estimate.BASELINE_BYTES and there["baseline"] == estimate.BASELINE_SANDBOX_BYTES
    own = ("baseline", "heap")  # that kernel's runtime, and the freed buffers its larger mmap threshold keeps
    assert {k: v for k, v in here.items() if k not in own} == {k: v for k, v in there.items() if k not in own}
    assert here["heap"] == 0 and there["heap"] == int(there["producer"] * estimate.SANDBOX_HEAP_SHARE) > 0
    assert monitor.default_mmap_threshold("VmHWM: 5 kB\nVmRSS: 4 kB") == 1 << 20
    assert monitor.default_mmap_threshold("VmRSS: 4 kB") == settings.SANDBOX_MMAP_THRESHOLD > 1 << 20
    # this kernel's answer, read independently of ckptconv's reading of it, reaches the run's options
    assert host.sandboxed() == ("VmHWM:" not in pathlib.Path("/proc/self/status").read_text())
    assert host.run_options().sandboxed == host.sandboxed()


def test_a_sandboxed_run_trims_only_past_its_prediction_less_the_heap(wide_plan):
    """On a kernel without VmHWM the heap's free pages are a term of the prediction, and the run gives them back only
    once its resident set passes the rest of it (``estimate.trim_line``); elsewhere it trims as it always has."""
    here, there = (estimate.peak_terms(wide_plan, options=settings.RunOptions(sandboxed=s)) for s in (False, True))
    assert estimate.trim_line(estimate.predicted_peak_bytes(wide_plan, terms=here), here["heap"]) is None
    predicted = estimate.predicted_peak_bytes(wide_plan, terms=there)
    assert estimate.trim_line(predicted, there["heap"]) == predicted - there["heap"] < predicted


# In a fresh process (the heap is the process's): 200 MiB freed in glibc's heap below a live block, so that only a
# trim gives it back; then a trim with the line above the resident set, and one without a line.
TRIM_LINE_CHILD = """
from ckptconv import monitor
monitor.tune_malloc(mmap_threshold=64 << 20)
held = [bytearray(1 << 20) for _ in range(200)]
top = bytearray(1 << 20)
del held
before = monitor.current_rss_bytes()
monitor.trim_only_above(before + (1 << 30))
monitor.trim()
kept = monitor.current_rss_bytes()
monitor.trim_only_above(None)
monitor.trim()
print(before, kept, monitor.current_rss_bytes())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_trim")
def test_trim_gives_pages_back_only_above_the_line():
    done = subprocess.run([sys.executable, "-c", TRIM_LINE_CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, kept, after = (int(n) for n in done.stdout.split())
    assert kept > before - 20 * MiB, "trimmed although the resident set was within the line"
    assert after < before - 150 * MiB, "the 200 MiB freed in the heap stayed resident after a trim without a line"


# In a fresh process: the RSS sampler (PeakWatch, as on a kernel without VmHWM) running, 200 MiB taken from and freed
# back to glibc's heap, and no trim called: with the line within those 200 MiB the sampler gives them back itself; with
# the line above them, or none, they stay.
SAMPLER_TRIM_CHILD = """
import sys, time
from ckptconv import monitor
monitor.tune_malloc(mmap_threshold=64 << 20)
start = monitor.current_rss_bytes()
line = {"within": start + (100 << 20), "above": start + (1 << 30), "none": None}[sys.argv[1]]
monitor.trim_only_above(line)
watch = monitor.PeakWatch(interval=0.01)
held = [bytearray(1 << 20) for _ in range(200)]
top = bytearray(1 << 20)
watch.sample()  # the 200 MiB seen resident, however fast they were made
del held
time.sleep(0.5)
watch.stop()
print(start, watch.peak, monitor.current_rss_bytes())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_trim")
def test_the_rss_sampler_trims_as_soon_as_the_line_is_passed():
    """Where the peak is sampled (no VmHWM), the sampler trims the heap as soon as the resident set passes the trim
    line, not at the writer's next trim (64 MiB written later, by which time 12 workers had taken the heap far past the
    line); within the line, or with none, it leaves the heap alone (each page given back is faulted in again)."""
    left = {}
    for case in ("within", "above", "none"):
        done = subprocess.run([sys.executable, "-c", SAMPLER_TRIM_CHILD, case], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        start, peak, end = (int(n) for n in done.stdout.split())
        assert peak > start + 150 * MiB, (case, "the 200 MiB were never resident")
        left[case] = end - start
    assert left["within"] < 60 * MiB, {k: v / MiB for k, v in left.items()}
    assert left["above"] > 150 * MiB and left["none"] > 150 * MiB, {k: v / MiB for k, v in left.items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_trim")
def test_the_heap_is_tuned_through_the_processs_own_libc_without_a_child():
    """``tune_malloc`` finds glibc's ``mallopt`` and ``malloc_trim`` among the process's own symbols (``CDLL(None)``),
    in a fresh process (it changes that process's heap for good), and starts no child to look for libc (``find_library``
    runs ``ldconfig -p`` at every CLI start)."""
    code = ("import subprocess\n"
            "started = []\n"
            "subprocess.Popen.__init__ = lambda self, *a, **k: started.append(a)\n"
            "from ckptconv import monitor\n"
            "monitor.tune_malloc()\n"
            "assert monitor._LIBC is not None and monitor._LIBC.malloc_trim(0) in (0, 1)\n"
            "assert not started, started\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
