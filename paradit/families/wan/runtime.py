"""Wan's runtime facts, as data: its tensor-parallel plan and the linears FP8 keeps in high precision.

Widths are read from the model's modules, so the plan follows whatever checkpoint is loaded. The RMS norms on Q and K
take one statistic over all heads (``heads * head_dim``): they are sharded with their projections and add their
squared sums over the tensor group (``norms_across_heads``), so the result stays exact.
"""

from __future__ import annotations

from paradit.parallel.tensor import COLUMN, COLUMN_MLP, ROW, ROW_MLP, TensorPlan

TENSOR_PLAN = TensorPlan(
    family="Wan",
    heads=lambda model: model.config.num_attention_heads,
    widths=lambda model: {"attention": model.config.inner_dim, "MLP hidden": model.config.ffn_dim},
    linears={
        **{f"blocks.*.{attn}.{name}": COLUMN for attn in ("attn1", "attn2") for name in ("to_q", "to_k", "to_v")},
        "blocks.*.attn1.to_out.0": ROW,
        "blocks.*.attn2.to_out.0": ROW,
        "blocks.*.ffn.net.0.proj": COLUMN_MLP,
        "blocks.*.ffn.net.2": ROW_MLP,
    },
    norms_across_heads=tuple(f"blocks.*.{attn}.{norm}" for attn in ("attn1", "attn2") for norm in ("norm_q", "norm_k")),
)

# The patch and condition embedders (time, text and image projections: ``time_embedder``, ``time_proj``,
# ``text_embedder``, ``image_embedder``), the blocks' and the head's ``scale_shift_table`` modulation (parameters,
# named for completeness), and the output projection.
KEEP_HIGH_PRECISION = ("patch_embedding", "condition_embedder", "scale_shift_table", "proj_out")
