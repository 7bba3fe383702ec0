"""Z-Image's runtime facts, as data: its tensor-parallel plan and the linears FP8 keeps in high precision.

Widths are read from the model's modules, so the plan follows whatever checkpoint is loaded.
"""

from __future__ import annotations

from paradit.parallel.tensor import COLUMN, COLUMN_MLP, ROW, ROW_MLP, TensorPlan

TENSOR_PLAN = TensorPlan(
    family="Z-Image",
    heads=lambda model: model.config.n_heads,
    widths=lambda model: {
        "attention": model.layers[0].attention.to_q.out_features,
        "MLP hidden": model.layers[0].feed_forward.w2.in_features,
    },
    linears={
        # The noise refiner, the context refiner and the joint layers share one block layout.
        "*.attention.to_[qkv]": COLUMN,
        "*.attention.to_out.0": ROW,
        "*.feed_forward.w[13]": COLUMN_MLP,  # w1 the gate, w3 the up projection
        "*.feed_forward.w2": ROW_MLP,
    },
)

# The embedders (all_x_embedder, cap_embedder, t_embedder), the per-block adaLN modulation and the output layer.
KEEP_HIGH_PRECISION = ("embedder", "adaLN", "final_layer")
