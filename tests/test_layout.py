"""The layout rules, checked on the source: everything about a model family lives in its folder under
``paradit/families/`` (the registry there is the only other place that names families), and no family pipeline
names a parallel strategy (the runtime hands pipelines what they need)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "paradit"
FAMILY_NAME = re.compile(r"flux|qwen[_-]?image|z[_-]?image|sd3|stable[_-]?diffusion|\bwan\b|wan2", re.IGNORECASE)
STRATEGY_NAME = re.compile(r"ulysses|\bring\b|pipefusion|tensor[_ ]parallel|paradit\.parallel|sequence[_ ]parallel")


def code_words(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every name, imported module and string literal of ``path`` that is code: docstrings and
    comments, which may explain with examples, are left out."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(first.lineno)
        if isinstance(node, ast.ImportFrom) and node.module:
            words.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            words.extend((node.lineno, alias.name) for alias in node.names)
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.NAME or (token.type == tokenize.STRING and token.start[0] not in docstrings):
            words.append((token.start[0], token.string))
    return words


def test_no_family_is_named_outside_its_folder_and_the_registry():
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {word}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "families" not in path.relative_to(PACKAGE).parts
        for line, word in code_words(path)
        if FAMILY_NAME.search(word)
    ]
    assert not found, "family names outside paradit/families/:\n" + "\n".join(found)


def test_no_family_pipeline_names_a_parallel_strategy():
    pipelines = sorted((PACKAGE / "families").glob("*/pipeline.py"))
    assert len(pipelines) >= 4
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {word}"
        for path in pipelines
        for line, word in code_words(path)
        if STRATEGY_NAME.search(word)
    ]
    assert not found, "strategy names in family pipelines:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for():
    """The patterns are not vacuous: they catch the names they are meant to catch."""
    assert FAMILY_NAME.search("Flux2Transformer") and FAMILY_NAME.search("z-image-turbo")
    assert FAMILY_NAME.search("QwenImagePipeline") and FAMILY_NAME.search("sd3.5-large")
    assert STRATEGY_NAME.search("ulysses_group") and FAMILY_NAME.search("Trust") is None
    words = [word for _, word in code_words(PACKAGE / "families" / "flux2" / "pipeline.py")]
    assert any(FAMILY_NAME.search(word) for word in words)
    assert any(STRATEGY_NAME.search(word) for word in words) is False and "paradit.pipelines.base" in words
    assert any(STRATEGY_NAME.search(word) for _, word in code_words(PACKAGE / "parallel" / "parallelize.py"))
