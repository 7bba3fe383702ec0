"""The checks of a plan that need the model (``ParallelConfig.validate`` checks the degrees alone)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paradit.compile import model_blocks
from paradit.errors import InvalidRequest
from paradit.parallel.config import ParallelConfig
from paradit.parallel.tensor_plan import check_tensor_plan
from paradit.spec import ModelSpec

if TYPE_CHECKING:
    from paradit.family import Family


def check_plan(family: Family, spec: ModelSpec, parallel: ParallelConfig) -> None:
    parallel.validate(parallel.world_size, has_cfg=spec.guidance_mode == "cfg", heads=spec.attention_heads)
    if parallel.tensor == 1 and parallel.pipefusion == 1:
        return
    with torch.device("meta"):  # the model on the meta device tells its widths and blocks
        model = family.build_transformer(spec)
    if parallel.tensor > 1:
        check_tensor_plan(family.tensor_plan, model, parallel.tensor)
    blocks = len(model_blocks(model))
    if parallel.pipefusion > blocks:
        raise InvalidRequest(
            f"pipefusion {parallel.pipefusion} exceeds the model's {blocks} blocks; give at most {blocks} stages"
        )
    if parallel.pipefusion > 1 and spec.experts:
        # The patch loop drives one pipeline of stages; a second transformer would need its own.
        raise InvalidRequest(f"pipefusion does not run {spec.name}'s second transformer yet; drop --pipefusion")
