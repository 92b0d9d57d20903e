"""Which config.json fields the model-config reader understands, and which are known not to shape the KV cache.

A field in neither set is *unknown*: it may change which layers cache what, so the reader refuses the
config and names it (``allow_unknown_keys`` plans anyway and reports each one). Adding a field to
IRRELEVANT is a claim that no value of it changes the layer list, a layer's kind, its K/V heads, head
size, window or cache dtype; write why next to any that is not obvious.
"""

from __future__ import annotations

#: Fields the reader interprets (model_config.py says how).
UNDERSTOOD = frozenset({
    "model_type", "text_config", "torch_dtype", "dtype", "quantization_config",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "attention_head_dim",
    "hidden_size", "global_head_dim", "num_global_key_value_heads",
    # which layers slide / which layers are what
    "layer_types", "layers_block_type", "sliding_window", "sliding_window_size", "sliding_window_pattern",
    "use_sliding_window", "max_window_layers", "full_attention_interval", "attn_layer_period", "attn_layer_offset",
    "attn_layer_indices", "hybrid_override_pattern", "attention_chunk_size", "no_rope_layers",
    "no_rope_layer_interval",
    # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): what a layer caches
    "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
    "num_nextn_predict_layers",
    # state layers: sizes of their per-sequence state
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
    "mamba_d_ssm", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "expand",
    "mamba_ssm_cache_dtype",
    # refused when set (a layer that caches something else, or nothing of its own)
    "num_kv_shared_layers", "attention_k_eq_v", "use_bidirectional_attention", "is_encoder_decoder",
})

#: Fields no value of which changes what the KV cache holds per layer: weights, norms, activations,
#: positions (RoPE scales positions, not cache shapes), routing of experts, token ids, training knobs.
IRRELEVANT = frozenset({
    # bookkeeping
    "architectures", "auto_map", "transformers_version", "_name_or_path", "name_or_path", "model_name",
    # vocabulary and token ids
    "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tie_word_embeddings", "tie_encoder_decoder",
    # MLP and expert routing
    "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
    "hidden_act", "hidden_activation", "mlp_hidden_act", "mamba_hidden_act", "mlp_bias", "use_bias",
    "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "experts_per_token", "norm_topk_prob", "routed_scaling_factor", "topk_method", "n_group", "topk_group",
    "first_k_dense_replace", "moe_layer_freq", "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "decoder_sparse_step",
    "mlp_only_layers", "expert_layer_period", "expert_layer_offset", "interleave_moe_layer_step", "moe_layers",
    "swiglu_limit", "mlp_expansion_factor", "intermediate_size_mlp",
    # norms, initialisation, dropout, numerics
    "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "initializer_range", "attention_dropout",
    "hidden_dropout", "residual_in_fp32", "rescale_prenorm_residual", "pretraining_tp", "use_qk_norm",
    "for_llm_compressor",
    # positions (scale or rotate positions; the cache shape does not change)
    "rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq", "partial_rotary_factor",
    "max_position_embeddings", "original_max_position_embeddings", "initial_context_length",
    "position_embedding_type",
    # attention numerics (scores, not what is cached)
    "attention_bias", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "attn_temperature_tuning", "floor_scale", "attn_scale",
    # muP-style multipliers (Falcon-H1, Granite)
    "embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier", "attention_out_multiplier",
    "key_multiplier", "ssm_in_multiplier", "ssm_out_multiplier", "mlp_multipliers", "ssm_multipliers",
    "logits_scaling", "residual_multiplier", "attention_multiplier", "projectors_bias",
    # state-space layer internals that do not change the state's size
    "mamba_dt_rank", "time_step_rank", "mamba_conv_bias", "mamba_proj_bias", "use_conv_bias", "mamba_chunk_size",
    "chunk_size", "mamba_rms_norm", "mamba_norm_before_gate", "mamba_use_mlp", "use_mamba_kernels",
    "time_step_floor", "time_step_limit", "time_step_max", "time_step_min",
    # runtime knobs of transformers' own generation code
    "use_cache", "cache_implementation", "num_logits_to_keep", "output_attentions", "output_hidden_states",
    "return_dict", "torchscript", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "pruned_heads",
})

#: Fields of a multimodal config's top level (the language model's are in text_config): the vision or
#: audio tower and the tokens that stand for images; none shapes the language model's KV cache.
TOP_LEVEL_IRRELEVANT = IRRELEVANT | frozenset({
    "vision_config", "audio_config", "image_token_index", "image_token_id", "boi_token_index", "eoi_token_index",
    "boi_token_id", "eoi_token_id", "mm_tokens_per_image", "vision_feature_layer",
    "vision_feature_select_strategy", "projector_hidden_act", "multi_modal_projector_bias", "initializer_range",
})

#: Fields whose (truthy) presence means a layer caches something this planner does not model.
REFUSED = {
    "num_kv_shared_layers": "layers that reuse another layer's K/V cache hold none of their own",
    "attention_k_eq_v": "K and V are the same tensor, cached once",
    "use_bidirectional_attention": "bidirectional attention is an encoder's: no causal KV cache to page",
    "is_encoder_decoder": "an encoder-decoder model also caches cross-attention K/V of the encoder's output",
}
