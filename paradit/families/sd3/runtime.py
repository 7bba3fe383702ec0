"""SD3.5's runtime facts, as data: its tensor-parallel plan and the linears FP8 keeps in high precision.

Widths are read from the model's modules, so the plan follows whatever checkpoint is loaded.
"""

from __future__ import annotations

from paradit.parallel.tensor import COLUMN, COLUMN_MLP, ROW, ROW_MLP, TensorPlan, joint_attention

TENSOR_PLAN = TensorPlan(
    family="SD3.5",
    heads=lambda model: model.config.num_attention_heads,
    widths=lambda model: {
        "attention": model.transformer_blocks[0].attn.to_q.out_features,
        "MLP hidden": model.transformer_blocks[0].ff.net[2].in_features,
    },
    linears={
        # The last block has no to_add_out (its text output is never read): the pattern matches the others.
        **joint_attention("transformer_blocks.*.attn"),
        # SD3.5-medium's image-only attention (attn2) in its first blocks.
        "transformer_blocks.*.attn2.to_[qkv]": COLUMN,
        "transformer_blocks.*.attn2.to_out.0": ROW,
        "transformer_blocks.*.ff.net.0.proj": COLUMN_MLP,
        "transformer_blocks.*.ff.net.2": ROW_MLP,
        "transformer_blocks.*.ff_context.net.0.proj": COLUMN_MLP,
        "transformer_blocks.*.ff_context.net.2": ROW_MLP,
    },
)

# The embedders, the AdaLN modulation (which lives under "norm" names: norm1.linear, norm1_context.linear, norm_out)
# and the output projection.
KEEP_HIGH_PRECISION = ("embed", "norm", "proj_out")
