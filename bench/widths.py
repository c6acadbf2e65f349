"""Models at their released widths: measured conversions, and plans of the full models (no MaxText needed).

    .venv/bin/python -m bench giants [--skip-convert] [--keep]     # docs/bench/GIANTS.md
    .venv/bin/python -m bench hybrid-memory [--keep]               # docs/bench/HYBRID-MEMORY.md

1. Converts synthetic checkpoints in the hub's formats at the released widths, with fewer layers and experts, at 1
   and 16 devices, each in a fresh process (peak RSS: the conversion's own VmHWM, from its report; wall from
   outside), beside the plan's predicted peak:
   - ``giants``: DeepSeek-V3 widths (hidden 7168, MLA ranks 1536/512, MoE MLP 2048), 3 layers (1 dense), 8 and 32
     routed experts, FP8 with 128x128 block scales; gpt-oss-120b widths (hidden 2880, 64 heads), 2 layers, 32
     experts, MXFP4;
   - ``hybrid``: Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B (and its FP8 release) with one period of layers (3
     linear-attention + 1 full) and fewer experts, the hub's names (Qwen3.5's projections apart, experts fused).
2. Plans the full models from their published config.json with header-only checkpoints (sparse files: the headers
   are real, the data is never written): ``giants`` DeepSeek-V3 (671B) and Kimi-K2 (1T); ``hybrid``
   Qwen3-Next-80B-A3B, Qwen3.5-35B-A3B, Qwen3.5-397B-A17B (512 experts a layer) and its FP8 release.
Work files under bench/work/giants/ or bench/work/hybrid-memory/ (deleted unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import steps
from bench.measure import GIB, convert, plan_of


def _synth():
    from ckptconv.commands import synth

    return synth


def published(config: dict):
    """A SynthModel whose config.json is exactly ``config`` (its tensors follow from it)."""
    return _synth().SynthModel(model_type=config["model_type"], quantization="fp8", config_overrides=dict(config))


def deepseek_widths(experts: int):
    from tests.published_configs import DEEPSEEK_V3

    return _synth().SynthModel(model_type="deepseek_v3", quantization="fp8", config_overrides={
        **DEEPSEEK_V3, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": experts,
        "num_nextn_predict_layers": 0})


def gpt_oss_widths():
    return _synth().SynthModel(model_type="gpt_oss", quantization="mxfp4", vocab_size=201088, hidden_size=2880,
                               num_layers=2, num_heads=64, num_kv_heads=8, head_dim=64, intermediate_size=2880,
                               num_experts=32, config_overrides={"rope_theta": 150000.0})


def at_widths(config: dict, family: str, layers: int, experts: int):
    """The release's widths with ``layers`` layers and ``experts`` experts a layer (its FP8 release if the
    config has a quantization_config: e4m3 weights, bfloat16 block scales)."""
    text = config.get("text_config", config)
    overrides = {**text, "num_hidden_layers": layers, "num_experts": experts}
    if "layer_types" in text:
        overrides["layer_types"] = text["layer_types"][:layers]
    return _synth().SynthModel(model_type=family, tie_word_embeddings=False, config_overrides=overrides,
                               quantization="fp8" if "quantization_config" in config else None)


def hybrid_headers(config: dict, family: str):
    """A Qwen3-Next / Qwen3.5 release's tensors from its published config (its text config's sizes)."""
    return _synth().SynthModel(model_type=family, tie_word_embeddings=config["tie_word_embeddings"],
                               config_overrides=dict(config.get("text_config", config)),
                               quantization="fp8" if "quantization_config" in config else None)


@dataclass(frozen=True)
class Planned:
    """A full model planned from header-only files: its work directory's name, its tensors, and the config.json
    written over synth's (None: synth's own)."""

    directory: str
    model: Callable
    config: dict | None = None


@dataclass(frozen=True)
class WidthSet:
    work: str
    page: str
    title: str
    intro: str  # after "Written by ..."
    measured: Callable[[], dict]  # name: SynthModel
    planned: Callable[[], dict[str, Planned]]
    largest_read: bool = False  # the plans' table shows the largest single read
    footer: str = ""
    keep_sections: bool = False  # other benchmarks' sections of the page (## ...) stay below this one's tables


def giants_measured() -> dict:
    return {"deepseek-v3-widths-8-experts": deepseek_widths(8), "deepseek-v3-widths-32-experts": deepseek_widths(32),
            "gpt-oss-120b-widths-32-experts": gpt_oss_widths()}


def giants_planned() -> dict[str, Planned]:
    from tests.published_configs import DEEPSEEK_V3, KIMI_K2

    return {name: Planned(name.split()[0].lower(), lambda c=config: published(c))
            for name, config in (("DeepSeek-V3 (671B)", DEEPSEEK_V3), ("Kimi-K2 (1T)", KIMI_K2))}


def hybrid_measured() -> dict:
    from tests.published_configs import QWEN3_5_397B, QWEN3_5_397B_FP8, QWEN3_NEXT_80B

    return {"qwen3-next-80b-widths-4-layers-64-experts": at_widths(QWEN3_NEXT_80B, "qwen3_next", 4, 64),
            "qwen3.5-397b-widths-4-layers-32-experts": at_widths(QWEN3_5_397B, "qwen3_5_moe", 4, 32),
            "qwen3.5-397b-fp8-widths-4-layers-32-experts": at_widths(QWEN3_5_397B_FP8, "qwen3_5_moe", 4, 32)}


def hybrid_planned() -> dict[str, Planned]:
    from tests.published_configs import QWEN3_5_35B, QWEN3_5_397B, QWEN3_5_397B_FP8, QWEN3_NEXT_80B

    return {name: Planned(f"{name}-headers", lambda c=config, f=family: hybrid_headers(c, f), config)
            for name, (config, family) in (("Qwen3-Next-80B-A3B", (QWEN3_NEXT_80B, "qwen3_next")),
                                           ("Qwen3.5-35B-A3B", (QWEN3_5_35B, "qwen3_5_moe")),
                                           ("Qwen3.5-397B-A17B", (QWEN3_5_397B, "qwen3_5_moe")),
                                           ("Qwen3.5-397B-A17B-FP8", (QWEN3_5_397B_FP8, "qwen3_5_moe")))}


SETS = {
    "giants": WidthSet(
        "giants", "GIANTS.md", "The quantised giants: measured at their widths, planned at full size",
        "Peak RSS: the conversion process's own high-water mark (VmHWM); wall: from outside, start to exit.",
        giants_measured, giants_planned, keep_sections=True),
    "hybrid": WidthSet(
        "hybrid-memory", "HYBRID-MEMORY.md", "Qwen3-Next and Qwen3.5: measured at their widths, planned at full size",
        "Peak RSS: the conversion process's own high-water mark (VmHWM); wall: from outside. "
        "Synthetic checkpoints in the hub's layout (Qwen3.5: `in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a` "
        "apart, experts fused (experts, 2 x 1024, 4096); its FP8 release: e4m3 linear layers with bfloat16 "
        "128x128 block scales, experts one by one, kept quantised), one period of layers (3 linear-attention + "
        "1 full), scanned; the released vocabulary, hidden size, heads and expert widths.",
        hybrid_measured, hybrid_planned, largest_read=True,
        footer="The model's `mtp.*` and (Qwen3.5) `model.visual.*` tensors are not in these synthetic files; "
               "a real release's are read from the headers only and reported."),
}
COMMANDS = {"giants": "giants", "hybrid": "hybrid-memory"}  # the set's name in `python -m bench NAME`


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("set", choices=sorted(SETS), help="which models (giants / hybrid-memory give it)")
    parser.add_argument("--skip-convert", action="store_true", help="plans only")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic sources")
    parser.add_argument("--out", help="the page (default: docs/bench/<its page>)")
    args = parser.parse_args(argv)
    chosen = SETS[args.set]
    work = steps.WORK / chosen.work
    work.mkdir(parents=True, exist_ok=True)
    synth = _synth()
    rows: dict[str, list[dict]] = {}
    for name, model in ({} if args.skip_convert else chosen.measured()).items():
        src = work / name
        shutil.rmtree(src, ignore_errors=True)
        synth.write_checkpoint(model, str(src), max_shard_bytes=5 * 10**9, fast=True)
        rows[name] = [convert(src, work / f"{name}-out", devices) for devices in (1, 16)]
        print(json.dumps({name: rows[name]}), flush=True)
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    plans: dict[str, list[dict]] = {}
    for name, planned in chosen.planned().items():
        src = work / planned.directory
        shutil.rmtree(src, ignore_errors=True)
        synth.write_checkpoint(planned.model(), str(src), max_shard_bytes=5 * 10**9, header_only=True)
        if planned.config is not None:
            (src / "config.json").write_text(json.dumps(planned.config))
        plans[name] = [plan_of(src, devices) | {"devices": devices} for devices in (16, 1)]
        print(json.dumps({name: {k: plans[name][0][k] for k in ("predicted_peak_rss_bytes", "predicted_seconds",
                                                                  "source_bytes", "output_bytes", "plan_seconds")}}),
              flush=True)
        shutil.rmtree(src, ignore_errors=True)
    write(chosen, rows, plans, Path(args.out) if args.out else steps.DOCS / chosen.page, COMMANDS[args.set])
    ok = all("error" not in r and r["peak_rss_bytes"] <= r["predicted_peak_rss_bytes"] <= 1.5 * GIB
             for runs in rows.values() for r in runs)
    return 0 if ok or args.set == "giants" else 1


def write(chosen: WidthSet, rows: dict, plans: dict, path: Path, command: str) -> None:
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [f"# {chosen.title}", "", steps.written_by(command, f", {os.cpu_count()} cores") + " " + chosen.intro, ""]
    if rows:
        measured = []
        for name, runs in rows.items():
            for r in runs:
                measured.append([name, "-", "-", r["devices"], f"failed: `{r['error']}`", "-", "-"] if "error" in r else
                                [name, gib(r["source_bytes"]), gib(r["output_bytes"]), r["devices"],
                                 gib(r["peak_rss_bytes"]), gib(r["predicted_peak_rss_bytes"]),
                                 f"{r['wall_seconds']:.0f} s"])
        lines += steps.table(["synthetic checkpoint (hub format)", "source", "output", "devices", "peak RSS",
                              "predicted", "wall"], measured) + [""]
    header = ["full model, published config.json, header-only files", "source", "output", "devices",
              "predicted peak RSS", "predicted time (2 cores)"] + (["largest read"] if chosen.largest_read else []) + [
              "plan took"]
    planned = [[name, f"{p['source_bytes'] / GIB:.0f} GiB", f"{p['output_bytes'] / GIB:.0f} GiB", p["devices"],
                gib(p["predicted_peak_rss_bytes"]), f"{p['predicted_seconds'] / 3600:.1f} h"]
               + ([f"{p['largest_read_bytes'] / 2**20:.0f} MiB"] if chosen.largest_read else [])
               + [f"{p['plan_seconds']:.1f} s"] for name, runs in plans.items() for p in runs]
    lines += steps.table(header, planned)
    if chosen.footer:
        lines += ["", chosen.footer]
    rest = ""
    if chosen.keep_sections:  # the V4 and Kimi-K2.5 sections (python -m bench deepseek-v4 / kimi25) stay as they are
        old = path.read_text() if path.exists() else ""
        rest = old[old.index("\n## "):] if "\n## " in old else ""
    path.write_text("\n".join(lines) + "\n" + rest)
