"""The README's claims that a test can hold: every preset's row in its Models table states the preset's own default
steps, size and frames, and the models it names as served are the families the registry serves."""

from __future__ import annotations

import re
from pathlib import Path

from paradit.families import PRESETS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def model_rows() -> dict[str, str]:
    """Each preset named in the Models table -> its defaults cell."""
    rows = {}
    for line in README.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = cells[3]
    return rows


def test_every_preset_has_a_row_stating_its_own_defaults():
    rows = model_rows()
    assert set(rows) == set(PRESETS)
    for name, defaults in rows.items():
        spec = PRESETS[name]
        assert f"{spec.steps} steps" in defaults, (name, defaults)
        size = f"{spec.width}²" if spec.width == spec.height else f"{spec.width}×{spec.height}"
        assert size in defaults, (name, defaults)
        if spec.frames is not None:
            assert f"{spec.frames} frames" in defaults and f"{spec.fps} fps" in defaults, (name, defaults)


def test_the_opening_names_image_to_video_as_served():
    opening = README.split("\n\n")[1]
    assert "arriving" not in opening and "image-to-video" in opening
