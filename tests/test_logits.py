"""The converted weights give the HF model's logits: a RoPE, scaling, norm, routing or layout mistake fails here.

HF side: ``transformers`` loads the HF checkpoint (float32, CPU). MaxText side: the checkpoint
is restored with Orbax and run through ``tests/maxtext_forward.py`` with MaxText's semantics.
Every model's weights are bf16-representable, so the two agree to float32 rounding.
"""

import numpy as np
import pytest

from ckptconv.commands import synth
from tests import maxtext_forward
from tests.conftest import run_cli
from tests.maxtext_forward import Semantics
from tests.test_convert import LLAMA31_ROPE, restore


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def semantics(model: synth.SynthModel) -> Semantics:
    """MaxText's run-time behaviour for this synthetic model's family."""
    config = model.config()
    text = config.get("text_config", config)
    mt = model.model_type
    base = dict(family=mt, num_layers=model.num_layers, eps=text["rms_norm_eps"], theta=text.get("rope_theta", 10000.0))
    if mt == "llama":
        scaling = text.get("rope_scaling")
        return Semantics(**base, rope_scaling=scaling, interleaved=bool(scaling and scaling.get("rope_type") == "llama3"))
    if mt == "mistral":
        return Semantics(**base)
    if mt in ("qwen2", "qwen3"):
        return Semantics(**base, runtime_query_scale=True)
    if mt == "qwen3_moe":
        return Semantics(**base, runtime_query_scale=True, moe="softmax_topk", top_k=text["num_experts_per_tok"],
                         extra={"norm_topk_prob": text["norm_topk_prob"]})
    if mt == "mixtral":
        return Semantics(**base, moe="topk_softmax", top_k=text["num_experts_per_tok"])
    if mt == "olmo3":
        return Semantics(**base, runtime_query_scale=True, layout="olmo3", post_norm=True,
                         sliding_window=text["sliding_window"], sliding_layers=(True, True, True, False))
    if mt == "gemma2":
        return Semantics(**base, gemma=True, attn_softcap=text["attn_logit_softcapping"],
                         final_softcap=text["final_logit_softcapping"], layout="gemma2")
    return Semantics(**base, gemma=True, runtime_query_scale=True, layout="gemma3")


# One RoPE for every Gemma 3 layer in these tiny models (HF uses a local and a global one).
GEMMA3_ROPE = {"rope_theta": 10000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None}
CASES = {  # name: (model, scan)
    "qwen3": (synth.SynthModel(model_type="qwen3", tie_word_embeddings=True), True),
    "qwen2": (synth.SynthModel(model_type="qwen2", tie_word_embeddings=False), False),
    # Llama 3.1+: interleaved RoPE, scaled q; Llama 2/3.0: half-split RoPE, scaled q, tied (like Llama 3.2 1B)
    "llama3.1": (synth.SynthModel(model_type="llama", tie_word_embeddings=False,
                                  config_overrides={"rope_scaling": LLAMA31_ROPE}), True),
    "llama": (synth.SynthModel(model_type="llama", tie_word_embeddings=True), True),
    "mistral": (synth.SynthModel(model_type="mistral", tie_word_embeddings=False), True),
    "qwen3_moe": (synth.SynthModel(model_type="qwen3_moe", tie_word_embeddings=False, num_experts=8,
                                   moe_intermediate_size=48, num_layers=3), True),
    "qwen3_moe-noscan": (synth.SynthModel(model_type="qwen3_moe", tie_word_embeddings=True, num_experts=4,
                                          moe_intermediate_size=32), False),
    "mixtral": (synth.SynthModel(model_type="mixtral", tie_word_embeddings=False, num_experts=4), True),
    "gemma2": (synth.SynthModel(model_type="gemma2", num_layers=4, vocab_size=96), True),
    "gemma2-noscan": (synth.SynthModel(model_type="gemma2", num_layers=4, vocab_size=96), False),
    # like Gemma 2 27B: queries scaled by query_pre_attn_scalar (here 20 = hidden / heads), not head_dim
    "gemma2-27b-like": (synth.SynthModel(model_type="gemma2", num_layers=2, vocab_size=96, hidden_size=80,
                                         config_overrides={"query_pre_attn_scalar": 20}), True),
    "gemma3_text": (synth.SynthModel(model_type="gemma3_text", num_layers=8, vocab_size=96,
                                     config_overrides=GEMMA3_ROPE), True),
    "gemma3_text-noscan": (synth.SynthModel(model_type="gemma3_text", num_layers=7, vocab_size=96,
                                            config_overrides=GEMMA3_ROPE), False),
    # OLMo 3: post-norm, q/k norms over all heads, two blocks of 3 sliding + 1 full layers; a window shorter
    # than the 12 tokens, so the sliding layers really mask
    "olmo3": (synth.SynthModel(model_type="olmo3", num_layers=8, num_kv_heads=2,
                               config_overrides={"sliding_window": 5}), True),
    "olmo3-noscan": (synth.SynthModel(model_type="olmo3", num_layers=4, num_heads=8, num_kv_heads=2, head_dim=8,
                                      config_overrides={"sliding_window": 3}), False),
}


def hf_logits(src, tokens: np.ndarray, conditional: bool = False) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cls = transformers.Gemma3ForConditionalGeneration if conditional else transformers.AutoModelForCausalLM
    hf_model = cls.from_pretrained(str(src), dtype=torch.float32)
    hf_model.eval()
    with torch.no_grad():
        return hf_model(torch.tensor(tokens[None])).logits[0].numpy()


def maxtext_logits(dst, tokens: np.ndarray, sem: Semantics, scan: bool, vocab: int) -> np.ndarray:
    params = unflatten(restore(dst))["params"]["params"]
    return maxtext_forward.forward(params, tokens, sem, scan=scan)[:, :vocab]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(tmp_path, synth_dir, case):
    model, scan = CASES[case]
    src, dst = synth_dir(model), tmp_path / "dst"
    flags = ["--devices", "4", "--dtype", "float32", "--scan-layers" if scan else "--no-scan-layers"]
    result = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert result.returncode == 0, result.stderr

    tokens = np.random.default_rng(3).integers(0, model.vocab_size, size=12)
    expected = hf_logits(src, tokens)
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
