"""LoRA adapters, ckptconv against MaxText 0.2.5's ``to_maxtext`` (``hf_lora_adapter_path``): leaf by leaf, bit
for bit, in adapter mode and merged mode; and how long each takes. Writes ``docs/bench/LORA.md``.

    .venv/bin/python -m bench lora [--only qwen3,llama3.1] [--no-timing]

Tiny cases: a random bf16 synthetic base (``ckptconv.commands.synth``) and a PEFT adapter made and saved by
PEFT itself with random A and B (``tests/lora_adapters.py``). MaxText runs through
``bench/maxtext_convert_tiny.py`` (the checkpoint's own config in its ``model_name`` table, sizes as overrides);
merged mode is MaxText's ``load_parameters_path`` set (its converter only tests it for non-empty).
``bench/compare_outputs.py`` restores both in MaxText's venv with Orbax's public API.

Timing: a rank-16 adapter on every projection of a Qwen3-0.6B-shaped base (28 layers, hidden 1024), written
here in PEFT's names and layout; adapter mode reads only the base's config.json (ckptconv) or MaxText's
built-in qwen3-0.6b table; merged mode streams the whole base.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import steps
from bench.compare_families import overrides as family_overrides
from bench.steps import BENCH, DOCS, setup_maxtext
from ckptconv.commands import synth
from ckptconv.families.llama import LLAMA31_ROPE
from tests.lora_adapters import write_peft_adapter

WORK = BENCH / "work" / "lora"


@dataclass(frozen=True)
class Case:
    name: str
    model: synth.SynthModel
    maxtext_model: str
    scan: bool = True
    devices: int = 4
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
CASES = [
    Case("qwen3", synth.SynthModel(model_type="qwen3"), "qwen3-0.6b"),
    Case("qwen3-unscanned", synth.SynthModel(model_type="qwen3"), "qwen3-0.6b", scan=False, devices=2),
    # head_dim 8: 1/sqrt(head_dim) is not a power of two, so the query scaling's rounding is compared too
    Case("llama3.1", synth.SynthModel(model_type="llama", tie_word_embeddings=False, head_dim=8,
                                      config_overrides={"rope_scaling": LLAMA31_ROPE}), "llama3.1-8b"),
    Case("llama3.1-attention", synth.SynthModel(model_type="llama", tie_word_embeddings=False, head_dim=8,
                                                config_overrides={"rope_scaling": LLAMA31_ROPE}), "llama3.1-8b",
         scan=False, devices=2, targets=("q_proj", "k_proj")),
    # tied, as MaxText's qwen2.5-1.5b (its table has no logits_dense for an untied one)
    Case("qwen2.5", synth.SynthModel(model_type="qwen2", tie_word_embeddings=True), "qwen2.5-1.5b"),
    # MoE families: attention only (PEFT targets the experts through target_parameters, which MaxText lacks)
    Case("qwen3_moe-attention", synth.SynthModel(model_type="qwen3_moe", num_experts=16, moe_intermediate_size=48,
                                                 tie_word_embeddings=False), "qwen3-30b-a3b", targets=ATTENTION),
    Case("mixtral-noscan-attention", synth.SynthModel(model_type="mixtral", num_experts=4, tie_word_embeddings=False),
         "mixtral-8x7b", scan=False, targets=ATTENTION),
    Case("gemma2", synth.SynthModel(model_type="gemma2", num_layers=4, vocab_size=256000, hidden_size=32, head_dim=8,
                                    intermediate_size=64), "gemma2-2b"),
]


def run(cmd: list, env: dict | None = None, log: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """A step in a fresh process (bench/steps.py), its output in ``log``, and its wall seconds."""
    return steps.timed(cmd, log or WORK / "step.log", env)


def make_adapter(base: Path, directory: Path, targets: tuple[str, ...], rank: int = 4, alpha: int = 16) -> None:
    from tests.lora_adapters import make_adapter as peft_adapter

    peft_adapter(base, directory, rank=rank, alpha=alpha, targets=targets)


def compare(ctx: dict, ours: Path, theirs: Path, root: Path, label: str) -> dict:
    _, result = steps.compare_outputs(ours, theirs, root / f"compare-{label}.json", root / f"compare-{label}.log",
                                      env=ctx["mt_env"])
    return {"identical": result["identical"], "leaves": result["leaves_compared"],
            "value_mismatches": result["value_mismatches"][:3], "only_in_ckptconv": result["only_in_a"],
            "only_in_maxtext": result["only_in_b"],
            "metadata_differences": sorted({d["field"] for d in result["metadata_differences"]})}


def run_case(case: Case, ctx: dict) -> dict:
    root = WORK / case.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    base, adapter = root / "hf", root / "adapter"
    synth.write_checkpoint(case.model, str(base))
    make_adapter(base, adapter, case.targets)
    layout = ["--devices", str(case.devices), "--scan-layers" if case.scan else "--no-scan-layers"]
    mt_layout = [o for o in family_overrides(_family_case(case)) if not o.startswith("scan_layers=")]
    mt_layout.append(f"scan_layers={str(case.scan).lower()}")
    flags = ["--lazy_load_tensors=true", f"--simulated_cpu_devices_count={case.devices}", "--save_dtype=bfloat16"]
    row = {"case": case.name, "maxtext_model": case.maxtext_model, "scan_layers": case.scan, "devices": case.devices,
           "targets": list(case.targets)}
    for mode, extra, mt_extra in (("adapter", [], []), ("merged", ["--merge-lora"], ["load_parameters_path=merge"])):
        ours, theirs = root / f"ckptconv-{mode}", root / f"maxtext-{mode}"
        mine, my_s = run(steps.convert_cmd(base, ours, "--lora", adapter, *extra, *layout), steps.CONVERT_ENV,
                         log=root / f"ckptconv-{mode}.log")
        mt, mt_s = run(steps.maxtext_convert_cmd(case.maxtext_model, base, theirs,
                                                 [*mt_layout, f"hf_lora_adapter_path={adapter}", *mt_extra], flags),
                       env=ctx["mt_env"], log=root / f"maxtext-{mode}.log")
        entry = {"ckptconv_exit": mine.returncode, "maxtext_exit": mt.returncode, "ckptconv_s": round(my_s, 1),
                 "maxtext_s": round(mt_s, 1)}
        if mine.returncode or mt.returncode:
            entry["error"] = (mine.stderr or mt.stderr)[-600:]
        else:
            written = theirs / case.maxtext_model / adapter.name if mode == "adapter" else theirs
            entry |= compare(ctx, ours, written, root, mode)
        row[mode] = entry
    if not case.scan and all(row[m].get("identical") is not None for m in ("adapter", "merged")):
        # which adapter agrees with MaxText's merged kernel: W + (alpha/r) A B (bench/lora_consistency.py)
        plain = root / "plain"
        steps.convert(base, plain, root / "plain.log", *layout)
        check, _ = run([sys.executable, str(BENCH / "lora_consistency.py"), str(plain), str(root / "maxtext-merged"),
                        str(16 / 4), str(root / "ckptconv-adapter"),
                        str(root / "maxtext-adapter" / case.maxtext_model / "adapter")], log=root / "consistency.log")
        found = [json.loads(line) for line in check.stdout.splitlines() if line.startswith("{")]
        row["merged_consistency"] = {label: max(result[next(k for k in result if k.startswith("max"))].values())
                                     for label, result in zip(("ckptconv", "maxtext"), found)}
    if case.name == "qwen3":  # which of these MaxText's own LoRA restore (lora.lora_restore_path) reads
        restore = root / "ckptconv-restore-layout"
        steps.convert(base, restore, root / "ckptconv-restore-layout.log", "--lora", adapter, "--lora-layout", "restore",
                      *layout)
        row["maxtext_restore"] = {}
        for label, items in (("ckptconv --lora", root / "ckptconv-adapter"),
                             ("ckptconv --lora --lora-layout restore", restore),
                             ("MaxText to_maxtext adapter mode",
                              root / "maxtext-adapter" / case.maxtext_model / "adapter")):
            probe, _ = run([ctx["mt_python"], str(BENCH / "maxtext_lora_restore.py"), str(items / "0" / "items")],
                           env=ctx["mt_env"], log=root / f"restore-{label.split()[0]}.log")
            lines = probe.stdout.strip().splitlines()
            row["maxtext_restore"][label] = json.loads(lines[-1]) if lines else {"error": probe.stderr[-300:]}
    return row


def _family_case(case: Case):
    from bench.compare_families import Case as FamilyCase

    return FamilyCase(case.name, case.model, case.maxtext_model, scan=case.scan, devices=case.devices)


# --- timing at a real width ------------------------------------------------------------------------

QWEN3_06B = synth.SynthModel(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
                             num_kv_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True)


def timing(ctx: dict) -> dict:
    root = WORK / "timing"
    base, adapter = root / "qwen3-0.6b", root / "adapter-r16"
    if not (base / "config.json").exists():
        shutil.rmtree(base, ignore_errors=True)
        synth.write_checkpoint(QWEN3_06B, str(base))
    if not (adapter / "adapter_config.json").exists():
        shutil.rmtree(adapter, ignore_errors=True)
        write_peft_adapter(QWEN3_06B, adapter, rank=16, alpha=32)  # tests/lora_adapters.py
    layout = ["--devices", "16", "--scan-layers"]
    flags = ["--lazy_load_tensors=true", "--simulated_cpu_devices_count=16", "--save_dtype=bfloat16"]
    rows = []
    for label, ours, theirs in (
        ("adapter alone", ["--lora", str(adapter)], [f"hf_lora_adapter_path={adapter}"]),
        ("merged into the base", ["--lora", str(adapter), "--merge-lora"],
         [f"hf_lora_adapter_path={adapter}", "load_parameters_path=merge"]),
        ("base alone (reference)", [], []),
    ):
        key = label.split()[0]
        out_ours, out_theirs = root / f"ckptconv-{key}", root / f"maxtext-{key}"
        for out in (out_ours, out_theirs):
            shutil.rmtree(out, ignore_errors=True)
        mine, my_s = run(steps.convert_cmd(base, out_ours, *ours, *layout), steps.CONVERT_ENV,
                         log=root / f"ckptconv-{key}.log")
        report = json.loads((out_ours / "ckptconv-report.json").read_text()) if mine.returncode == 0 else {}
        mt, mt_s = run(steps.maxtext_convert_cmd("qwen3-0.6b", base, out_theirs, ["scan_layers=true", *theirs], flags),
                       env=ctx["mt_env"], log=root / f"maxtext-{key}.log")
        peak = next((line.split("Peak Memory:")[1].strip() for line in (mt.stdout + mt.stderr).splitlines()
                     if "Peak Memory:" in line), "-")
        same = "-"
        if mine.returncode == 0 and mt.returncode == 0:  # at real widths, bit for bit too
            written = out_theirs / "qwen3-0.6b" / adapter.name if key == "adapter" else out_theirs
            same = "identical" if compare(ctx, out_ours, written, root, key)["identical"] else "DIFFERENT"
        rows.append({"what": label, "identical_to_maxtext": same, "ckptconv_exit": mine.returncode,
                     "ckptconv_s": round(my_s, 1),
                     "ckptconv_wall_s": report.get("wall_seconds"),
                     "ckptconv_peak_gib": round(report["peak_rss_bytes"] / 2**30, 2) if report else None,
                     "output_mib": round(report.get("output_bytes", 0) / 2**20, 1),
                     "maxtext_exit": mt.returncode, "maxtext_s": round(mt_s, 1), "maxtext_peak": peak})
        print(rows[-1], flush=True)
    return {"model": "qwen3-0.6b widths (28 layers, hidden 1024, MLP 3072, 16/8 heads of 128)",
            "adapter": "rank 16, alpha 32, q/k/v/o/gate/up/down, float32 (as PEFT saves it)", "rows": rows}


def write(rows: list[dict], timings: dict | None, ctx: dict, path: Path) -> None:
    lines = ["# LoRA adapters: ckptconv against MaxText 0.2.5", "",
             f"Generated by `python -m bench lora` on {dt.date.today()} (MaxText {ctx['mt_versions']['maxtext']}, "
             f"numpy {ctx['mt_versions']['numpy']} in MaxText's venv). Adapters made and saved by PEFT on random bf16 "
             "synthetic bases; bfloat16 output. \"identical\": every leaf present in both, same shape, dtype and "
             "bits (`bench/compare_outputs.py`).", "",
             "| case | MaxText model_name | scan | devices | targets | adapter mode | merged mode |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = []
        for mode in ("adapter", "merged"):
            entry = row[mode]
            if "error" in entry:
                cells.append(f"exit {entry['ckptconv_exit']}/{entry['maxtext_exit']}: {entry['error'][-120:]!r}")
            else:
                verdict = "identical" if entry["identical"] else "differs in " + ", ".join(
                    f"`{m['leaf'].removeprefix('params/params/decoder/')}`" for m in entry["value_mismatches"])
                cells.append(f"{verdict}, {entry['leaves']} leaves")
        lines.append(f"| {row['case']} | {row['maxtext_model']} | {row['scan_layers']} | {row['devices']} | "
                     f"{','.join(t.removesuffix('_proj') for t in row['targets'])} | {cells[0]} | {cells[1]} |")
    consistent = [row for row in rows if "merged_consistency" in row]
    if consistent:
        lines += ["", "## Which adapter agrees with MaxText's merged kernels?", "",
                  "MaxText's model adds `x @ kernel_lora_a @ kernel_lora_b * alpha/r` to `x @ kernel` at run time "
                  "(qwix), so an adapter is right for it when `W + alpha/r A B` is the kernel MaxText's merged mode "
                  "writes. `bench/lora_consistency.py`: the largest difference over every LoRA'd kernel, in units of "
                  "the largest `|alpha/r A B|` (about 0.01 is bfloat16 rounding; a missing factor shows as ~0.7). "
                  "Where the family pre-scales its query kernel (Mixtral, Mistral, Gemma 2), MaxText's adapter mode "
                  "leaves `lora_B` unscaled, ckptconv scales it as the kernel: the adapter leaves differ "
                  "(the table above), and ckptconv's are the ones that agree.", "",
                  "| case | ckptconv adapter | MaxText adapter |", "|---|---|---|"]
        for row in consistent:
            lines.append(f"| {row['case']} | {row['merged_consistency']['ckptconv']} | "
                         f"{row['merged_consistency']['maxtext']} |")
    restores = next((row["maxtext_restore"] for row in rows if "maxtext_restore" in row), None)
    if restores:
        lines += ["", "## Does MaxText's own LoRA restore read it?", "",
                  "`bench/maxtext_lora_restore.py`: MaxText 0.2.5's `lora_utils.restore_lora_from_path` (what "
                  "`train_sft.py` calls for `lora.lora_restore_path=.../0/items`) on a stand-in model whose LoRA "
                  "parameters sit at MaxText's paths with the checkpoint's shapes; qwen3 case.", "",
                  "| checkpoint | restored | rank / alpha synced from metadata | MaxText says |", "|---|---|---|---|"]
        for label, result in restores.items():
            synced = f"{result.get('rank')} / {result.get('alpha')}" if result.get("restored") else "-"
            lines.append(f"| {label} | {result.get('restored')} | {synced} | {result.get('error', '')} |")
    if timings:
        lines += ["", "## Conversion time", "", f"Base: {timings['model']}; adapter: {timings['adapter']}; "
                  "16 simulated devices, scanned, bfloat16. Seconds are the whole process (start-up included); "
                  "ckptconv's own wall and peak RSS from its report, MaxText's peak from its log. "
                  "2-core machine shared with other jobs: take the seconds as rough.", "",
                  "| what | ckptconv s (process) | ckptconv wall s | ckptconv peak GiB | output MiB | MaxText s | "
                  "MaxText peak | leaf by leaf |", "|---|---|---|---|---|---|---|---|"]
        for r in timings["rows"]:
            lines.append(f"| {r['what']} | {r['ckptconv_s']} | {r['ckptconv_wall_s']} | {r['ckptconv_peak_gib']} | "
                         f"{r['output_mib']} | {r['maxtext_s']} (exit {r['maxtext_exit']}) | {r['maxtext_peak']} | "
                         f"{r.get('identical_to_maxtext', '-')} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--no-timing", action="store_true", help="keep the last run's timing (results.json)")
    args = parser.parse_args(argv)
    ctx = setup_maxtext()
    chosen = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    last = json.loads((WORK / "results.json").read_text()) if (WORK / "results.json").exists() else {}
    kept = {row["case"]: row for row in last.get("rows", [])}  # cases not rerun keep their last result
    for case in chosen:
        kept[case.name] = run_case(case, ctx)
        print(json.dumps(kept[case.name]), flush=True)
    rows = [kept[c.name] for c in CASES if c.name in kept]
    timings = last.get("timing") if args.no_timing else timing(ctx)
    (WORK / "results.json").write_text(json.dumps({"rows": rows, "timing": timings}, indent=2))
    write(rows, timings, ctx, DOCS / "LORA.md")
    return 0 if all(row[m].get("identical") for row in rows for m in ("adapter", "merged")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
