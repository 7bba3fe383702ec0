"""Wan's runtime facts, as data: its tensor-parallel plan and the linears FP8 keeps in high precision.

No tensor plan yet: the RMS norms on Q and K take one statistic over all heads (``heads * head_dim``), so a rank
holding a share of the heads would need an all-reduce of the squared sums inside every attention; without it the
numbers would be wrong. ``--tensor`` is refused for Wan (``check_tensor_plan``) until the model grows that hook.
"""

from __future__ import annotations

TENSOR_PLAN = None

# The patch and condition embedders (time, text and image projections: ``time_embedder``, ``time_proj``,
# ``text_embedder``, ``image_embedder``), the blocks' and the head's ``scale_shift_table`` modulation (parameters,
# named for completeness), and the output projection.
KEEP_HIGH_PRECISION = ("patch_embedding", "condition_embedder", "scale_shift_table", "proj_out")
