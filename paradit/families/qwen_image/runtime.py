"""Qwen-Image's runtime facts, as data: its tensor-parallel plan and the linears FP8 keeps in high precision.

Widths are read from the model's modules, so the plan follows whatever checkpoint is loaded.
"""

from __future__ import annotations

from paradit.parallel.tensor import COLUMN_MLP, ROW_MLP, TensorPlan, joint_attention

TENSOR_PLAN = TensorPlan(
    family="Qwen-Image",
    heads=lambda model: model.config.num_attention_heads,
    widths=lambda model: {
        "attention": model.transformer_blocks[0].attn.to_q.out_features,
        "MLP hidden": model.transformer_blocks[0].img_mlp.net[2].in_features,
    },
    linears={
        **joint_attention("transformer_blocks.*.attn"),
        "transformer_blocks.*.img_mlp.net.0.proj": COLUMN_MLP,
        "transformer_blocks.*.img_mlp.net.2": ROW_MLP,
        "transformer_blocks.*.txt_mlp.net.0.proj": COLUMN_MLP,
        "transformer_blocks.*.txt_mlp.net.2": ROW_MLP,
    },
    local_attributes={"transformer_blocks.*.attn": ("heads",)},
)

# The embedders (img_in, txt_in, the timestep MLP), the per-block modulation (img_mod, txt_mod) and the output layers.
KEEP_HIGH_PRECISION = ("img_in", "txt_in", "time_text_embed", "_mod.", "norm_out", "proj_out")
