"""Peak RSS must not grow with the model: 4x the layers (4x the bytes) at the same widths.

A converter that held the whole model (as MaxText's does) would add the extra ~0.75 GiB of
weights to its peak; ours streams slab by slab, so the peaks must stay within a margin far
smaller than that. The figure is the kernel's high-water mark from the report.
"""

import json

import pytest

from ckptconv import synth
from tests.conftest import run_cli

MiB = 2**20


def convert_peak(synth_dir, tmp_path, layers: int) -> tuple[int, int]:
    model = synth.SynthModel(vocab_size=8192, hidden_size=1024, num_layers=layers, num_heads=8, num_kv_heads=4,
                             head_dim=128, intermediate_size=4096)
    src, dst = synth_dir(model, name=f"src{layers}"), tmp_path / f"dst{layers}"
    result = run_cli("convert", str(src), str(dst), "--devices", "16", "--progress", "none")
    assert result.returncode == 0, result.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    predicted = json.loads(run_cli("plan", str(src), "--devices", "16", "--json").stdout)["predicted_peak_rss_bytes"]
    assert report["peak_rss_bytes"] <= predicted, "admission relies on the prediction being an upper bound"
    return report["peak_rss_bytes"], report["source_bytes"]


@pytest.mark.slow
def test_peak_rss_does_not_grow_with_layers(synth_dir, tmp_path):
    small_peak, small_bytes = convert_peak(synth_dir, tmp_path, 6)
    big_peak, big_bytes = convert_peak(synth_dir, tmp_path, 24)
    assert big_bytes - small_bytes > 500 * MiB  # the big model really is much bigger
    print(f"peak RSS: {small_peak / MiB:.0f} MiB for {small_bytes / MiB:.0f} MiB, "
          f"{big_peak / MiB:.0f} MiB for {big_bytes / MiB:.0f} MiB")
    assert big_peak <= small_peak + 96 * MiB, (small_peak / MiB, big_peak / MiB)
