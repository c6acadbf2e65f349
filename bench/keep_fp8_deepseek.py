"""DeepSeek-V3 and Kimi-K2 FP8 releases kept FP8 (``--dtype float8_e4m3fn``), run by MaxText 0.2.5 itself.

    .venv/bin/python -m bench keep-fp8-deepseek [--only deepseek3-scan,...]

MaxText 0.2.5's converter cannot write such a checkpoint (its DeepSeek mapping names no ``weight_scale_inv``;
docs/bench/KEEP-FP8.md), so there is nothing to be bit-identical to: the proof is MaxText's own forward pass. Per case:

1. a tiny FP8 release made by ckptconv's synth in the hub's layout (e4m3 linear layers, float32 128x128
   ``weight_scale_inv``), at widths where the blocks do not tile MaxText's kernels: 4 heads of 128 nope + 64 RoPE
   rows (``q_b_proj``'s blocks straddle heads), kv_lora 512 + 64 (``kv_a_proj_with_mqa``: 4.5 blocks), q_lora 192
   and MLPs of 320 and 192 rows (partial blocks); RoPE and routing as MaxText's own ``deepseek3-671b`` /
   ``kimi-k2-1t`` configs have them;
2. transformers' float32 logits of the release's values (each e4m3 weight times its block's scale, in float32:
   ``tests/hub_checkpoints.dequantised_release``);
3. ``ckptconv convert --dtype float8_e4m3fn`` (scanned on 16 devices, unscanned on 1) and ``--dtype bfloat16``
   (bytes, for comparison);
4. in MaxText's venv, a fresh process: ``checkpointing.load_params_from_path`` (the training loader, which
   restores a ``kernel_scale`` / ``wi_0_scale`` beside its kernel and dequantises at restore) into the model's
   params, then one forward pass: logits against transformers' (float32, max abs <= 1e-4);
5. likewise ``model_creation_utils.from_pretrained`` (the inference loader), which reads no scale leaf.

Writes docs/bench/KEEP-FP8-DEEPSEEK.md; work files in bench/work/keep-fp8-deepseek/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path as a step in MaxText's venv: bench, tests
from bench import forward, steps  # noqa: E402
from bench.maxtext_loaders import FAMILIES as LOADERS_FAMILIES  # noqa: E402
from bench.measure import plan_of  # noqa: E402
from bench.steps import BENCH, DOCS, MT_PYTHON, REPO  # noqa: E402

WORK = BENCH / "work" / "keep-fp8-deepseek"
TOLERANCE = 1e-4
TOKENS = [3, 17, 101, 42, 7, 200, 9, 64]
GIB = 1024**3

# MaxText's model configs (deepseek3-671b.yml, kimi-k2-1t.yml): RoPE as transformers 5 writes it, routing; as the
# loaders benchmark has them
FAMILIES = {family: LOADERS_FAMILIES[family] for family in ("deepseek3", "kimi-k2")}
WIDTHS = {"hidden_size": 256, "num_layers": 3, "num_heads": 4, "head_dim": 128, "intermediate_size": 320,
          "moe_intermediate_size": 192, "num_experts": 8, "vocab_size": 300, "quantization": "fp8"}
MLA = {"q_lora_rank": 192, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
CASES = [(f, scan) for f in FAMILIES for scan in (True, False)]


def case_name(family: str, scan: bool) -> str:
    return f"{family}-{'scan' if scan else 'noscan'}"


# --- in MaxText's venv -----------------------------------------------------------------------

def maxtext_config(family: str, config: dict, scan: bool, work: str, ckpt: str = ""):
    sizes = {"base_emb_dim": config["hidden_size"], "base_num_query_heads": config["num_attention_heads"],
             "base_num_kv_heads": config["num_key_value_heads"], "base_mlp_dim": config["intermediate_size"],
             "base_moe_mlp_dim": config["moe_intermediate_size"], "base_num_decoder_layers": config["num_hidden_layers"],
             "first_num_dense_layers": config["first_k_dense_replace"], "vocab_size": config["vocab_size"],
             "num_experts": config["n_routed_experts"], "num_experts_per_tok": config["num_experts_per_tok"],
             "shared_experts": config["n_shared_experts"], "q_lora_rank": config["q_lora_rank"],
             "kv_lora_rank": config["kv_lora_rank"], "qk_nope_head_dim": config["qk_nope_head_dim"],
             "qk_rope_head_dim": config["qk_rope_head_dim"], "v_head_dim": config["v_head_dim"]}
    return forward.config(forward.settings(FAMILIES[family]["maxtext_model"], work, "keepfp8", len(TOKENS), scan, ckpt,
                                           **forward.EXACT_MOE, **sizes), "keepfp8")


def _logits(model, hf_dir: str) -> dict:
    import numpy as np

    return forward.against(forward.logits(model, TOKENS), np.load(Path(hf_dir) / "hf_logits.npy"), TOLERANCE)


def run_load_params(family: str, ckpt: str, scan: bool, hf_dir: str, work: str) -> dict:
    """MaxText's training loader into a freshly built model's params, then one forward pass."""
    import jax
    import numpy as np
    from flax import nnx
    from maxtext.common import checkpointing
    from maxtext.layers import moe
    from maxtext.utils import model_creation_utils

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    mt_config = maxtext_config(family, config, scan, work)  # no load_parameters_path: random weights
    model, _ = model_creation_utils.from_pretrained(mt_config)
    state = nnx.state(model, (nnx.Param, moe.MoEBiasVar))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    loaded = checkpointing.load_params_from_path(ckpt, abstract, mt_config.checkpoint_storage_concurrent_gb)
    nnx.update(model, loaded)
    leaves = jax.tree_util.tree_leaves(loaded.to_pure_dict() if hasattr(loaded, "to_pure_dict") else loaded)
    dtypes = sorted({str(np.asarray(v).dtype) for v in leaves})
    return {**_logits(model, hf_dir), "params_loaded": len(leaves), "loaded_dtypes": dtypes}


def run_from_pretrained(family: str, ckpt: str, scan: bool, hf_dir: str, work: str) -> dict:
    """MaxText's inference loader on the same checkpoint, then one forward pass."""
    from maxtext.utils import model_creation_utils

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    model, _ = model_creation_utils.from_pretrained(maxtext_config(family, config, scan, work, ckpt))
    return _logits(model, hf_dir)


# --- the driver (the project's venv) ---------------------------------------------------------

def make_release(family: str, root: Path) -> tuple[Path, Path]:
    """The synthetic FP8 release and its float32 dequantised twin with transformers' logits."""
    import numpy as np

    sys.path.insert(0, str(REPO))
    from ckptconv.commands import synth
    from tests import hub_checkpoints
    from tests.test_logits import hf_logits

    f = FAMILIES[family]
    overrides = {**MLA, "rope_parameters": dict(f["rope"]), "rope_theta": f["rope"]["rope_theta"],
                 "max_position_embeddings": f["max_position_embeddings"],
                 "routed_scaling_factor": f["routed_scaling_factor"]}
    model = synth.SynthModel(model_type=f["model_type"], **WIDTHS, config_overrides=overrides)
    hf, reference = root / "hf", root / "dequantised"
    synth.write_checkpoint(model, str(hf), max_shard_bytes=1 << 22)
    hub_checkpoints.dequantised_release(hf, reference)
    np.save(reference / "hf_logits.npy", hf_logits(reference, np.array(TOKENS)))
    return hf, reference


def convert(src: Path, dst: Path, scan: bool, devices: int, dtype: str) -> dict:
    result = steps.convert(src, dst, dst.with_name(dst.name + ".log"), *steps.layout(scan, devices, dtype))
    if result.returncode:
        return {"error": result.stderr.strip().splitlines()[-1:]}
    report = json.loads((dst / "ckptconv-report.json").read_text())
    return {k: report.get(k) for k in ("output_bytes", "source_bytes", "peak_rss_bytes", "predicted_peak_rss_bytes")}


def scale_leaves(items: Path) -> dict:
    """The scale leaves written and their bytes, from Orbax's metadata (MaxText's venv)."""
    code = ("import json, sys, orbax.checkpoint as ocp, jax\n"
            "m = ocp.PyTreeCheckpointer().metadata(sys.argv[1])\n"
            "m = getattr(getattr(m, 'item_metadata', m), 'tree', m)\n"
            "flat = jax.tree_util.tree_flatten_with_path(m)[0]\n"
            "print(json.dumps({'/'.join(str(getattr(k, 'key', k)) for k in p): [str(v.dtype), list(v.shape)] "
            "for p, v in flat}))")
    out = subprocess.run([str(MT_PYTHON), "-c", code, str(items)], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
    leaves = json.loads(out.stdout.strip().splitlines()[-1])
    scales = {n: v for n, v in leaves.items() if n.endswith("_scale")}
    e4m3 = {n: v for n, v in leaves.items() if v[0] == "float8_e4m3fn"}
    return {"leaves": len(leaves), "e4m3_leaves": len(e4m3), "scale_leaves": len(scales),
            "wq_b_scale": next((v for n, v in scales.items() if n.endswith("wq_b/kernel_scale")), None),
            "wkv_a_scale": next((v for n, v in scales.items() if n.endswith("wkv_a/kernel_scale")), None)}


def plan_full_releases() -> dict:
    """The full DeepSeek-V3 and Kimi-K2 FP8 releases planned from their published config.json (header-only files),
    with both dtypes: output bytes and predicted peak."""
    sys.path.insert(0, str(REPO))
    from ckptconv.commands import synth
    from tests.published_configs import DEEPSEEK_V3, KIMI_K2

    plans = {}
    for name, config in (("DeepSeek-V3", DEEPSEEK_V3), ("Kimi-K2-Instruct", KIMI_K2)):
        src = WORK / f"{name}-headers"
        shutil.rmtree(src, ignore_errors=True)
        model = synth.SynthModel(model_type=config["model_type"], config_overrides=dict(config), quantization="fp8")
        synth.write_checkpoint(model, str(src), max_shard_bytes=5 * 10**9, header_only=True)
        (src / "config.json").write_text(json.dumps(config))
        plans[name] = [{k: p[k] for k in ("source_bytes", "output_bytes", "predicted_peak_rss_bytes")} | {"dtype": d}
                       for d in ("bfloat16", "float8_e4m3fn") for p in (plan_of(src, 16, d),)]
        print(json.dumps({name: plans[name]}), flush=True)
        shutil.rmtree(src, ignore_errors=True)
    return plans


def run_case(family: str, scan: bool) -> dict:
    from bench.steps import error_line, last_json, run

    name = case_name(family, scan)
    root = WORK / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf, reference = make_release(family, root)
    devices = 16 if scan else 1
    row = {"case": name, "family": family, "scan": scan, "devices": devices,
           "kept": convert(hf, root / "kept", scan, devices, "float8_e4m3fn"),
           "bfloat16": convert(hf, root / "bf16", scan, devices, "bfloat16")}
    if "error" in row["kept"]:
        return row
    items = root / "kept" / "0" / "items"
    row["written"] = scale_leaves(items)
    env = steps.MT_ENV
    for step in ("load-params", "from-pretrained"):
        args = [MT_PYTHON, __file__, step, family, items, str(scan), reference, root / f"mt-{step}"]
        result = run(args, root / f"{step}.log", env=env)
        row[step] = last_json(result) if result.returncode == 0 else {"ok": False, "exit": result.returncode,
                                                                       "error": error_line(result)}
    return row


def cell(result: dict) -> str:
    if "error" in result:
        return f"**fails**: `{str(result['error']).replace('|', '/')[:160]}`"
    verdict = "**ok**" if result["ok"] else "DIFFERENT"
    return f"{verdict}, max abs {result['max_abs_logits_diff']:.1e} (logits up to {result['max_abs_logit']:.2f})"


def write(rows: list[dict], plans: dict, path: Path) -> None:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# DeepSeek-V3 / Kimi-K2 FP8 releases kept FP8, run by MaxText 0.2.5", "",
        f"Written by `python -m bench keep-fp8-deepseek` on {now}. Tiny synthetic FP8 releases in the hub's layout (e4m3 "
        "linear layers, float32 128x128 `weight_scale_inv`), at widths whose blocks do not tile MaxText's kernels "
        "(4 heads of 128 + 64 RoPE rows: `q_b_proj`'s blocks straddle heads; kv_lora 512 + 64: `kv_a_proj_with_mqa` "
        "holds 4.5 blocks; q_lora 192, MLPs of 320 and 192 rows), RoPE and routing as MaxText's own "
        "`deepseek3-671b` / `kimi-k2-1t`. `ckptconv convert --dtype float8_e4m3fn`, then in MaxText's venv "
        "`checkpointing.load_params_from_path` into the model's params and one forward pass (float32), against "
        "transformers' float32 logits of the release's values (each e4m3 weight times its block's scale). "
        f"Tolerance {TOLERANCE:g}.", "",
        "| case | devices | leaves (e4m3 / scales) | `wq_b` / `wkv_a` scale | kept bytes | bfloat16 bytes "
        "| peak RSS / predicted | `load_params_from_path` + forward | `from_pretrained` + forward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k, b, w = r["kept"], r["bfloat16"], r.get("written", {})
        if "error" in k:
            lines.append(f"| {r['case']} | {r['devices']} | convert fails: `{k['error']}` | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['devices']} | {w.get('leaves')} ({w.get('e4m3_leaves')} / {w.get('scale_leaves')}) "
            f"| {w.get('wq_b_scale')} / {w.get('wkv_a_scale')} | {k['output_bytes']:,} | {b.get('output_bytes', 0):,} "
            f"| {k['peak_rss_bytes'] / GIB:.2f} / {k['predicted_peak_rss_bytes'] / GIB:.2f} GiB "
            f"| {cell(r['load-params'])} | {cell(r['from-pretrained'])} |")
    if plans:
        lines += ["", "| full release, published config.json, header-only files | --dtype | source | output "
                      "| output - source | predicted peak RSS (16 devices) |", "|---|---|---|---|---|---|"]
        for name, runs in plans.items():
            for p in runs:
                extra = (p["output_bytes"] - p["source_bytes"]) / 2**20
                lines.append(f"| {name} | {p['dtype']} | {p['source_bytes'] / GIB:.1f} GiB "
                             f"| {p['output_bytes'] / GIB:.1f} GiB | {extra:+,.1f} MiB "
                             f"| {p['predicted_peak_rss_bytes'] / GIB:.2f} GiB |")
        lines += ["", "Kept, the output is the source's bytes plus the regrouped `wq_b` and `wkv_a` scales' extra "
                      "entries (these header-only sources hold no multi-token-prediction layer; a release's is "
                      "reported, not converted)."]
    lines += ["", "`from_pretrained` (`utils/model_creation_utils.py` L841-1227) builds its restore target from the "
              "model's own parameters, which for DeepSeek hold no scale leaf (`layers/attention_mla.py` builds "
              "`wq_a`...`wkv_b` without `block_size`), and never calls `_augment_want_with_scales` / "
              "`maybe_dequantize_restored_params`: it restores the e4m3 kernels cast to the model's dtype without "
              "their scales, so its logits are not the model's. A kept DeepSeek checkpoint is read by "
              "`checkpointing.load_params_from_path` (`common/checkpointing.py` L933-1108), the `load_parameters_path` "
              "route of training (`load_state_if_possible`, L779) and of `maxtext_utils.setup_decode_state` (L1654).",
              ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("load-params", "from-pretrained"):
        family, ckpt, scan, hf_dir, work = argv[1], argv[2], argv[3] == "True", argv[4], argv[5]
        fn = run_load_params if argv[0] == "load-params" else run_from_pretrained
        print(json.dumps(fn(family, ckpt, scan, hf_dir, work)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--out", default=str(DOCS / "KEEP-FP8-DEEPSEEK.md"))
    parser.add_argument("--skip-plans", action="store_true", help="do not plan the full releases")
    args = parser.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else None
    rows = []
    for family, scan in CASES:
        if wanted and case_name(family, scan) not in wanted:
            continue
        row = run_case(family, scan)
        print(json.dumps(row), flush=True)
        rows.append(row)
    write(rows, {} if args.skip_plans else plan_full_releases(), Path(args.out))
    return 0 if all(r.get("load-params", {}).get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
