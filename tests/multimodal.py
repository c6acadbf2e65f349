"""What the ``--multimodal`` tests of every family with encoders share: the conversion checked end to end, and the
synthetic Qwen3-VL tower's leaves as MaxText names them (Qwen3-VL, Qwen3-VL-MoE and Qwen3-Omni hold the same tower
under their own module names)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.numpy import load_file

from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.commands.export import ExportRequest, export
from ckptconv.commands.verification import verify
from tests.test_export import assert_same, hf_tensors


def convert_verify_export(source: Path, tmp_path: Path, devices: int, scan_layers: bool | None = None,
                          close: tuple[str, ...] = (), source_tensors: dict | None = None) -> tuple[dict, dict]:
    """``convert --multimodal`` of ``source``, which ``verify`` accepts and ``export --like`` the source gives back
    bit for bit (``close``: names back within one bfloat16 step; ``source_tensors``: what the source holds, if not
    its one ``model.safetensors``); returns (conversion report, export report)."""
    mt, hf = tmp_path / "maxtext", tmp_path / "hf"
    convert(ConvertRequest(str(source), str(mt), devices=devices, scan_layers=scan_layers, progress="none",
                           multimodal=True))
    report = json.loads((mt / "ckptconv-report.json").read_text())
    assert report["multimodal"] is True and report["not_converted"] == []
    assert scan_layers is None or report["scan_layers"] is scan_layers
    assert verify(str(source), str(mt)).ok
    exported = export(ExportRequest(str(mt), str(hf), like=str(source), progress="none"))
    assert exported["status"] == "complete" and exported["scan_layers"] is report["scan_layers"]
    wanted = source_tensors if source_tensors is not None else load_file(str(source / "model.safetensors"))
    assert_same(wanted, hf_tensors(hf), close)  # every tensor, hub names included
    return report, exported


def qwen3_vl_tower(encoder: tuple[str, ...], projector: tuple[str, ...]) -> dict[tuple[str, ...], tuple[int, ...]]:
    """MaxText 0.2.5's leaves of the synthetic Qwen3-VL tower (1 block, hidden 32, 2 heads of 16, MLP 64, a
    deepstack merger at block 0, merged width 4 x 32 = 128, out 64) under ``encoder`` and ``projector``."""
    merger = {("ln_q", "scale"): (128,), ("ln_q", "bias"): (128,), ("mlp_0", "kernel"): (128, 128),
              ("mlp_0", "bias"): (128,), ("mlp_2", "kernel"): (128, 64), ("mlp_2", "bias"): (64,)}
    block = (*encoder, "blocks_0")
    return {
        (*encoder, "patch_embed", "proj", "kernel"): (2, 16, 16, 3, 32), (*encoder, "patch_embed", "proj", "bias"): (32,),
        (*encoder, "pos_embed_interpolate", "pos_embed"): (2304, 32),
        **{(*block, ln, p): (32,) for ln in ("ln1", "ln2") for p in ("scale", "bias")},
        **{(*block, "attn", "attn", m, "kernel"): (32, 2, 16) for m in ("query", "key", "value")},
        **{(*block, "attn", "attn", m, "bias"): (2, 16) for m in ("query", "key", "value")},
        (*block, "attn", "attn", "out", "kernel"): (2, 16, 32), (*block, "attn", "attn", "out", "bias"): (32,),
        (*block, "mlp", "kernel"): (32, 64), (*block, "mlp", "bias"): (64,),
        (*block, "mlp_out", "kernel"): (64, 32), (*block, "mlp_out", "bias"): (32,),
        **{(*encoder, "merger_0", *path): shape for path, shape in merger.items()},
        **{(*projector, "merger", *path): shape for path, shape in merger.items() if path[0] != "ln_q"},
        (*projector, "merger", "ln_q", "scale"): (32,), (*projector, "merger", "ln_q", "bias"): (32,),
    }
