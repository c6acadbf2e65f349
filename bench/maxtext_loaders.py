"""ckptconv's DeepSeek checkpoints (V3, Kimi-K2, V2, V3.2, V4) in both MaxText 0.2.5 loaders; writes docs/bench/LOADERS.md.

    bash bench/maxtext_env.sh    # once: MaxText 0.2.5's venv (or MAXTEXT_PYTHON=/path/to/its/python)
    .venv/bin/python -m bench loaders [--only deepseek3-scan,...] [--merge]

Per case: a tiny random model made with transformers' own class (``DeepseekV3ForCausalLM``, V2's, V3.2's; weights,
router bias rounded to bfloat16, so the bf16 checkpoint holds them exactly; the bias random, not
transformers' zeros, so it steers routing), its logits in float32, then ``ckptconv convert
--dtype float32``, then, each in a fresh process of MaxText's venv:

- ``model_creation_utils.from_pretrained`` (the loader of MaxText's inference and tunix paths)
  and one forward pass, logits against transformers' (f32, max abs <= 1e-4);
- ``checkpointing.load_params_from_path`` (the training loader) into the model's abstract state,
  every leaf against what the checkpoint holds (restored with Orbax's public API), bit for bit.

The same runs on a checkpoint in the earlier layout (the bias in the ``MoEBiasVar`` collection,
written by ckptconv at ``--legacy-rev``) show what the move fixes. MaxText runs with its own
``deepseek3-671b`` / ``kimi-k2-1t`` configs, sizes overridden (``override_model_config``).

DeepSeek-V4 (``deepseek4-*``): a tiny random release in the hub's layout (``bench/hf_tiny_v4.py --bf16``: the
reference names, checked by loading into transformers' own ``DeepseekV4ForCausalLM``; 5 layers, the first 3 hash
routed with ``tid2eid``), MaxText's ``deepseek4-284b`` with ``attention=dot_product``. MaxText's own forward drifts
from transformers' on V4 (issue 25), so the forward check there is against MaxText itself: ``from_pretrained`` on
ckptconv's checkpoint and one forward pass, logits against MaxText's forward on MaxText's own conversion of the same
files (``to_maxtext --save_dtype=float32`` via ``bench/maxtext_convert_tiny.py``, 16 simulated devices: float32
as ckptconv's, the release's float32 norms, mHC and biases kept), which only
``load_params_from_path`` can load (its router bias and ``tid2eid`` are in their own collections).
Work files go to bench/work/loaders/.
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


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path as a step in MaxText's venv: bench, tests
from bench.compare_deepseek_v4 import v4_overrides  # noqa: E402
from bench.forward import EXACT_MOE, config as mt_config, logits as forward_logits, settings as mt_settings  # noqa: E402,E501
from bench.forward import loaded_leaves as forward_leaves, mismatched as mismatched_leaves, written_leaves  # noqa: E402,E501
from bench import steps  # noqa: E402
from bench.steps import BENCH, DOCS, MT_ENV, MT_PYTHON, REPO, error_line, last_json, run  # noqa: E402

WORK = BENCH / "work" / "loaders"
TOLERANCE = 1e-4
TOKENS = [3, 17, 101, 42, 7, 200, 9, 64]

# The tiny model: one dense layer then two MoE layers; MaxText's MLA sizes as the HF config's.
SIZES = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
         "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "num_nextn_predict_layers": 0}
DEEPSEEK3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
# Per family: MaxText's model, transformers' config class, the RoPE of MaxText's own model config as HF writes it
# (deepseek3-671b.yml, kimi-k2-1t.yml, deepseek2-16b.yml, deepseek3.2-671b.yml), and what the family's HF config
# (``hf``) and MaxText's overrides (``maxtext``) change from SIZES.
FAMILIES = {
    "deepseek3": {"maxtext_model": "deepseek3-671b", "model_type": "deepseek_v3", "routed_scaling_factor": 2.5,
                  "max_position_embeddings": 163840, "rope": DEEPSEEK3_ROPE},
    "kimi-k2": {"maxtext_model": "kimi-k2-1t", "model_type": "kimi_k2", "routed_scaling_factor": 2.827,
                "max_position_embeddings": 131072,
                "rope": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096}},
    # Kimi-K2.5 / K2.6: Kimi-K2's decoder in the multimodal wrapper as the hub ships it (language_model. names,
    # text_config, a vision tower beside); MaxText runs it as its kimi-k2-1t model, as its kimi-k2.5-text script does
    "kimi-k2.5": {"maxtext_model": "kimi-k2-1t", "model_type": "kimi_k2", "routed_scaling_factor": 2.827,
                  "max_position_embeddings": 131072, "wrapper": "kimi_k25",
                  "rope": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096}},
    # DeepSeek-V2-Lite: queries without LoRA, 2 shared experts, softmax top-k routing without a bias (not renormalised)
    "deepseek2": {"maxtext_model": "deepseek2-16b", "model_type": "deepseek_v2", "config": "DeepseekV2Config",
                  "routed_scaling_factor": 1.0, "max_position_embeddings": 163840,
                  "rope": {**DEEPSEEK3_ROPE, "mscale": 0.707, "mscale_all_dim": 0.707},
                  "hf": {"q_lora_rank": None, "n_shared_experts": 2, "topk_method": "greedy", "norm_topk_prob": False}},
    # DeepSeek-V3.2: the lightning indexer choosing 4 of the 8 tokens, so its weights decide the attention mask
    "deepseek3.2": {"maxtext_model": "deepseek3.2-671b", "model_type": "deepseek_v32", "config": "DeepseekV32Config",
                    "routed_scaling_factor": 2.5, "max_position_embeddings": 163840, "rope": DEEPSEEK3_ROPE,
                    "hf": {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 4},
                    "maxtext": {"indexer_n_heads": 4, "indexer_head_dim": 16, "indexer_topk": 4}},
    # DeepSeek-V4-Flash: its own tiny release (bench/hf_tiny_v4.py), checked against MaxText's own forward
    # legacy_rev: the ckptconv commit (integ) writing tid2eid in MaxText's Tid2EidVar collection
    "deepseek4": {"maxtext_model": "deepseek4-284b", "v4": True, "legacy_rev": "5cb9dfa"},
}


def v4_sizes() -> dict:
    from hf_tiny_v4 import SIZES as V4  # bench/, the script's directory

    return V4


def sizes(family: str) -> dict:
    """The HF config's sizes for ``family``."""
    return {**SIZES, **FAMILIES[family].get("hf", {})}


@dataclass(frozen=True)
class Case:
    family: str
    scan: bool
    layout: str = "current"  # current: this tree's ckptconv; legacy: ckptconv at --legacy-rev

    @property
    def name(self) -> str:
        return f"{self.family}-{'scan' if self.scan else 'noscan'}" + ("-legacy" if self.layout == "legacy" else "")


CASES = [Case(f, s) for f in FAMILIES for s in (True, False)] + [Case(f, s, "legacy") for f in ("deepseek3", "deepseek4")
                                                                   for s in (True, False)]
# the deepseek4 rows' reference: MaxText's forward on its own conversion, not transformers' logits
REFERENCE_NPY = "reference_logits.npy"


# --- in MaxText's venv -----------------------------------------------------------------------

def make_hf(family: str, out: str) -> None:
    """A random tiny model from transformers' own class; its logits on TOKENS in float32."""
    import numpy as np
    import torch
    import transformers

    f = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f.get("config", "DeepseekV3Config"))(
        **sizes(family), routed_scaling_factor=f["routed_scaling_factor"],
        max_position_embeddings=f["max_position_embeddings"], rope_parameters=dict(f["rope"]), initializer_range=0.05)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape) * 0.2)
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(torch.bfloat16).to(torch.float32))
        tokens = torch.tensor([TOKENS])
        logits = model(tokens).logits[0].numpy()
        biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        saved = [b.clone() for b in biases]
        for b in biases:
            b.zero_()
        without_bias = model(tokens).logits[0].numpy()
        for b, s in zip(biases, saved):
            b.copy_(s)
        # DeepSeek-V3.2: the same model with every token chosen (dense attention), to show the indexer's choice matters
        indexers = [m for m in model.modules() if hasattr(m, "index_topk")]
        for m in indexers:
            m.index_topk, m.chosen = 10**6, m.index_topk
        dense = model(tokens).logits[0].numpy()
        for m in indexers:
            m.index_topk = m.chosen
    model.to(torch.bfloat16).save_pretrained(out)
    if f["model_type"] == "kimi_k2":  # Kimi-K2 ships DeepSeek-V3's architecture under its own model_type
        path = Path(out) / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": f["model_type"]}, indent=2))
    if f.get("wrapper") == "kimi_k25":
        wrap_kimi_k25(Path(out))
    np.save(Path(out) / "hf_logits.npy", logits)
    print(json.dumps({"bias_effect_on_logits": float(np.abs(logits - without_bias).max()),
                      **({"indexer_effect_on_logits": float(np.abs(logits - dense).max())} if indexers else {})}))


def wrap_kimi_k25(out: Path) -> None:
    """The saved decoder as Kimi-K2.5's release lays it out: every tensor under ``language_model.``, a vision
    tower tensor beside, the decoder's config.json in ``text_config`` of KimiK25ForConditionalGeneration's."""
    import torch
    from safetensors.torch import load_file, save_file

    (file,) = out.glob("*.safetensors")
    tensors = {"language_model." + name: value for name, value in load_file(str(file)).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros((32, 3, 14, 14), dtype=torch.bfloat16)
    save_file(tensors, str(file), metadata={"format": "pt"})
    text = json.loads((out / "config.json").read_text())
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
               "vision_config": {"hidden_size": 32, "num_hidden_layers": 1}, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(wrapper, indent=2))


def maxtext_config(family: str, ckpt: str, scan: bool, work: str):
    model = FAMILIES[family]["maxtext_model"]
    if FAMILIES[family].get("v4"):  # its overrides give the attention (dot_product) with the sizes
        return mt_config(mt_settings(model, work, "loaders", len(TOKENS), scan, ckpt, **EXACT_MOE,
                                     **v4_overrides(v4_sizes(), scan)), "loaders")
    s = sizes(family)
    return mt_config(mt_settings(
        model, work, "loaders", len(TOKENS), scan, ckpt, **EXACT_MOE,
        base_emb_dim=s["hidden_size"], base_num_query_heads=s["num_attention_heads"],
        base_num_kv_heads=s["num_key_value_heads"], base_mlp_dim=s["intermediate_size"],
        base_moe_mlp_dim=s["moe_intermediate_size"], base_num_decoder_layers=s["num_hidden_layers"],
        first_num_dense_layers=s["first_k_dense_replace"], vocab_size=s["vocab_size"],
        num_experts=s["n_routed_experts"], num_experts_per_tok=s["num_experts_per_tok"],
        shared_experts=s["n_shared_experts"], q_lora_rank=s["q_lora_rank"] or 0,
        kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], **FAMILIES[family].get("maxtext", {})),
        "loaders")


def forward(model):
    return forward_logits(model, TOKENS)


def run_from_pretrained(family: str, ckpt: str, scan: bool, hf_dir: str, work: str) -> dict:
    """``from_pretrained`` and one forward pass; logits against transformers' (V4: against MaxText's own forward
    on its own conversion, written beside ``hf_dir`` by ``run_maxtext_own``)."""
    import numpy as np
    from maxtext.utils import model_creation_utils

    config = maxtext_config(family, ckpt, scan, work)
    model, _ = model_creation_utils.from_pretrained(config)
    logits = forward(model)
    reference = Path(hf_dir).parent / REFERENCE_NPY if FAMILIES[family].get("v4") else Path(hf_dir) / "hf_logits.npy"
    hf = np.load(reference)
    diff = float(np.abs(logits[:, : hf.shape[-1]] - hf).max())
    return {"max_abs_logits_diff": diff, "ok": diff <= TOLERANCE, "reference": reference.name,
            "top_token_agrees": bool((logits[:, : hf.shape[-1]].argmax(-1) == hf.argmax(-1)).all())}


def abstract_state(abstract_model):
    from flax import nnx
    from maxtext.layers import moe

    return nnx.state(abstract_model, (nnx.Param, moe.MoEBiasVar, moe.Tid2EidVar))


def run_maxtext_own(family: str, ckpt: str, scan: bool, hf_dir: str, work: str) -> dict:
    """MaxText's forward on MaxText's own conversion: the model made (random) by ``from_pretrained`` without a
    checkpoint, its weights replaced by what ``load_params_from_path`` restores (``from_pretrained`` cannot load
    that conversion: it restores ``params/params`` only). The logits go beside ``hf_dir``."""
    import numpy as np
    from flax import nnx
    from maxtext.common import checkpointing
    from maxtext.utils import model_creation_utils

    config = maxtext_config(family, ckpt, scan, work)
    _, abstract_model = model_creation_utils.create_nnx_abstract_model(config)
    loaded = checkpointing.load_params_from_path(ckpt, abstract_state(abstract_model),
                                                 config.checkpoint_storage_concurrent_gb)
    model, _ = model_creation_utils.from_pretrained(maxtext_config(family, "", scan, work))
    before = abstract_state(model).to_pure_dict()
    nnx.update(model, loaded)
    import jax

    after = abstract_state(model).to_pure_dict()
    flat_before = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(before)[0]}
    flat_after = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(after)[0]}
    same = sorted(k for k in flat_after if np.array_equal(flat_before[k], flat_after[k]))  # init == loaded
    logits = forward(model)
    np.save(Path(hf_dir).parent / REFERENCE_NPY, logits)
    return {"leaves": len(flat_after), "leaves_replaced": len(flat_after) - len(same), "same_as_init": same,
            "ok": True}


def run_load_params(family: str, ckpt: str, scan: bool, work: str) -> dict:
    from maxtext.common import checkpointing
    from maxtext.utils import model_creation_utils

    config = maxtext_config(family, ckpt, scan, work)
    _, abstract_model = model_creation_utils.create_nnx_abstract_model(config)
    abstract = abstract_state(abstract_model)
    loaded = checkpointing.load_params_from_path(ckpt, abstract, config.checkpoint_storage_concurrent_gb)
    got = forward_leaves(loaded)
    want = written_leaves(ckpt)  # what was written, every collection merged by leaf path (as the model addresses it)
    mismatched = mismatched_leaves(got, {k: v for k, (_, v) in want.items()})
    bias = sorted(k for k in want if k.endswith(("gate/bias", "tid2eid")))
    return {"leaves_written": len(want), "leaves_loaded": len(got), "mismatched": mismatched[:5],
            "n_mismatched": len(mismatched), "bias_leaves": {k: [want[k][0], list(want[k][1].shape)] for k in bias},
            "ok": not mismatched and set(want) == set(got)}


# --- the driver (any Python: it runs everything in fresh processes) ---------------------------

def legacy_tree(rev: str) -> Path:
    """ckptconv's package as it was at ``rev``, to write the earlier layout."""
    root = WORK / f"ckptconv-{rev}"
    if not root.exists():
        root.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "ckptconv"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def run_case(case: Case, legacy_rev: str) -> dict:
    root = WORK / case.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf, dst = root / "hf", root / "ckptconv"
    row = {"case": case.name, "family": case.family, "scan": case.scan, "layout": case.layout}
    v4 = FAMILIES[case.family].get("v4")
    mt_env = MT_ENV
    if v4:
        made = run([MT_PYTHON, BENCH / "hf_tiny_v4.py", hf, "--bf16"], root / "make_hf.log")
    else:
        made = run([MT_PYTHON, __file__, "make-hf", case.family, hf], root / "make_hf.log")
    if made.returncode:
        return row | {"error": "make-hf: " + error_line(made)}
    row |= last_json(made)
    if v4:  # MaxText's own conversion and its forward on it: the reference for from_pretrained's logits
        theirs = root / "maxtext"
        config = json.loads((hf / "config.json").read_text())
        flags = [f"{k}={v}" for k, v in v4_overrides(config, case.scan).items()]
        converted = steps.maxtext_convert(FAMILIES[case.family]["maxtext_model"], hf, theirs, flags,
                                          ["--simulated_cpu_devices_count=16", "--save_dtype=float32"],
                                          root / "maxtext_convert.log")
        if converted.returncode:
            return row | {"error": "MaxText's to_maxtext: " + error_line(converted)}
        own = run([MT_PYTHON, __file__, "maxtext-own", case.family, theirs / "0" / "items", str(case.scan), hf,
                   root / "mt-own"], root / "maxtext-own.log", env=mt_env)
        if own.returncode:
            return row | {"error": "MaxText's forward on its own conversion: " + error_line(own)}
        row["maxtext-own"] = last_json(own)
    legacy_rev = FAMILIES[case.family].get("legacy_rev", legacy_rev)
    env = {"PYTHONPATH": str(legacy_tree(legacy_rev))} if case.layout == "legacy" else None
    converted = steps.convert(hf, dst, root / "convert.log", *steps.layout(case.scan, 1, "float32"), env=env)
    if converted.returncode:
        return row | {"error": "convert: " + error_line(converted)}
    items = dst / "0" / "items"
    for step in ("from-pretrained", "load-params"):
        args = [MT_PYTHON, __file__, step, case.family, items, str(case.scan), hf, root / f"mt-{step}"]
        result = run(args, root / f"{step}.log", env=mt_env)
        row[step] = last_json(result) if result.returncode == 0 else {"ok": False, "exit": result.returncode,
                                                                       "error": error_line(result)}
    return row


def cell(result: dict | None, key: str) -> str:
    if not result:
        return "-"
    if "error" in result:
        return f"**fails**: `{result['error'].replace('|', '/')}`"
    if key == "from-pretrained":
        vs = " vs MaxText on its own conversion" if result.get("reference") == REFERENCE_NPY else ""
        return f"{'**ok**' if result['ok'] else 'DIFFERENT'}, max abs {result['max_abs_logits_diff']:.1e}{vs}"
    return (f"{'**ok**' if result['ok'] else 'DIFFERENT'}: {result['leaves_loaded']}/{result['leaves_written']} leaves"
            + (f", mismatched {result['mismatched']}" if result["n_mismatched"] else ", every one equal"))


def kept_table_lines(path: Path) -> dict[str, str]:
    """The table lines of an earlier LOADERS.md by case name."""
    return steps.kept_rows(path, {case.name for case in CASES})


def write(rows: list[dict], path: Path, legacy_rev: str, kept: dict[str, str] | None = None) -> None:
    versions = steps.mt_versions()
    lines = [
        "# MaxText 0.2.5's two loaders on ckptconv's DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 / DeepSeek-V2 / DeepSeek-V3.2 / "
        "DeepSeek-V4 checkpoints",
        "",
        f"Written by `python -m bench loaders` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"(MaxText {versions[0]}, transformers {versions[1]}, CPU)."
        + (f" The rows of {', '.join(sorted(kept))} are kept from the earlier run of this file (`--merge`)."
           if kept else ""),
        "Each row: a tiny random model from transformers' own class (`DeepseekV3ForCausalLM`; deepseek2: "
        "`DeepseekV2ForCausalLM`, queries without LoRA, softmax routing without a bias; deepseek3.2: "
        "`DeepseekV32ForCausalLM`, its indexer choosing 4 of the 8 tokens; kimi-k2.5: the kimi-k2 model stored as "
        "Kimi-K2.5's release lays it out, `language_model.` names, `text_config`, a vision tensor beside) "
        "(1 dense + 2 MoE layers, 8 experts, "
        "weights and a random router bias rounded to bf16), converted by `ckptconv convert --dtype float32 --devices 1`; "
        "then MaxText's `from_pretrained` and one forward pass (logits vs transformers', f32, tolerance 1e-4), and "
        "`checkpointing.load_params_from_path` into the model's abstract state (every leaf vs what was written). "
        f"`legacy`: the earlier layout (router bias in `params/MoEBiasVar`), ckptconv at {legacy_rev}. "
        "deepseek4: a tiny random DeepSeek-V4 release in the hub's layout (`bench/hf_tiny_v4.py --bf16`, loaded "
        "without a missing or unexpected key by transformers' `DeepseekV4ForCausalLM`; 5 layers, compress ratios "
        "[0, 0, 4, 128, 4], the first 3 routed by `tid2eid`, 8 experts), MaxText's `deepseek4-284b` with its sizes "
        "and `attention=dot_product`; MaxText's own forward drifts from transformers' on V4 (issue 25), so its "
        "`from_pretrained` logits are compared with MaxText's forward on MaxText's own `to_maxtext` conversion of the "
        "same files (`--save_dtype=float32`; loaded by `load_params_from_path`: `from_pretrained` cannot load it, its bias and `tid2eid` "
        "being in their own collections), tolerance 1e-4; "
        f"deepseek4 `legacy`: `tid2eid` in `params/Tid2EidVar`, ckptconv at {FAMILIES['deepseek4']['legacy_rev']}. "
        "`bias effect`: max abs change of transformers' logits when the router bias is zeroed (the test can see it); "
        "`indexer`: when every token is chosen instead of the indexer's 4.",
        "",
        "| case | router bias (deepseek4: and `tid2eid`) written at | bias effect | `from_pretrained` + forward | `load_params_from_path` |",
        "|---|---|---|---|---|",
    ]
    table = dict(kept or {})
    for r in rows:
        if "error" in r:
            table[r["case"]] = f"| {r['case']} | - | - | {r['error']} | - |"
            continue
        lp = r.get("load-params", {})
        where = sorted({f"params/{c}, shape {s}" for c, s in lp.get("bias_leaves", {}).values()}) or ["-"]
        indexer = (f" (indexer: {r['indexer_effect_on_logits']:.2f})" if "indexer_effect_on_logits" in r else "")
        effect = f"{r['bias_effect_on_logits']:.2f}" if "bias_effect_on_logits" in r else "not measured"
        table[r["case"]] = (f"| {r['case']} | {'; '.join(where)} | {effect}{indexer} "
                            f"| {cell(r.get('from-pretrained'), 'from-pretrained')} | {cell(lp, 'load-params')} |")
    lines += [table[case.name] for case in CASES if case.name in table]
    lines += ["", "Raw rows: `bench/work/loaders/results.json`; logs beside them.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "make-hf":
        make_hf(argv[1], argv[2])
        return 0
    if argv and argv[0] in ("from-pretrained", "load-params", "maxtext-own"):
        family, ckpt, scan, hf_dir, work = argv[1], argv[2], argv[3] == "True", argv[4], argv[5]
        step = {"from-pretrained": run_from_pretrained, "maxtext-own": run_maxtext_own,
                "load-params": lambda f, c, s, h, w: run_load_params(f, c, s, w)}[argv[0]]
        result = step(family, ckpt, scan, hf_dir, work)
        print(json.dumps(result), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--legacy-rev", default="a0431e7", help="a ckptconv commit writing the bias in MoEBiasVar")
    parser.add_argument("--out", default=str(DOCS / "LOADERS.md"))
    parser.add_argument("--merge", action="store_true", help="keep the other cases' rows of the last run")
    args = parser.parse_args(argv)
    steps.require_maxtext(parser)
    previous = WORK / "results.json"
    kept = json.loads(previous.read_text()) if args.merge and previous.exists() else []
    # cases in neither this run nor the last run's raw rows: --merge keeps their lines of the table as they are
    kept_lines = ({k: v for k, v in kept_table_lines(Path(args.out)).items() if k not in {r["case"] for r in kept}}
                  if args.merge else {})
    rows = steps.run_cases(CASES, args.only, lambda case: run_case(case, args.legacy_rev), previous, kept)
    write(rows, Path(args.out), args.legacy_rev, {k: v for k, v in kept_lines.items() if k not in
                                                  {row["case"] for row in rows}})
    return 0 if all(r.get("from-pretrained", {}).get("ok") and r.get("load-params", {}).get("ok")
                    for r in rows if r["layout"] == "current") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
