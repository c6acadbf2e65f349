"""The converted weights give the HF model's logits: a RoPE, scaling, norm, routing or layout mistake fails here.

HF side: ``transformers`` loads the HF checkpoint (float32, CPU). MaxText side: the checkpoint
is restored with Orbax and run through ``tests/maxtext_forward.py`` with MaxText's semantics.
Every model's weights are bf16-representable, so the two agree to float32 rounding. The models
are every family's own logit examples (``Family.synthetic.logits``); MaxText's run-time
behaviour per family is the table ``SEMANTICS`` below.
"""

from typing import Callable

import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.families import BY_MODEL_TYPE, FAMILIES
from tests import maxtext_forward
from tests.conftest import run_cli
from tests.lora_adapters import causal_lm_class, text_model
from tests.maxtext_forward import Semantics
from tests.test_convert import restore


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _base(model: synth.SynthModel, text: dict) -> dict:
    return dict(family=model.model_type, num_layers=model.num_layers, eps=text["rms_norm_eps"],
                theta=text.get("rope_theta", 10000.0))


def _llama(model: synth.SynthModel, text: dict) -> Semantics:
    scaling = text.get("rope_scaling")
    return Semantics(**_base(model, text), rope_scaling=scaling,
                     interleaved=bool(scaling and scaling.get("rope_type") == "llama3"))


def hybrid_semantics(model_type: str, t: dict) -> Semantics:
    """Qwen3-Next / Qwen3.5 (MaxText qwen3_next / qwen3_5): Gated DeltaNet, gated partial-RoPE attention,
    softmax top-k experts with a gated shared expert; ``t`` the (text) config."""
    rope = t.get("rope_parameters") or {}
    return Semantics(family=model_type, num_layers=t["num_hidden_layers"], eps=t["rms_norm_eps"],
                     theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))), moe="softmax_topk",
                     top_k=t["num_experts_per_tok"], layout="qwen3_5" if model_type == "qwen3_5_moe" else "qwen3_next",
                     extra={"norm_topk_prob": t.get("norm_topk_prob", True),
                            "period": t.get("full_attention_interval", 4),
                            "partial_rotary_factor": rope.get("partial_rotary_factor", t.get("partial_rotary_factor")),
                            "k_heads": t["linear_num_key_heads"], "v_heads": t["linear_num_value_heads"],
                            "k_hd": t["linear_key_head_dim"], "v_hd": t["linear_value_head_dim"]})


# MaxText's run-time behaviour per family (its decoder block), for ``tests/maxtext_forward.py``: a family added
# to the registry needs an entry here (the registry test checks it), its logit examples come from the family.
SEMANTICS: dict[str, Callable[[synth.SynthModel, dict], Semantics]] = {
    "llama": _llama,
    "mistral": lambda m, t: Semantics(**_base(m, t)),
    "qwen2": lambda m, t: Semantics(**_base(m, t), runtime_query_scale=True),
    "qwen3": lambda m, t: Semantics(**_base(m, t), runtime_query_scale=True),
    "qwen3_moe": lambda m, t: Semantics(**_base(m, t), runtime_query_scale=True, moe="softmax_topk",
                                        top_k=t["num_experts_per_tok"], extra={"norm_topk_prob": t["norm_topk_prob"]}),
    "mixtral": lambda m, t: Semantics(**_base(m, t), moe="topk_softmax", top_k=t["num_experts_per_tok"]),
    "gemma2": lambda m, t: Semantics(**_base(m, t), gemma=True, attn_softcap=t["attn_logit_softcapping"],
                                     final_softcap=t["final_logit_softcapping"], layout="gemma2"),
    "gemma3": lambda m, t: Semantics(**_base(m, t), gemma=True, runtime_query_scale=True, layout="gemma3"),
    "gemma4": lambda m, t: Semantics(
        family="gemma4", num_layers=m.num_layers, eps=t["rms_norm_eps"], theta=0.0, layout="gemma4",
        final_softcap=t["final_logit_softcapping"], sliding_window=t["sliding_window"],
        top_k=t.get("top_k_experts") or 0,
        extra={"local_theta": t["rope_parameters"]["sliding_attention"]["rope_theta"],
               "global_theta": t["rope_parameters"]["full_attention"]["rope_theta"],
               "partial_rotary_factor": t["rope_parameters"]["full_attention"]["partial_rotary_factor"],
               "period": t["layer_types"].index("full_attention") + 1}),  # E2B: 4 sliding + 1 full
    "deepseek": lambda m, t: Semantics(**_base(m, t), moe="deepseek", top_k=t["num_experts_per_tok"],
                                       layout="deepseek", extra={
                                           "dense_layers": t["first_k_dense_replace"],
                                           "qk_rope_head_dim": t["qk_rope_head_dim"],
                                           "routed_scaling_factor": t["routed_scaling_factor"],
                                           "norm_topk_prob": t["norm_topk_prob"],
                                           "scoring_func": t.get("scoring_func", "sigmoid")}),
    "gpt_oss": lambda m, t: Semantics(**_base(m, t), runtime_query_scale=True, moe="gpt_oss",
                                      top_k=t["num_experts_per_tok"], layout="gpt_oss",
                                      extra={"swiglu_limit": t["swiglu_limit"], "swiglu_alpha": 1.702}),
    "olmo3": lambda m, t: Semantics(**_base(m, t), runtime_query_scale=True, layout="olmo3", post_norm=True,
                                    sliding_window=t["sliding_window"], sliding_layers=(True, True, True, False)),
    "qwen3_next": lambda m, t: hybrid_semantics(m.model_type, t),
    "qwen3_5_moe": lambda m, t: hybrid_semantics(m.model_type, t),
    "llama4": lambda m, t: Semantics(
        family="llama4", num_layers=m.num_layers, eps=t["rms_norm_eps"], theta=t["rope_parameters"]["rope_theta"],
        rope_scaling=t["rope_parameters"], runtime_query_scale=True, moe="llama4", top_k=t["num_experts_per_tok"],
        layout="llama4", extra={"cycle": 4, "nope_interval": t["no_rope_layer_interval"],
                                "use_qk_norm": t["use_qk_norm"], "floor_scale": t["floor_scale"],
                                "attn_scale": t["attn_scale"]}),
    # the multimodal wrappers' text decoders on text (one position per token: mRoPE is plain RoPE)
    "qwen3_vl": lambda m, t: Semantics(**_base(m, t), runtime_query_scale=True),
    "qwen3_vl_moe": lambda m, t: SEMANTICS["qwen3_moe"](m, t),
    "qwen3_omni_moe": lambda m, t: SEMANTICS["qwen3_moe"](m, m.config()["thinker_config"]["text_config"]),
}
SEMANTICS["kimi_k25"] = SEMANTICS["deepseek"]  # Kimi-K2.5's text decoder is Kimi-K2's (in its text_config)
# transformers' default attention for these has no sinks: its eager one does
EAGER = {"gpt_oss"}
# families whose checkpoints are a multimodal wrapper's: transformers' own class reads them, and its text model
# runs the tokens (transformers 5.24's Llama4ForConditionalGeneration fails without images)
CONDITIONAL = {"llama4": ("Llama4ForConditionalGeneration", "language_model")}  # by model_type


def semantics(model: synth.SynthModel) -> Semantics:
    """MaxText's run-time behaviour for this synthetic model's family."""
    config = model.config()
    return SEMANTICS[BY_MODEL_TYPE[model.model_type].name](model, config.get("text_config", config))


# Every family's logit examples (Family.synthetic.logits), by name: a new family brings its own.
EXAMPLES = {example.name: (family, example) for family in FAMILIES for example in family.synthetic.logits
            if example.reference == "transformers"}  # the others: tests/test_maxtext_leaves.py
CASES = {name: (synth.for_example(family, example), example.scan) for name, (family, example) in EXAMPLES.items()}


def hf_logits(src, tokens: np.ndarray, conditional: bool | tuple[str, str | None] = False, eager: bool = False) -> np.ndarray:
    """transformers' float32 logits; ``conditional``: the multimodal class to load (True: Gemma 3's), or
    (class, its text model's attribute) to run the text model alone."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if conditional:  # a class named here (True: Gemma 3's), and the part of it that runs the text
        name, text = ("Gemma3ForConditionalGeneration", None) if conditional is True else conditional
        cls = getattr(transformers, name)
    else:  # AutoModelForCausalLM, or a multimodal wrapper's own class (tests/lora_adapters.WRAPPERS)
        cls, text = causal_lm_class(transformers, src), None
    hf_model = cls.from_pretrained(str(src), dtype=torch.float32, **({"attn_implementation": "eager"} if eager else {}))
    hf_model.eval()
    with torch.no_grad():
        model = getattr(hf_model, text) if text else text_model(hf_model)
        return model(torch.tensor(tokens[None])).logits[0].numpy()


def maxtext_logits(dst, tokens: np.ndarray, sem: Semantics, scan: bool, vocab: int) -> np.ndarray:
    params = unflatten(restore(dst))["params"]["params"]
    return maxtext_forward.forward(params, tokens, sem, scan=scan)[:, :vocab]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(tmp_path, synth_dir, case):
    model, scan = CASES[case]
    family, example = EXAMPLES[case]
    src, dst = synth_dir(model), tmp_path / "dst"
    # in this process (convert imports neither JAX nor Orbax: the device count is the request's); the CLI's own
    # path is test_gemma3_conditional_generation_checkpoint_saved_by_transformers's, which runs it in a child
    report = convert(ConvertRequest(str(src), str(dst), devices=example.devices, scan_layers=scan, dtype="float32",
                                    progress="none", multimodal=example.multimodal))
    assert report["status"] == "complete" and report["scan_layers"] is scan

    tokens = np.random.default_rng(3).integers(0, model.vocab_size, size=12)
    expected = hf_logits(src, tokens, conditional=CONDITIONAL.get(model.model_type, False), eager=family.name in EAGER)
    got = maxtext_logits(dst, tokens, semantics(model), scan, model.vocab_size)
    assert np.abs(expected).max() > 1e-3  # a real signal, not zeros
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


def test_gemma3_conditional_generation_checkpoint_saved_by_transformers(tmp_path):
    """Gemma3ForConditionalGeneration as transformers saves it (hub naming, a vision tower):
    the text decoder converts, the tower is reported, and the text logits match."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    text = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.bfloat16)  # bf16-exact weights
    src, dst = tmp_path / "hf", tmp_path / "dst"
    model.save_pretrained(str(src))
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    report = __import__("json").loads((dst / "ckptconv-report.json").read_text())
    assert [e["what"] for e in report["not_converted"]] == ["multimodal projector", "vision tower"]
    assert report["not_converted"][1]["tensors"] > 10
    tokens = np.random.default_rng(5).integers(0, 96, size=10)
    expected = hf_logits(src, tokens, conditional=True)
    sem = Semantics(family="gemma3", num_layers=7, eps=1e-6, theta=10000.0, gemma=True, runtime_query_scale=True,
                    layout="gemma3")
    got = maxtext_logits(dst, tokens, sem, True, 96)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)
