#!/usr/bin/env python3
"""Reference log-probs from transformers for grpo-rollout/tests/it/architectures.rs.

Writes two micro models (seeded weights, q and k large enough that positions matter;
bench-qwen2-micro's tokenizer) into the fixtures directory and, for variants of their
config.json, the log-probs of the last T tokens of left-padded rows (float32, eager attention,
per-row position ids), as grpo-rollout's completion_logprobs computes them:

  * arch-mistral-micro (MistralForCausalLM, 2 layers, untied): `sliding_window` null, 64 (longer
    than the rows: no effect) and 12 (shorter: windowed attention);
  * arch-smollm3-micro (SmolLM3ForCausalLM, 3 layers, tied): `no_rope_layers` [1, 0, 1],
    none (every `no_rope_layer_interval`-th layer: 2 here), all ones (plain RoPE), and with
    `use_sliding_window` (window 12 on the NoPE layers);
  * arch-gemma3-micro (Gemma3ForCausalLM, `gemma3_text`, 3 layers: sliding, full, sliding;
    norm weights drawn too, so that their `1 + w` shows; `query_pre_attn_scalar` 16 against a
    head_dim of 8; RoPE base 1000 on the full layer, 10000 on the sliding ones): window 12, 64,
    the full layer's RoPE scaled (linear, 2), the layer types from `sliding_window_pattern` 2;
  * arch-gemma2-micro (Gemma2ForCausalLM, 3 layers: sliding, full, sliding as transformers
    derives them; norm weights drawn; `query_pre_attn_scalar` 16): soft caps 4 on the scores and
    3 on the logits (small, so that they bind), none, transformers' defaults (50, 30), and a
    window of 64;
  * arch-granite-micro (GraniteForCausalLM, 2 layers, tied): embedding, attention, residual
    multipliers 3, 0.2, 0.5 and logits_scaling 2.5; and all at their neutral values (the
    attention's 8^-1/2: llama's);
  * arch-olmo2-micro (Olmo2ForCausalLM, 2 layers, untied; norm weights drawn around 1): as it
    is, and with linear RoPE scaling.

Also each variant's config as transformers resolves it (no_rope_layers, layer_types).

  * arch-phi3-micro (Phi3ForCausalLM, 2 layers, untied; fused qkv_proj and gate_up_proj; a
    pre-training length of 64): as it is, window 12, half the head rotating
    (`partial_rotary_factor` 0.5), LongRoPE with three quarters rotating (transformers 5's
    `rope_parameters`, and transformers 4's layout: top-level factor, `rope_scaling.type`).

  * arch-qwen3moe-micro (Qwen3MoeForCausalLM, 3 layers, the middle one dense via
    `mlp_only_layers`; 6 experts): 2 per token as it is, renormalised (`norm_topk_prob`), 3 per
    token;
  * arch-qwen2moe-micro (Qwen2MoeForCausalLM, 2 layers, 4 experts and the shared expert):
    as it is, renormalised;
  * arch-mixtral-micro (MixtralForCausalLM, 2 layers, 4 experts): 2 per token, 1 per token,
    window 12;
  * arch-olmoe-micro (OlmoeForCausalLM, 2 layers, 4 experts, q/k norms over all heads; norm
    weights drawn around 1): as it is, renormalised.

  * arch-granitemoe-micro (GraniteMoeForCausalLM, 2 layers, untied, 4 experts stored fused
    as `input_linear` / `output_linear`; Granite's multipliers 3, 0.2, 0.5 and 2.5): 2 per token,
    1 per token, 3 per token.

  * arch-ernie45-micro (Ernie4_5ForCausalLM, 2 layers, tied; RoPE on adjacent pairs): as it is,
    and with `use_bias` (every projection biased).

  * arch-exaone4-micro (Exaone4ForCausalLM, 4 layers, untied; OLMo 2's post-norms with per-head
    q/k norms; norm weights drawn around 1): a window of 12 on layers 0–2 and the global layer 3
    without RoPE, no window (every layer global and rotating), and the layer types from
    `sliding_window_pattern` 2.

  * arch-gptoss-micro (GptOssForCausalLM, 2 layers: sliding, full; untied; 4 experts, head_dim 8;
    a learned sink per head drawn large enough to matter; biased router and experts; YaRN with a
    pre-training length of 64 and `truncate` off): 2 per token, 1 per token, the SwiGLU's clamp at
    0.5 (binding), the window at 64 (no effect at these lengths: as a global layer);
  * arch-gptoss-mxfp4-micro: the same model with its experts MXFP4-quantized as OpenAI's
    checkpoints hold them (`*_blocks`, `*_scales`, `quantization_config.quant_method` mxfp4),
    which transformers dequantizes on load: as it is.

  * arch-glm-micro (GlmForCausalLM, 2 layers, untied, head_dim 8; fused gate_up_proj; RoPE on
    adjacent pairs of the first half of each head): as it is, every dimension rotating
    (`partial_rotary_factor` 1), without the q/k/v biases (`attention_bias` false: the file's
    biases left out);
  * arch-glm4-micro (Glm4ForCausalLM, the same with the sublayers' output norms, drawn around 1):
    as it is, three quarters rotating, linear RoPE scaling.

  * arch-olmo3-micro (Olmo3ForCausalLM, 4 layers: three sliding, one full; untied; norm weights
    drawn around 1): a window of 12 with YaRN on the full layer only (transformers 5's
    `rope_parameters` per layer type), the same in the released configs' layout (top-level
    `rope_theta` and `rope_scaling`), no scaling, the sliding layers with a base of their own,
    a window of 64.

  * arch-seedoss-micro (SeedOssForCausalLM, 2 layers, untied, head_dim 8; every bias in the file,
    dropout 0): q/k/v biased as it is, o biased too (`attention_out_bias`), the MLP biased
    (`mlp_bias`), none (`attention_bias` false: the file's biases left out).

  * arch-arcee-micro (ArceeForCausalLM, 2 layers, untied; an MLP without gate, ReLU²): as it
    is, with the MLP's biases, with YaRN.

  * arch-nanochat-micro (NanoChatForCausalLM, 2 layers, untied; weightless norms, q/k normed
    after RoPE, fc1 → ReLU² → fc2, a norm of the embeddings, the logits capped): without
    biases, with q/k/v/o biased, the cap at 3 (binding), no cap, with YaRN (its attention
    factor, which the q/k norms take out again).

  * arch-glm4moe-micro (Glm4MoeForCausalLM, 3 layers, the first dense (`first_k_dense_replace`
    1), untied, head_dim 8; 8 experts, 2 per token, one shared expert; the router's
    `e_score_correction_bias` drawn so that it changes which experts are chosen; q/k norms in the
    file): as it is (one group, renormalised), two groups of which one is taken, four groups of
    which two are taken with the weights scaled by 2.5 and not renormalised, with its q/k norms
    (`use_qk_norm`), without the q/k/v biases, every dimension rotating.

  * arch-deepseekv3-micro (DeepseekV3ForCausalLM, 3 layers, the first dense, untied; latent
    attention with a low-rank q (16), a latent of 12, query heads of 8 + 8 (RoPE on adjacent
    pairs), values of 8; 8 experts in groups, 2 per token, a shared expert; q_a/kv_a/o biases in
    the file): as it is without the biases, with them, RoPE on rotate-half pairs
    (`rope_interleave` false), YaRN with `mscale_all_dim` 0.707 (scaling the scores), four
    groups of which two with the weights not renormalised;
  * arch-deepseekv3-noq-micro (the same family with one `q_proj`, query heads of 6 + 4, values
    of 10 — as wide as the queries —, no dense layer, two shared experts' width): as it is;
  * arch-deepseekv2-micro (DeepseekV2ForCausalLM, 3 layers, the first dense; one `q_proj`, RoPE
    on adjacent pairs; 8 experts in 4 groups, 3 per token by softmax probability, two shared
    experts' width): greedy as it is, group-limited (2 of the 4 groups; some tokens take an
    expert of probability 0), the weights scaled by 16, YaRN with V2-Lite's `mscale` and
    `mscale_all_dim` 0.707;
  * arch-glm4moelite-micro (Glm4MoeLiteForCausalLM, 3 layers, `mlp_layer_types` dense, sparse,
    sparse; values as wide as the queries): as it is, and with rotate-half RoPE.

    python3 scripts/gen_arch_reference.py grpo-rollout/tests/fixtures [--only MODEL...]
"""
import copy
import json
import os
import shutil
import sys
import tempfile

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "grpo-rollout", "tests", "fixtures", "bench-qwen2-micro")

# Rows of 40 and 27 tokens, longer than the windowed variants' window (12).
ROWS = [[(7 * i + 3) % 300 for i in range(40)], [(11 * i + 5) % 300 for i in range(27)]]
T = 24

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, pad_token_id=0)

# The gpt-oss micro model, dense and MXFP4-quantized.
GPTOSS = dict(num_hidden_layers=2, head_dim=8, tie_word_embeddings=False, sliding_window=12,
              num_local_experts=4, num_experts_per_tok=2,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})

MODELS = {
    "arch-mistral-micro": (
        "mistral",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None),
        {
            "mistral-no-window": {"sliding_window": None},
            "mistral-window-64": {"sliding_window": 64},
            "mistral-window-12": {"sliding_window": 12},
        },
    ),
    "arch-smollm3-micro": (
        "smollm3",
        dict(num_hidden_layers=3, rope_theta=10000.0, tie_word_embeddings=True, no_rope_layers=[1, 0, 1]),
        {
            "smollm3-nope-1": {"no_rope_layers": [1, 0, 1], "layer_types": None},
            "smollm3-interval-2": {"no_rope_layers": None, "no_rope_layer_interval": 2, "layer_types": None},
            "smollm3-all-rope": {"no_rope_layers": [1, 1, 1], "layer_types": None},
            "smollm3-window-12": {"no_rope_layers": [1, 0, 1], "use_sliding_window": True,
                                  "sliding_window": 12, "layer_types": None},
        },
    ),
    "arch-gemma3-micro": (
        "gemma3_text",
        dict(num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=16, sliding_window=12,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        {
            "gemma3-window-12": {},
            "gemma3-window-64": {"sliding_window": 64},
            "gemma3-linear-full": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            "gemma3-pattern-2": {"sliding_window_pattern": 2, "layer_types": None},
        },
    ),
    "arch-gemma2-micro": (
        "gemma2",
        dict(num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=16, sliding_window=12,
             attn_logit_softcapping=4.0, final_logit_softcapping=3.0),
        {
            "gemma2-caps": {},
            "gemma2-no-caps": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
            "gemma2-default-caps": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
            "gemma2-window-64": {"sliding_window": 64},
        },
    ),
    "arch-granite-micro": (
        "granite",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=True, embedding_multiplier=3.0,
             attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.5),
        {
            "granite": {},
            "granite-unit": {"embedding_multiplier": 1.0, "attention_multiplier": 0.35355339059327373,
                             "residual_multiplier": 1.0, "logits_scaling": 1.0},
        },
    ),
    "arch-olmo2-micro": (
        "olmo2",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
        {
            "olmo2": {},
            "olmo2-linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        },
    ),
    "arch-phi3-micro": (
        "phi3",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None,
             original_max_position_embeddings=64),
        {
            "phi3": {},
            "phi3-window-12": {"sliding_window": 12},
            "phi3-partial-half": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5}},
            "phi3-longrope-partial": {"rope_parameters": {
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.7, 2.9], "long_factor": [1.5, 3.0, 9.0]}},
            # transformers 4's layout of a Phi-4-mini config: top-level partial_rotary_factor,
            # `rope_scaling` with the older `type`, no factor (the context ratio, 4, gives
            # the attention factor).
            "phi3-longrope-v4-layout": {"rope_parameters": None, "partial_rotary_factor": 0.75,
                                        "rope_scaling": {"type": "longrope", "short_factor": [1.1, 1.3, 4.0],
                                                         "long_factor": [2.0, 2.0, 2.0]}},
        },
    ),
    "arch-qwen3moe-micro": (
        "qwen3_moe",
        dict(num_hidden_layers=3, rope_theta=10000.0, tie_word_embeddings=False, head_dim=8, num_experts=6,
             num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1]),
        {
            "qwen3moe": {},
            "qwen3moe-norm": {"norm_topk_prob": True},
            "qwen3moe-top3": {"num_experts_per_tok": 3},
        },
    ),
    "arch-qwen2moe-micro": (
        "qwen2_moe",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40),
        {
            "qwen2moe": {},
            "qwen2moe-norm": {"norm_topk_prob": True},
        },
    ),
    "arch-mixtral-micro": (
        "mixtral",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=None),
        {
            "mixtral": {},
            "mixtral-top1": {"num_experts_per_tok": 1},
            "mixtral-window-12": {"sliding_window": 12},
        },
    ),
    "arch-olmoe-micro": (
        "olmoe",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False, num_experts=4,
             num_experts_per_tok=2, rms_norm_eps=1e-5),
        {
            "olmoe": {},
            "olmoe-norm": {"norm_topk_prob": True},
        },
    ),
    "arch-granitemoe-micro": (
        "granitemoe",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False, num_local_experts=4,
             num_experts_per_tok=2, embedding_multiplier=3.0, attention_multiplier=0.2,
             residual_multiplier=0.5, logits_scaling=2.5),
        {
            "granitemoe": {},
            "granitemoe-top1": {"num_experts_per_tok": 1},
            "granitemoe-top3": {"num_experts_per_tok": 3},
        },
    ),
    "arch-ernie45-micro": (
        "ernie4_5",
        dict(num_hidden_layers=2, head_dim=8, tie_word_embeddings=True, use_bias=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "ernie45-bias": {},
            "ernie45": {"use_bias": False},
        },
    ),
    "arch-exaone4-micro": (
        "exaone4",
        dict(num_hidden_layers=4, tie_word_embeddings=False, sliding_window=12,
             layer_types=["sliding_attention"] * 3 + ["full_attention"],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "exaone4-window-12": {},
            "exaone4-no-window": {"sliding_window": None, "layer_types": ["full_attention"] * 4},
            "exaone4-pattern-2": {"layer_types": None, "sliding_window_pattern": 2},
        },
    ),
    "arch-gptoss-micro": (
        "gpt_oss",
        GPTOSS,
        {
            "gptoss": {},
            "gptoss-top1": {"num_experts_per_tok": 1},
            "gptoss-limit": {"swiglu_limit": 0.5},
            "gptoss-window-64": {"sliding_window": 64},
        },
    ),
    "arch-gptoss-mxfp4-micro": (
        "gpt_oss",
        GPTOSS,
        {
            "gptoss-mxfp4": {},
        },
    ),
    "arch-glm-micro": (
        "glm",
        dict(num_hidden_layers=2, head_dim=8, tie_word_embeddings=False, partial_rotary_factor=0.5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        {
            "glm": {},
            "glm-full-rotary": {"partial_rotary_factor": 1.0,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 1.0}},
            "glm-no-bias": {"attention_bias": False},
        },
    ),
    "arch-glm4-micro": (
        "glm4",
        dict(num_hidden_layers=2, head_dim=8, tie_word_embeddings=False, partial_rotary_factor=0.5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        {
            "glm4": {},
            "glm4-three-quarters": {"partial_rotary_factor": 0.75,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.75}},
            "glm4-linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}},
        },
    ),
    "arch-olmo3-micro": (
        "olmo3",
        dict(num_hidden_layers=4, tie_word_embeddings=False, sliding_window=12,
             rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 64},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        {
            "olmo3": {},
            "olmo3-v4-layout": {"rope_parameters": None, "rope_theta": 10000.0,
                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64}},
            "olmo3-no-scaling": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 10000.0}}},
            "olmo3-local-base": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 500.0}}},
            "olmo3-window-64": {"sliding_window": 64},
        },
    ),
    "arch-seedoss-micro": (
        "seed_oss",
        dict(num_hidden_layers=2, head_dim=8, tie_word_embeddings=False, attention_bias=True,
             attention_out_bias=True, mlp_bias=True, attention_dropout=0.0, residual_dropout=0.0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "seedoss": {"attention_out_bias": False, "mlp_bias": False},
            "seedoss-out-bias": {"mlp_bias": False},
            "seedoss-mlp-bias": {"attention_out_bias": False},
            "seedoss-no-bias": {"attention_bias": False, "attention_out_bias": False, "mlp_bias": False},
        },
    ),
    "arch-glm4moe-micro": (
        "glm4_moe",
        dict(num_hidden_layers=3, head_dim=8, tie_word_embeddings=False, first_k_dense_replace=1,
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
             n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True,
             use_qk_norm=True, partial_rotary_factor=0.5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        {
            "glm4moe": {"use_qk_norm": False},
            "glm4moe-groups": {"use_qk_norm": False, "n_group": 2, "topk_group": 1},
            "glm4moe-scaled": {"use_qk_norm": False, "n_group": 4, "topk_group": 2,
                               "routed_scaling_factor": 2.5, "norm_topk_prob": False},
            "glm4moe-qk-norm": {},
            "glm4moe-no-bias": {"use_qk_norm": False, "attention_bias": False},
            "glm4moe-full-rotary": {"use_qk_norm": False, "partial_rotary_factor": 1.0,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 1.0}},
        },
    ),
    "arch-deepseekv3-micro": (
        "deepseek_v3",
        dict(num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=False, first_k_dense_replace=1,
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
             n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16,
             kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_interleave=True,
             attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "deepseekv3": {"attention_bias": False},
            "deepseekv3-bias": {},
            "deepseekv3-rotate-half": {"attention_bias": False, "rope_interleave": False},
            "deepseekv3-yarn": {"attention_bias": False, "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}},
            "deepseekv3-groups-4": {"attention_bias": False, "n_group": 4, "topk_group": 2,
                                    "norm_topk_prob": False},
        },
    ),
    "arch-deepseekv3-noq-micro": (
        "deepseek_v3",
        dict(num_hidden_layers=2, num_key_value_heads=4, tie_word_embeddings=False, first_k_dense_replace=0,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
             n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, q_lora_rank=None,
             kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10, rope_interleave=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "deepseekv3-noq": {},
        },
    ),
    "arch-deepseekv2-micro": (
        "deepseek_v2",
        dict(num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=False, first_k_dense_replace=1,
             n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, n_shared_experts=2,
             n_group=4, topk_group=2, topk_method="greedy", routed_scaling_factor=1.0, q_lora_rank=None,
             kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "deepseekv2": {},
            "deepseekv2-group-limited": {"topk_method": "group_limited_greedy"},
            "deepseekv2-scaled": {"routed_scaling_factor": 16.0},
            "deepseekv2-yarn": {"rope_parameters": {
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}},
        },
    ),
    "arch-glm4moelite-micro": (
        "glm4_moe_lite",
        dict(num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=False,
             mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=24, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.8,
             norm_topk_prob=True, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=16, rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "glm4moelite": {},
            "glm4moelite-rotate-half": {"rope_interleave": False},
        },
    ),
    "arch-arcee-micro": (
        "arcee",
        dict(num_hidden_layers=2, tie_word_embeddings=False, mlp_bias=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "arcee": {"mlp_bias": False},
            "arcee-mlp-bias": {},
            "arcee-yarn": {"mlp_bias": False,
                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 64}},
        },
    ),
    "arch-nanochat-micro": (
        "nanochat",
        dict(num_hidden_layers=2, tie_word_embeddings=False, attention_bias=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        {
            "nanochat": {"attention_bias": False},
            "nanochat-bias": {},
            "nanochat-cap-3": {"attention_bias": False, "final_logit_softcapping": 3.0},
            "nanochat-no-cap": {"attention_bias": False, "final_logit_softcapping": None},
            "nanochat-yarn": {"attention_bias": False,
                              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 64}},
        },
    ),
}

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4(w):
    """(E, out, in) → blocks (E, out, in/32, 16) u8, scales (E, out, in/32) u8: each group of 32
    scaled by the power of two that puts its largest value at most 6, each value rounded to the
    nearest FP4 code (low nibble first)."""
    e, o, i = w.shape
    g = w.reshape(e, o, i // 32, 32)
    amax = g.abs().amax(-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]
    idx = (x.abs()[..., None] - FP4).abs().argmin(-1)
    code = (idx + 8 * (x < 0)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def quantize_experts(path):
    """The micro model at `path` with its experts' weights as MXFP4 blocks and scales."""
    from safetensors.torch import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    for k in [k for k in sd if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")]:
        # The files' (E, in, out) as MXFP4 holds it: (E, out, in).
        blocks, scales = mxfp4(sd.pop(k).transpose(1, 2).contiguous())
        sd[k + "_blocks"], sd[k + "_scales"] = blocks, scales
    save_file(sd, f, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)


def logprobs(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    resolved = {k: getattr(model.config, k, None) for k in ("no_rope_layers", "layer_types", "sliding_window")}
    return rows_logprobs(model), resolved


def rows_logprobs(model):
    """Log-probs of the last T tokens of ROWS, left-padded, per-row position ids."""
    length = max(len(r) for r in ROWS)
    ids = torch.tensor([[0] * (length - len(r)) + r for r in ROWS])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in ROWS])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, -T - 1 : -1, :]
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    return lp.tolist()


def micro_model(path, model_type, kw):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**SHAPE, **kw})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name:
                p.normal_(0, 1.5)
            elif "norm" not in name:
                p.normal_(0, 0.5 if ("q_proj" in name or "k_proj" in name or "qkv_proj" in name) else 0.15)
            elif model_type in ("gemma3_text", "gemma2"):
                p.normal_(0, 0.3)
            elif model_type in ("olmo2", "olmoe", "exaone4", "glm4", "olmo3", "glm4_moe", "deepseek_v3",
                                "glm4_moe_lite", "deepseek_v2"):
                p.normal_(1, 0.3)
        # GLM-4.5's router offsets (a buffer), large enough to change the choice.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(path)
    if path.endswith("mxfp4-micro"):
        quantize_experts(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, f), path)


def main():
    fixtures = sys.argv[1]
    # `--only NAME...`: (re)make those models only, keeping the other cases of the reference.
    only = sys.argv[3:] if len(sys.argv) > 2 and sys.argv[2] == "--only" else None
    ref = os.path.join(fixtures, "arch_reference.json")
    out = {"transformers": transformers.__version__, "rows": ROWS, "t": T, "cases": {}}
    if only and os.path.exists(ref):
        with open(ref) as f:
            out["cases"] = {k: v for k, v in json.load(f)["cases"].items() if v["model"] not in only}
    for name, (model_type, kw, variants) in MODELS.items():
        if only and name not in only:
            continue
        path = os.path.join(fixtures, name)
        micro_model(path, model_type, kw)
        with tempfile.TemporaryDirectory() as tmp:
            for case, change in variants.items():
                d = os.path.join(tmp, case)
                shutil.copytree(path, d)
                with open(os.path.join(d, "config.json")) as f:
                    cfg = json.load(f)
                for k, v in change.items():
                    if v is None and k == "rope_parameters":
                        cfg.pop(k, None)
                    else:
                        cfg[k] = copy.deepcopy(v)
                with open(os.path.join(d, "config.json"), "w") as f:
                    json.dump(cfg, f, indent=1)
                lp, resolved = logprobs(d)
                out["cases"][case] = {"model": name, "config": change, "resolved": resolved, "logprobs": lp}
    with open(ref, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
