"""``ckptconv export`` against MaxText 0.2.5's own ``to_huggingface``, and the 8B export figure.

    .venv/bin/python -m bench export [--shapes 0.6b,8b] [--keep-inputs]

What one run does (under the git-ignored bench/work/):
1. 0.6B (``qwen3-0.6b`` widths, random bf16): ckptconv converts it to MaxText once (scanned,
   1 device); then ``ckptconv export`` and MaxText's ``to_huggingface`` each turn that one MaxText
   checkpoint back into HF safetensors, each a fresh child measured as ``python -m bench speed``
   measures (wall from outside, the kernel's peak RSS via wait4). Both outputs are then compared
   tensor by tensor: names, shapes, and values (as float32, bit for bit), and ours also against the
   original HF source (the round trip).
2. 8B (Llama-3-8B widths): ckptconv converts it, then ``ckptconv export`` is measured, and the
   export is compared with the source byte for byte (names, dtypes, shapes, data).
Writes docs/bench/EXPORT.md and bench/work/export/results.json.

MaxText's ``to_huggingface`` loads the tokenizer from ``--hf_model_path`` even though weights do
not need one; it gets a one-word tokenizer written here (tokenizer.json), nothing of the hub.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

from bench.measure import GIB, Run, code_state, ensure_input, machine_facts, measure
from bench import steps
from bench.steps import DOCS, WORK, setup_maxtext

OUT = WORK / "export"
MODEL_NAMES = {"0.6b": "qwen3-0.6b", "8b": "llama3.1-8b"}
DTYPES = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16}


def tokenizer_dir() -> Path:
    """A one-word WordLevel tokenizer: what MaxText's to_huggingface insists on loading."""
    where = OUT / "tokenizer"
    where.mkdir(parents=True, exist_ok=True)
    (where / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1}, "unk_token": "<unk>"}}))
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "unk_token": "<unk>"}))
    return where


def read_tensors(directory: Path) -> dict[str, tuple[str, tuple, Path, int, int]]:
    """name -> (dtype, shape, file, start, end) of every tensor in a directory of safetensors files."""
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                found[name] = (info["dtype"], tuple(info["shape"]), file, 8 + length + start, 8 + length + end)
    return found


def as_float32(entry) -> np.ndarray:
    dtype, shape, file, start, end = entry
    with open(file, "rb") as f:
        f.seek(start)
        raw = np.frombuffer(f.read(end - start), dtype=DTYPES[dtype]).reshape(shape)
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def compare(ours: Path, theirs: Path, *, same_dtype: bool) -> dict:
    """Tensor by tensor: names, shapes, dtypes, values (float32, bit for bit)."""
    a, b = read_tensors(ours), read_tensors(theirs)
    only_ours, only_theirs = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    dtype_differs, shape_differs, value_differs, within_step, equal = [], [], [], [], 0
    for name in sorted(a.keys() & b.keys()):
        if a[name][0] != b[name][0]:
            dtype_differs.append(f"{name}: {a[name][0]} vs {b[name][0]}")
        if a[name][1] != b[name][1]:
            shape_differs.append(f"{name}: {a[name][1]} vs {b[name][1]}")
            continue
        x, y = as_float32(a[name]), as_float32(b[name])
        if x.view(np.uint32).tobytes() == y.view(np.uint32).tobytes():
            equal += 1
        elif (np.abs(x - y) <= np.abs(y) * 2.0**-7).all():
            within_step.append(name)
        else:
            value_differs.append(f"{name}: max |diff| {float(np.max(np.abs(x - y))):.3g}")
    return {"tensors": len(a), "other_tensors": len(b), "equal": equal, "only_ours": only_ours,
            "only_theirs": only_theirs, "dtype_differs": dtype_differs if same_dtype else len(dtype_differs),
            "shape_differs": shape_differs, "value_differs": value_differs,
            "within_one_bf16_step": sorted({re.sub(r"\.\d+\.", ".N.", n) for n in within_step}),
            "within_one_bf16_step_count": len(within_step),
            "identical": not (only_ours or only_theirs or shape_differs or value_differs or within_step
                              or (same_dtype and dtype_differs))}


def convert_to_maxtext(src: Path, dst: Path) -> None:
    if (dst / "ckptconv-report.json").exists():
        return
    done = steps.convert(src, dst, dst.with_name(dst.name + ".log"), "--devices", "1")
    if done.returncode:
        raise SystemExit(f"ckptconv convert {src}: {steps.error_line(done)}")


def export_cmd(maxtext_dir: Path, like: Path, dst: Path) -> list[str]:
    return [sys.executable, "-m", "ckptconv", "export", str(maxtext_dir / "0" / "items"), str(dst), "--like", str(like),
            "--progress", "none"]


def maxtext_export_cmd(ctx: dict, shape: str, maxtext_dir: Path, dst: Path, tokenizer: Path) -> list[str]:
    return [ctx["mt_python"], "-m", "maxtext.checkpoint_conversion.to_huggingface", ctx["base_yml"],
            f"model_name={MODEL_NAMES[shape]}", f"load_parameters_path={maxtext_dir / '0' / 'items'}",
            f"base_output_directory={dst}", "hardware=cpu", "skip_jax_distributed_system=True", "scan_layers=true",
            f"run_name=export-{shape}", f"--hf_model_path={tokenizer}"]


def run_pair(shape: str, ctx: dict | None, results: dict) -> None:
    src = ensure_input(shape, None)
    maxtext_dir = OUT / f"maxtext-{shape}"
    convert_to_maxtext(src, maxtext_dir)
    ours = OUT / f"ckptconv-{shape}"
    shutil.rmtree(ours, ignore_errors=True)
    run, _ = measure(Run(f"{shape}-export-ckptconv", "ckptconv", shape, 0, export_cmd(maxtext_dir, src, ours),
                         code=code_state()), {**__import__("os").environ}, timeout=3600)
    entry = {"ckptconv": _figures(run), "round_trip": compare(ours, src, same_dtype=True)}
    if ctx is not None:
        theirs = OUT / f"maxtext-out-{shape}"
        shutil.rmtree(theirs, ignore_errors=True)
        mt, _ = measure(Run(f"{shape}-export-maxtext", "maxtext", shape, 0,
                            maxtext_export_cmd(ctx, shape, maxtext_dir, theirs, tokenizer_dir())),
                        ctx["mt_env"], timeout=3600)
        entry["maxtext"] = _figures(mt)
        if mt.ok:
            entry["ours_vs_maxtext"] = compare(ours, theirs, same_dtype=False)
            entry["maxtext_dtypes"] = sorted({t[0] for t in read_tensors(theirs).values()})
        shutil.rmtree(theirs, ignore_errors=True)
    results[shape] = entry
    shutil.rmtree(ours, ignore_errors=True)
    print(json.dumps(entry, indent=1)[:3000], flush=True)


def _figures(run: Run) -> dict:
    """Peak RSS is the child's own VmHWM: wait4's ru_maxrss would include this harness at fork, which
    grows as it compares outputs (tasks/child.py explains the kernel's side)."""
    return {"ok": run.ok, "wall_seconds": run.wall_seconds, "peak_rss_gib": round(run.own_peak_bytes / GIB, 3),
            "ru_maxrss_gib": round(run.peak_rss_bytes / GIB, 3),
            "cpu_seconds": run.cpu_seconds, "log": run.log, "last_lines": run.last_lines[-5:] if not run.ok else []}


def write(results: dict) -> None:
    lines = ["# `ckptconv export` against MaxText's `to_huggingface`", "",
             "Generated by `python -m bench export`. Every run a fresh process; wall from outside, peak RSS",
             "the child's own high-water mark (VmHWM, read every 50 ms while it runs).", "", "Machine: {nproc} cores ({cpu}), {mem:.0f} GiB, kernel {kernel}".format(
                 mem=results["machine"]["mem_total_bytes"] / GIB, **results["machine"]), f"Code: {results['code']}",
             "", "| shape | tool | wall | peak RSS | CPU | result |", "|---|---|---|---|---|---|"]
    for shape in ("0.6b", "8b"):
        entry = results.get(shape)
        if not entry:
            continue
        for tool in ("ckptconv", "maxtext"):
            if tool in entry:
                f = entry[tool]
                lines.append(f"| {shape} | {tool} | {f['wall_seconds']:.1f} s | {f['peak_rss_gib']:.2f} GiB | "
                             f"{f['cpu_seconds']:.1f} s | {'ok' if f['ok'] else 'FAILED'} |")
    lines.append("")
    for shape, entry in results.items():
        if not isinstance(entry, dict) or "round_trip" not in entry:
            continue
        rt = entry["round_trip"]
        lines.append(f"- {shape} round trip HF -> MaxText -> HF (ckptconv both ways): {rt['equal']}/{rt['tensors']} "
                     "tensors identical in name, dtype, shape and bytes"
                     + (f"; {rt['within_one_bf16_step_count']} within one bfloat16 step ({', '.join(rt['within_one_bf16_step'])}:"
                        " MaxText keeps Llama's queries scaled by 1/sqrt(head_dim), which bfloat16 cannot hold exactly"
                        " when head_dim is not a power of 4)" if rt["within_one_bf16_step_count"] else "")
                     + ("; other differences: " + json.dumps(rt["value_differs"]) if rt["value_differs"] else ""))
        if "ours_vs_maxtext" in entry:
            c = entry["ours_vs_maxtext"]
            lines.append(f"- {shape} ckptconv export vs MaxText `to_huggingface` of the same checkpoint: "
                         f"{c['equal']}/{c['tensors']} tensors equal in name, shape and value (as float32); "
                         f"MaxText writes {', '.join(entry['maxtext_dtypes'])}, ckptconv the source's dtypes "
                         f"({c['dtype_differs']} tensors differ in dtype only); only in ours: {c['only_ours'] or 'none'}; "
                         f"only in MaxText's: {c['only_theirs'] or 'none'}; values differ: {c['value_differs'] or 'none'}")
    (DOCS / "EXPORT.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.6b,8b")
    parser.add_argument("--no-maxtext", action="store_true", help="only ckptconv (no MaxText venv needed)")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    ctx = None if args.no_maxtext else setup_maxtext()
    results = {"machine": machine_facts(), "code": code_state()}
    for shape in args.shapes.split(","):
        run_pair(shape, ctx if shape == "0.6b" else None, results)
        (OUT / "results.json").write_text(json.dumps(results, indent=1))
    write(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
