"""One settings object for what a run holds in flight: the runtime obeys it and the memory prediction
counts it, so a change to one limit moves both (the estimate and the run cannot disagree)."""

from __future__ import annotations

import dataclasses
import time

from ckptconv import settings
from ckptconv.commands import synth
from ckptconv.plan import estimate
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from ckptconv.write.produce import prefetch


def _produced_ahead(expected: int) -> int:
    """How many items the prefetch thread makes while its consumer holds the first one: waits (up to
    10 s, for a loaded machine) until ``expected`` are made, then a moment more for any beyond them."""
    made = []

    def produce():
        for n in range(100):
            made.append(n)
            yield n

    stream = prefetch(produce)
    next(stream)  # the consumer holds one; the producer fills what it may, then blocks on the full queue
    deadline = time.monotonic() + 10
    while len(made) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # one more would show up now if the queue let it
    ahead = len(made)
    stream.close()
    return ahead


def test_the_prefetch_thread_holds_what_the_setting_allows(monkeypatch):
    for depth in (1, 2, 4):
        monkeypatch.setattr(settings, "IN_FLIGHT", dataclasses.replace(settings.IN_FLIGHT, prefetch=depth))
        # the one the consumer took, `depth` queued, and the one the producer holds while the queue is full
        assert _produced_ahead(1 + depth + 1) == 1 + depth + 1


def test_the_prediction_counts_every_tile_the_runtime_may_hold(tmp_path, monkeypatch):
    """One more tile queued (``prefetch``) or in tensorstore's writes (``writes``) is one more tile predicted; by
    device no tile waits for tensorstore during the stream (each goes to the spill), so there the queue counts and
    the writes do not (``IN_FLIGHT.tiles_spilling``). 16 MiB data files: the output fills more than two windows,
    so producer and writer count together."""
    synth.write_checkpoint(synth.QWEN3_0_6B, str(tmp_path), header_only=True)
    plan = make_plan(LocalSource(str(tmp_path)), devices=16)
    for by_device, counted in ((False, {"prefetch": True, "writes": True}),
                               (True, {"prefetch": True, "writes": False})):
        options = settings.RunOptions(data_file_bytes=16 * 2**20, data_files_by_device_asked=by_device)
        assert bool(options.spill_window_bytes(16, plan.output_bytes)) is by_device
        alive = settings.IN_FLIGHT.tiles_spilling if by_device else settings.IN_FLIGHT.tiles_alive
        tile = max(((estimate.tile_bytes(job, plan), estimate.work_bytes(job, plan.spec)) for job in plan.jobs),
                   key=lambda tw: alive * tw[0] + tw[1])[0]  # the tile of the job the prediction is sized by
        base = estimate.predicted_peak_bytes(plan, options=options)
        for field, more_counted in counted.items():
            more = dataclasses.replace(settings.IN_FLIGHT, **{field: getattr(settings.IN_FLIGHT, field) + 1})
            monkeypatch.setattr(settings, "IN_FLIGHT", more)
            added = estimate.predicted_peak_bytes(plan, options=options) - base
            assert (added >= tile if more_counted else added == 0), (by_device, field, added)
            monkeypatch.undo()
    assert settings.IN_FLIGHT.tiles_alive == settings.IN_FLIGHT.prefetch + settings.IN_FLIGHT.writes + 2
    assert settings.IN_FLIGHT.tiles_spilling == settings.IN_FLIGHT.prefetch + 2


def test_the_predicted_peak_is_its_terms(tmp_path, monkeypatch):
    """plan and the report show what the prediction is made of: baseline, OCDBT cache, and what the writer and the
    producer hold together (their sum while both run; the larger only when a spilled model fits two windows, the
    writer's less the stream's runtime: it writes once the stream has ended)."""
    synth.write_checkpoint(synth.QWEN3_0_6B, str(tmp_path), header_only=True)
    plan = make_plan(LocalSource(str(tmp_path)), devices=16)
    for by_device, together in ((False, "sum"), (True, "larger")):
        options = settings.RunOptions(data_file_bytes=2**30, data_files_by_device_asked=by_device)
        terms = estimate.peak_terms(plan, options=options)
        assert estimate.predicted_peak_bytes(plan, options=options) == \
            terms["baseline"] + terms["cache"] + terms["overlap"]
        assert terms["overlap"] == {"sum": terms["writer"] + terms["producer"],
                                    "larger": max(terms["writer"] - estimate.STREAM_RUNTIME_BYTES,
                                                  terms["producer"])}[together], (by_device, terms)
        assert estimate.plan_summary(plan, options)["predicted_peak_terms"] == terms


def test_the_shipped_deployments_take_their_defaults_from_settings():
    """deploy/prefect.yaml names only what differs from the flows' defaults: a parameter it restated
    (16 devices, bfloat16, ...) would silently pin the deployments when a default in settings moves."""
    from pathlib import Path

    import yaml

    restatable = {"devices": settings.DEVICES, "scan_layers": settings.SCAN_LAYERS, "dtype": settings.DTYPE,
                  "shard_size": settings.SHARD_SIZE, "data_file_size": settings.DATA_FILE_SIZE,
                  "data_files_by_device": settings.DATA_FILES_BY_DEVICE, "compression": settings.COMPRESSION}
    text = (Path(__file__).resolve().parents[1] / "deploy" / "prefect.yaml").read_text()
    for deployment in yaml.safe_load(text)["deployments"]:
        restated = sorted(set(deployment.get("parameters") or {}) & set(restatable))
        assert not restated, f"{deployment['name']} restates the default of {restated}"
