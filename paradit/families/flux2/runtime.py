"""FLUX.2's runtime facts, as data: its tensor-parallel plan and the linears FP8 keeps in high precision.

Widths are read from the model's modules, so the plan follows whatever checkpoint is loaded.
"""

from __future__ import annotations

from paradit.parallel.tensor import ROW_MLP, Shard, TensorPlan, joint_attention

TENSOR_PLAN = TensorPlan(
    family="FLUX.2",
    heads=lambda model: model.config.num_attention_heads,
    widths=lambda model: {
        "attention": model.single_transformer_blocks[0].attn.inner_dim,
        "MLP hidden": model.single_transformer_blocks[0].attn.mlp_hidden_dim,
    },
    linears={
        **joint_attention("transformer_blocks.*.attn"),
        "transformer_blocks.*.ff.linear_in": Shard("column", ("MLP hidden", "MLP hidden")),  # [gate, up]
        "transformer_blocks.*.ff.linear_out": ROW_MLP,
        "transformer_blocks.*.ff_context.linear_in": Shard("column", ("MLP hidden", "MLP hidden")),
        "transformer_blocks.*.ff_context.linear_out": ROW_MLP,
        # The single blocks pack [q, k, v, MLP gate, MLP up] into one projection and read [attention, MLP] back.
        "single_transformer_blocks.*.attn.to_qkv_mlp_proj": Shard(
            "column", ("attention", "attention", "attention", "MLP hidden", "MLP hidden")
        ),
        "single_transformer_blocks.*.attn.to_out": Shard("row", ("attention", "MLP hidden")),
    },
    local_attributes={
        "transformer_blocks.*.attn": ("heads",),
        "single_transformer_blocks.*.attn": ("heads", "inner_dim", "mlp_hidden_dim"),
    },
)

# The embedders (x_ and context_embedder), the timestep and guidance MLPs, the shared modulation projections and the
# output layers: a small share of the FLOPs that feeds every block or the prediction directly.
KEEP_HIGH_PRECISION = ("embed", "modulation", "norm_out", "proj_out")
