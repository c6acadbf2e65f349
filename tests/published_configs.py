"""The giants' config.json files as published on the hub (tests plan them with header-only checkpoints)."""

# deepseek-ai/DeepSeek-V3 config.json as published.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
# moonshotai/Kimi-K2-Instruct config.json as published: DeepSeek-V3's architecture, its own values.
KIMI_K2 = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585,
    "first_k_dense_replace": 1, "max_position_embeddings": 131072, "n_group": 1, "n_routed_experts": 384,
    "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "topk_group": 1, "transformers_version": "4.48.3",
    "vocab_size": 163840,
}
for unpublished in ("ep_size",):
    KIMI_K2.pop(unpublished)
# moonshotai/Kimi-K2-Thinking config.json: Kimi-K2's architecture and sizes, a 256K context, and its
# routed experts in compressed-tensors INT4 (quantization_config as released; the runtime values
# here, context and RoPE factor, change no weight).
KIMI_K2_THINKING = {
    **KIMI_K2, "eos_token_id": 163586, "max_position_embeddings": 262144, "rms_norm_eps": 1e-05,
    "rope_scaling": {**KIMI_K2["rope_scaling"], "factor": 64.0}, "transformers_version": "4.56.2",
    "quantization_config": {
        "config_groups": {"group_0": {
            "input_activations": None, "output_activations": None, "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                        "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                        "symmetric": True, "type": "int"}}},
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"},
}

# openai/gpt-oss-20b config.json as published (120b: 36 layers, 128 experts).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}
# allenai/Olmo-3-7B-Instruct config.json (the hub is not reachable from here: as MaxText's olmo3-7b.yml and
# other public code restate it); Olmo-3.1-32B-Instruct: the same with MaxText olmo3-32b.yml's sizes.
OLMO3_7B_INSTRUCT = {
    "architectures": ["Olmo3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 8,
    "max_position_embeddings": 65536, "model_type": "olmo3", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06,
    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0, "factor": 8.0,
                     "original_max_position_embeddings": 8192, "rope_type": "yarn"},
    "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 100278,
}
OLMO3_32B_INSTRUCT = {**OLMO3_7B_INSTRUCT, "hidden_size": 5120, "intermediate_size": 27648, "num_attention_heads": 40,
                      "num_hidden_layers": 64, "num_key_value_heads": 8,
                      "layer_types": OLMO3_7B_INSTRUCT["layer_types"] * 2}
# deepseek-ai/DeepSeek-V2-Lite config.json (as MaxText 0.2.5's hf_model_configs copies it, without the rope_theta it
# adds inside rope_scaling): queries without LoRA, softmax routing without a bias, no MTP layer.
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                 "AutoModel": "modeling_deepseek.DeepseekV2Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}
# deepseek-ai/DeepSeek-V3.2 config.json: DeepSeek-V3's, plus the indexer's sizes (MaxText's copy drops the FP8
# quantization_config; the release has it, with power-of-two scales)
DEEPSEEK_V32 = {
    **DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 2048, "transformers_version": "4.44.2",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
}
for unpublished in ("auto_map", "aux_loss_alpha", "seq_aux"):
    DEEPSEEK_V32.pop(unpublished)
PUBLISHED = {"DeepSeek-V3": DEEPSEEK_V3, "DeepSeek-V2-Lite": DEEPSEEK_V2_LITE, "DeepSeek-V3.2": DEEPSEEK_V32,
             "Kimi-K2": KIMI_K2, "Kimi-K2-Thinking": KIMI_K2_THINKING,
             "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B, "Olmo-3-7B-Instruct": OLMO3_7B_INSTRUCT,
             "Olmo-3.1-32B-Instruct": OLMO3_32B_INSTRUCT}

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json, as MaxText 0.2.5 copies it (hf_model_configs.py).
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True, "vocab_size": 151936,
}
# Qwen/Qwen3.5-35B-A3B's config.json, as MaxText 0.2.5 copies it: the text decoder in text_config.
QWEN3_5_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5_moe",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
        "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16,
        "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
        "use_cache": True, "vocab_size": 248320, "mamba_ssm_dtype": "float32",
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 248057,
    "vision_config": {"deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
                      "model_type": "qwen3_5_moe", "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 248054, "vision_start_token_id": 248053,
}
# Qwen/Qwen3.5-397B-A17B: the 35B's config with its widths (512 experts a layer, 64 value heads, 60 layers).
QWEN3_5_397B = {
    **QWEN3_5_35B,
    "text_config": {**QWEN3_5_35B["text_config"], "hidden_size": 4096,
                    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 15,
                    "linear_num_value_heads": 64, "moe_intermediate_size": 1024, "num_attention_heads": 32,
                    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 60,
                    "shared_expert_intermediate_size": 1024},
    "vision_config": {**QWEN3_5_35B["vision_config"], "out_hidden_size": 4096},
}
# Qwen/Qwen3.5-35B-A3B-FP8 and -397B-A17B-FP8: the bf16 releases' configs with the FP8 quantization_config
# (e4m3, 128x128 blocks; modules kept in bfloat16 as /work/shared/HUB-FORMATS.md lists them).
FP8_QUANTIZATION = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens", "model.visual", "mlp.gate",
                               "shared_expert_gate", "linear_attn.conv1d", "linear_attn.in_proj_a",
                               "linear_attn.in_proj_b", "norm", "A_log", "dt_bias"]}
QWEN3_5_35B_FP8 = {**QWEN3_5_35B, "quantization_config": FP8_QUANTIZATION}
QWEN3_5_397B_FP8 = {**QWEN3_5_397B, "quantization_config": FP8_QUANTIZATION}
