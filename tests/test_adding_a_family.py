"""Adding a family is its folder and one line in the registry: a family built in a temporary folder (FLUX.2's model
and pipeline under another name, measured nowhere), registered by one added line of a copy of the package, plans
``--max-gpu-memory`` runs with nothing under ``paradit/planner/`` changed."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from paradit.families import FAMILIES

PACKAGE = Path(__file__).resolve().parents[1] / "paradit"
REGISTRY_LINE = '    "paradit.families.zimage",\n'

FAMILY_FILES = {
    "__init__.py": '"""A test family: FLUX.2\'s code under another name, measured nowhere."""\n',
    "presets.py": """
        import dataclasses

        from paradit.families.flux2.presets import PRESETS as FLUX2_PRESETS

        TINY = next(spec for spec in FLUX2_PRESETS if spec.name == "flux2-tiny")
        PRESETS = [dataclasses.replace(TINY, name="lumen-tiny", family="lumen", description="FLUX.2 tiny, renamed")]
    """,
    "family.py": """
        import dataclasses
        from pathlib import Path

        from paradit.families.flux2.family import FAMILY as FLUX2
        from paradit.family import Measured

        FAMILY = dataclasses.replace(
            FLUX2, name="lumen", diffusers_pipelines=("LumenPipeline",), measured=Measured.read(Path(__file__).parent)
        )
    """,
}

# Settled on the CPU under a cap, as `paradit generate --max-gpu-memory` settles a run; then a cap it cannot fit.
PLANNING = """
    import json

    import paradit
    from paradit.errors import InvalidRequest
    from paradit.memory import working_units
    from paradit.settings import Asked, settle

    found = {"package": paradit.__file__}
    for model in ("lumen-tiny", "flux2-tiny"):
        plan = settle(Asked(model, device="cpu", max_gpu_memory="2GiB")).memory_plan
        spec = paradit.families.PRESETS[model]
        found[model] = {
            "weights": [plan.transformer, plan.text_encoders, plan.vae],
            "activations": plan.activations,
            "units": [working_units(spec, table, False, False) for table in ("activations", "vae_decode")],
        }
    try:
        settle(Asked("lumen-tiny", device="cpu", max_gpu_memory="64MiB"))
    except InvalidRequest as exc:
        found["refusal"] = str(exc)
    print(json.dumps(found))
"""


def registered_copy(root: Path) -> Path:
    """A copy of the package whose registry lists the test family: one line added to ``PACKAGES``."""
    copy = root / "paradit"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    registry = copy / "families" / "__init__.py"
    text = registry.read_text()
    assert text.count(REGISTRY_LINE) == 1
    registry.write_text(text.replace(REGISTRY_LINE, REGISTRY_LINE + '    "lumen",\n'))
    return copy


def changed_lines(original: Path, copy: Path) -> list[str]:
    """Every line the copy adds or removes, over every file of both trees."""
    names = {p.relative_to(original) for p in original.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    names |= {p.relative_to(copy) for p in copy.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    changed = []
    for name in sorted(names):
        before = (original / name).read_text().splitlines() if (original / name).is_file() else ["<absent>"]
        after = (copy / name).read_text().splitlines() if (copy / name).is_file() else ["<absent>"]
        diff = difflib.unified_diff(before, after, lineterm="", n=0)
        changed += [f"{name}: {line}" for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    return changed


def test_a_family_in_a_temporary_folder_plans_capped_runs_with_its_folder_and_one_registry_line(tmp_path):
    family = tmp_path / "families" / "lumen"
    family.mkdir(parents=True)
    for name, text in FAMILY_FILES.items():
        (family / name).write_text(textwrap.dedent(text).lstrip())
    copy = registered_copy(tmp_path / "package")
    assert changed_lines(PACKAGE, copy) == ['families/__init__.py: +    "lumen",']  # nothing under planner/ or else
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy.parent), str(family.parent)])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PLANNING)], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert Path(found["package"]).parent == copy
    lumen, flux2 = found["lumen-tiny"], found["flux2-tiny"]
    assert lumen["weights"] == flux2["weights"]  # the same modules, counted alike
    # Working memory nobody measured: the largest figure any family has, so the estimate errs high.
    every = [family.measured for family in FAMILIES.values()]
    largest = max(
        x for m in every for entry in m.activations.values() for mode in entry.values() for x in mode.values()
    )
    assert lumen["units"] == [largest, max(x for m in every for x in m.vae_decode.values())]
    assert lumen["activations"] > flux2["activations"] > 0
    assert found["refusal"].startswith("lumen-tiny with 1 GPU does not fit under --max-gpu-memory 0.0625 GiB")
