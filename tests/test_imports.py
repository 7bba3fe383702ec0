"""No import circles in ``paradit``: every import a module names is an edge of one graph, and the graph has no cycle.
Every import counts: at the top, inside a function, under ``if TYPE_CHECKING:`` (a type a module names is a layer it
leans on), and by name (a string naming a paradit module, as the family registry's ``PACKAGES`` and the package's lazy
exports do, for ``import_module``). The implicit imports of parent packages are left out.

And the import rules, as one table (``IMPORT_RULES``): the modules whose import loads no torch, those whose import
loads none of the model libraries (diffusers, transformers, peft, torch._dynamo), and those whose own imports never
name torch.distributed; and settling a run and resolving its request, for every family, loads none of the model
libraries. Which modules name a family or a parallel strategy is ``test_layout.py``'s."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "paradit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_name(path: Path) -> str:
    """The package a module's relative imports start from: a package's own ``__init__`` is in it."""
    return ".".join(path.relative_to(PACKAGE.parent).parts[:-1])


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants of ``tree``: prose, which may name modules without importing them."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def imports(tree: ast.Module, package: str, modules: set[str]) -> set[str]:
    """The paradit modules a module of ``package`` (parsed as ``tree``) imports: by statement anywhere in it (relative
    ones resolved against ``package``), and by name (a string naming a module; one naming a package stands for every
    module in it)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            # ``from a import b`` imports the module a.b when there is one, else a's name b.
            found.update(
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module for alias in node.names
            )
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if node.value.startswith("paradit."):
                found.update(
                    module for module in modules if module == node.value or module.startswith(node.value + ".")
                )
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports(ast.parse(path.read_text()), package_name(path), modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_of_paradit_imports_itself_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles_and_reads_every_kind_of_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = import_graph()
    assert "paradit.settings" in graph["paradit.engine"]
    # A function-local import counts (the CLI imports the engine only when a command needs it).
    assert "paradit.engine" in graph["paradit.cli"]
    # So does one under TYPE_CHECKING, and an import by name: the registry imports each family's record by its
    # package's name, the package its exports on first use.
    modules = {"paradit.engine", "paradit.request", "paradit.families.a", "paradit.families.a.family"}
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import paradit.engine\n")
    assert imports(tree, "paradit", modules) == {"paradit.engine"}
    tree = ast.parse('"""Names paradit.request in prose."""\nPACKAGES = ("paradit.families.a",)\n')
    assert imports(tree, "paradit.families", modules) == {"paradit.families.a", "paradit.families.a.family"}
    assert "paradit.families.flux2.family" in graph["paradit.families"]
    assert "paradit.engine" in graph["paradit"]
    # A relative import resolves against the module's package.
    tree = ast.parse("from . import family\nfrom ...request import GenerationRequest\n")
    assert imports(tree, "paradit.families.a", modules) == {"paradit.families.a.family", "paradit.request"}


# The import rules the modules' docstrings stated, one row a module. "torch": importing the module loads no torch, so
# that what needs none answers at once (help, listings and refusals, a request handed to a server, a worker setting up
# its signals before its first heavy import). "torch.distributed": no import of the module's own names it, a
# function's included: the module is single-device code, or runs before any process group exists (the group is
# parallel/'s, the workers' and the probe's). "model libraries": importing the module loads none of diffusers,
# transformers, peft and torch._dynamo (seconds of imports), so that settling a run, a server's front and the workers'
# parent answer without them; they load where a pipeline, prompt encoder, VAE or scheduler is built, a GPU run's
# memory estimated, or blocks compiled. A module that loads no torch loads none of them either.
TORCH = "torch"
DISTRIBUTED = "torch.distributed"
MODEL_LIBRARIES = "model libraries"
LOADED_MODULES = {TORCH: ("torch",), MODEL_LIBRARIES: ("diffusers", "transformers", "peft", "torch._dynamo")}
IMPORT_RULES: dict[str, tuple[str, ...]] = {
    "paradit": (TORCH,),  # the public names are imported on first use
    "paradit.cache_options": (TORCH,),
    "paradit.checkpoint": (TORCH,),
    "paradit.cli": (TORCH, DISTRIBUTED),  # everything heavy is imported by the command that needs it
    "paradit.compile": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.cuda_graphs": (DISTRIBUTED,),
    "paradit.device_memory": (DISTRIBUTED,),
    "paradit.download": (TORCH, DISTRIBUTED),
    "paradit.engine": (MODEL_LIBRARIES,),  # the loader is imported where this process builds a pipeline
    "paradit.errors": (DISTRIBUTED,),
    "paradit.expert_swap": (DISTRIBUTED,),
    "paradit.families": (TORCH,),  # the presets are light; the family records load on first use of FAMILIES
    "paradit.families.default": (TORCH, DISTRIBUTED),  # the option records name it
    "paradit.families.encoders": (DISTRIBUTED,),
    "paradit.families.flux2.family": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.families.flux2.latents": (TORCH, DISTRIBUTED),  # plain arithmetic, which requests resolve with
    "paradit.families.flux2.model": (DISTRIBUTED,),
    "paradit.families.flux2.presets": (DISTRIBUTED,),
    "paradit.families.flux3.family": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.families.qwen_image.edit": (TORCH, DISTRIBUTED),  # the presets name it
    "paradit.families.qwen_image.family": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.families.qwen_image.latents": (TORCH, DISTRIBUTED),
    "paradit.families.qwen_image.model": (DISTRIBUTED,),
    "paradit.families.qwen_image.presets": (DISTRIBUTED,),
    "paradit.families.qwen_image21.family": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.families.qwen_image21.latents": (TORCH, DISTRIBUTED),
    "paradit.families.sd3.family": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.families.sd3.latents": (TORCH, DISTRIBUTED),
    "paradit.families.sd3.model": (DISTRIBUTED,),
    "paradit.families.sd3.presets": (DISTRIBUTED,),
    "paradit.families.wan.family": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.families.wan.latents": (TORCH, DISTRIBUTED),
    "paradit.families.wan.model": (DISTRIBUTED,),
    "paradit.families.wan.presets": (DISTRIBUTED,),
    "paradit.families.zimage.family": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.families.zimage.latents": (TORCH, DISTRIBUTED),
    "paradit.families.zimage.model": (DISTRIBUTED,),
    "paradit.families.zimage.omni": (DISTRIBUTED,),
    "paradit.families.zimage.presets": (DISTRIBUTED,),
    "paradit.family": (MODEL_LIBRARIES, DISTRIBUTED),  # a record's model classes are imported when a run builds them
    "paradit.flags": (TORCH, DISTRIBUTED),  # the command line builds its parser before torch loads
    "paradit.fp8_checkpoint": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.hub": (TORCH, DISTRIBUTED),  # a refusal of an unreachable hub answers at once
    "paradit.layers": (DISTRIBUTED,),  # plain single-device math, as every module of the package
    "paradit.layers.attention": (DISTRIBUTED,),
    "paradit.layers.embeddings": (DISTRIBUTED,),
    "paradit.layers.feedforward": (DISTRIBUTED,),
    "paradit.layers.fp8": (DISTRIBUTED,),
    "paradit.layers.fp8_attention": (DISTRIBUTED,),
    "paradit.layers.modulation": (DISTRIBUTED,),
    "paradit.layers.rotary": (DISTRIBUTED,),
    "paradit.layers.semantic_permutation": (DISTRIBUTED,),
    "paradit.layers.sparse_attention": (DISTRIBUTED,),
    "paradit.layers.sparse_masks": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.layers.stages": (DISTRIBUTED,),
    "paradit.lora.adapters": (DISTRIBUTED,),
    "paradit.lora.apply": (DISTRIBUTED,),
    "paradit.lora.refs": (TORCH,),  # `generate --server` parses adapters too
    "paradit.lora.variants": (DISTRIBUTED,),
    "paradit.machine": (DISTRIBUTED,),
    "paradit.memory": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.offline_tokenizer": (DISTRIBUTED,),
    "paradit.options": (TORCH, DISTRIBUTED),  # every option's declaration, read before anything heavy
    "paradit.outputs": (TORCH,),
    "paradit.parallel.config": (DISTRIBUTED,),  # the command line reads it before any process group exists
    "paradit.parallel.tensor_plan": (MODEL_LIBRARIES, DISTRIBUTED),  # the records' sharding, as data: no collectives
    "paradit.parallel.transport": (DISTRIBUTED,),
    "paradit.parallel.validate": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.pipelines.inpainting": (DISTRIBUTED,),
    "paradit.pipelines.requests": (DISTRIBUTED,),
    "paradit.planner": (DISTRIBUTED,),  # no module of the planner but the probe
    "paradit.planner.choose": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.planner.command": (DISTRIBUTED,),
    "paradit.planner.cost": (DISTRIBUTED,),
    "paradit.planner.facts": (DISTRIBUTED,),
    "paradit.planner.measurements": (DISTRIBUTED,),
    "paradit.planner.plan": (DISTRIBUTED,),
    "paradit.planner.profile": (DISTRIBUTED,),
    "paradit.planner.report": (DISTRIBUTED,),
    "paradit.planner.tuned": (DISTRIBUTED,),
    "paradit.quantize": (DISTRIBUTED,),
    "paradit.request": (TORCH,),  # the command line reads its limits before anything heavy loads
    "paradit.serving": (DISTRIBUTED,),  # no module of the server
    "paradit.serving.client": (TORCH, DISTRIBUTED),  # the standard library only: the command answers at once
    "paradit.serving.jobs": (TORCH, DISTRIBUTED),
    "paradit.serving.launch": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.serving.media": (TORCH, DISTRIBUTED),
    "paradit.serving.metrics": (TORCH, DISTRIBUTED),
    "paradit.serving.pace": (DISTRIBUTED,),
    "paradit.serving.scheduler": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.serving.schemas": (TORCH, DISTRIBUTED),
    "paradit.serving.server": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.serving.store": (TORCH, DISTRIBUTED),
    "paradit.serving.videos": (TORCH, DISTRIBUTED),
    "paradit.settings": (MODEL_LIBRARIES, DISTRIBUTED),
    "paradit.spec": (DISTRIBUTED,),
    "paradit.text_encoder": (DISTRIBUTED,),
    "paradit.weights": (DISTRIBUTED,),
    "paradit.worker": (TORCH,),  # a spawned worker sets up its signals and lifeline before importing torch
}
# Importing each in turn, one interpreter: the first import after which one of the libraries is loaded loaded it.
LOADS = """
import importlib, json, sys

modules, libraries = json.loads(sys.argv[1])
for module in modules:
    importlib.import_module(module)
    if any(library in sys.modules for library in libraries):
        print(module)
        break
"""
# Every family's tiny preset settled on the CPU and a text request resolved; a family without one resolves a request
# for its first preset. The libraries then loaded.
SETTLES = """
import json, sys

from paradit.families import FAMILIES, PRESETS
from paradit.request import GenerationRequest
from paradit.settings import Asked, settle

for name, family in FAMILIES.items():
    presets = [spec for spec in PRESETS.values() if spec.family == name]
    tiny = [spec for spec in presets if spec.name.endswith("-tiny")]
    if tiny:
        settle(Asked(model=tiny[0].name, device="cpu")).resolve(GenerationRequest(prompt="a"))
    else:
        family.resolve_request(presets[0], GenerationRequest(prompt="a"))
print(json.dumps([library for library in json.loads(sys.argv[1]) if library in sys.modules]))
"""


def paths_by_module() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def names_torch_distributed(tree: ast.Module) -> list[int]:
    """The lines of ``tree``'s imports, anywhere in it, that name torch.distributed: by statement, or by a string
    (outside docstrings) that ``import_module`` could be given."""
    prose = docstrings(tree)

    def distributed(name: str) -> bool:
        return name == DISTRIBUTED or name.startswith(DISTRIBUTED + ".")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(distributed(alias.name) for alias in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if distributed(node.module) or any(distributed(f"{node.module}.{a.name}") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if distributed(node.value):
                lines.append(node.lineno)
    return sorted(lines)


def first_loading(modules: list[str], libraries: tuple[str, ...]) -> str:
    """The first of ``modules``, imported in turn in a fresh interpreter, after which one of ``libraries`` is loaded."""
    done = subprocess.run(
        [sys.executable, "-c", LOADS, json.dumps([modules, libraries])],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_import_rules_name_modules_that_exist():
    assert set(IMPORT_RULES) <= set(paths_by_module())
    assert {rule for rules in IMPORT_RULES.values() for rule in rules} == {TORCH, MODEL_LIBRARIES, DISTRIBUTED}


@pytest.mark.parametrize("rule", [TORCH, MODEL_LIBRARIES])
def test_no_module_bound_to_load_none_of_a_rules_libraries_loads_them(rule):
    modules = [module for module, rules in IMPORT_RULES.items() if rule in rules]
    loading = first_loading(modules, LOADED_MODULES[rule])
    assert loading == "", f"importing {loading} loads {', '.join(LOADED_MODULES[rule])}"


def test_settling_a_run_and_resolving_its_request_loads_no_model_library():
    """What a server's front and the command line do before any pipeline is built, for every family."""
    libraries = LOADED_MODULES[MODEL_LIBRARIES]
    done = subprocess.run(
        [sys.executable, "-c", SETTLES, json.dumps(libraries)], cwd=PACKAGE.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_no_module_bound_to_leave_torch_distributed_alone_imports_it():
    paths = paths_by_module()
    found = [
        f"{paths[module].relative_to(PACKAGE.parent)}:{line}"
        for module, rules in IMPORT_RULES.items()
        if DISTRIBUTED in rules
        for line in names_torch_distributed(ast.parse(paths[module].read_text()))
    ]
    assert not found, "imports of torch.distributed: " + ", ".join(found)


def test_every_rule_a_docstring_still_states_is_in_the_table():
    """Prose may say a rule, but only the table holds it: a docstring's "must not import torch" (or torch.distributed)
    has its row."""
    stated = re.compile(r"must not import (torch\.distributed|torch)\b", re.IGNORECASE)
    missing = [
        f"{module}: {rule}"
        for module, path in paths_by_module().items()
        for rule in stated.findall(" ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split()))
        if rule.lower() not in IMPORT_RULES.get(module, ())
    ]
    assert not missing, "rules stated but not in IMPORT_RULES: " + ", ".join(missing)


def test_the_rule_checks_find_what_they_look_for():
    tree = ast.parse(
        '"""torch.distributed in prose."""\nimport torch\ndef f():\n    import torch.distributed as dist\n'
    )
    assert names_torch_distributed(tree) == [4]
    tree = ast.parse(
        'from torch import distributed\nfrom torch.distributed.tensor import DTensor\nX = "torch.distributed"\n'
    )
    assert names_torch_distributed(tree) == [1, 2, 3]
    assert first_loading(["paradit.errors", "paradit.layers.rotary"], LOADED_MODULES[TORCH]) == "paradit.layers.rotary"
    libraries = LOADED_MODULES[MODEL_LIBRARIES]
    assert first_loading(["paradit.settings", "paradit.loader"], libraries) == "paradit.loader"
