"""Model presets: a name -> the ModelSpec of a published model (or a tiny one), one module per family.

Must not import torch.distributed.
"""

from __future__ import annotations

from paradit.errors import InvalidRequest
from paradit.presets.flux2 import FLUX2_PRESETS
from paradit.presets.qwen_image import QWEN_IMAGE_PRESETS
from paradit.presets.sd3 import SD3_PRESETS
from paradit.presets.zimage import ZIMAGE_PRESETS
from paradit.spec import ModelSpec

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec for spec in [*FLUX2_PRESETS, *QWEN_IMAGE_PRESETS, *SD3_PRESETS, *ZIMAGE_PRESETS]
}


def get_preset(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise InvalidRequest(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} (or a checkpoint folder)")
    return PRESETS[name]
