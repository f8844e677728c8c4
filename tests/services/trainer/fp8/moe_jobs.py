"""The small MoE job the FP8-experts tests train (keys for `small_job_args`): Llama-style, 4
experts of width 64 (a multiple of 16, so the GPU runs the grouped FP8 kernel), top-2."""

MOE_MODEL = {
    "model.num_experts": 4,
    "model.moe_ffn_hidden_size": 64,
    "model.moe_router_topk": 2,
    "model.activation": "swiglu",
    "model.normalization": "rmsnorm",
    "model.add_bias_linear": False,
}
