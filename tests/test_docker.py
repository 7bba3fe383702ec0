"""The container recipes, read as text (no Docker daemon here): pinned vendor bases, no secret built in, the CLI as
entrypoint, the install ``make`` runs, the hub cache as a volume."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Dockerfile -> (the vendor's PyTorch image, its tag with exact versions; the last group is the torch version)
BASES = {
    "Dockerfile.cuda": ("pytorch/pytorch", r"(\d+\.\d+\.\d+)-cuda\d+\.\d+-cudnn\d+-(?:runtime|devel)"),
    "Dockerfile.rocm": ("rocm/pytorch", r"rocm\d+(?:\.\d+)+_ubuntu\d+\.\d+_py3\.\d+_pytorch_release_(\d+\.\d+\.\d+)"),
}
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)
HUB_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined and comment lines dropped."""
    logical, pending = [], ""
    for line in (REPO_ROOT / "docker" / name).read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line
        if pending.strip():
            keyword, _, arguments = pending.strip().partition(" ")
            logical.append((keyword.upper(), " ".join(arguments.split())))
        pending = ""
    return logical


def arguments(name: str, keyword: str) -> list[str]:
    return [args for kind, args in instructions(name) if kind == keyword]


def pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


@pytest.mark.parametrize("name", BASES)
def test_base_is_the_vendors_pytorch_image_pinned_by_an_exact_tag(name):
    (image,) = arguments(name, "FROM")  # one stage, one base
    repository, _, tag = image.partition(":")
    vendor, tag_pattern = BASES[name]
    assert repository == vendor
    match = re.fullmatch(tag_pattern, tag)
    assert match, f"{name}: {image!r} is not pinned to an exact version tag"
    # pip keeps the image's torch only when it already satisfies paradit's requirement.
    (requirement,) = [dep for dep in pyproject()["project"]["dependencies"] if re.match(r"torch\b", dep)]
    minimum = re.fullmatch(r"torch>=([\d.]+)", requirement).group(1)
    assert version(match.group(1)) >= version(minimum), f"{name}: torch {match.group(1)} < {minimum}"


@pytest.mark.parametrize("name", BASES)
def test_no_token_or_key_is_built_into_the_image(name):
    text = (REPO_ROOT / "docker" / name).read_text()
    assert not HUB_TOKEN.search(text)
    for keyword in ("ARG", "ENV"):
        for args in arguments(name, keyword):
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split()[0]]
            assert not [n for n in names if SECRET_NAME.search(n)], f"{name}: {keyword} {args}"
    for args in arguments(name, "RUN"):
        assert not re.search(r"\b(hf auth|huggingface-cli) login\b", args), f"{name} logs in at build time"
    for args in arguments(name, "COPY") + arguments(name, "ADD"):
        assert "token" not in args.lower() and ".cache/huggingface" not in args, f"{name} copies credentials"


@pytest.mark.parametrize("name", BASES)
def test_entrypoint_is_the_installed_paradit_cli(name):
    (entrypoint,) = arguments(name, "ENTRYPOINT")
    command = json.loads(entrypoint)  # exec form: signals reach paradit, which stops its workers on SIGTERM
    assert command == ["paradit"]
    assert "paradit" in pyproject()["project"]["scripts"]


@pytest.mark.parametrize("name", BASES)
def test_install_step_is_the_one_make_runs_keeping_the_vendor_torch(name):
    make_installs = re.findall(r'pip install (?:-q )?-e "\.\[([\w,]+)\]"', (REPO_ROOT / "Makefile").read_text())
    assert len(make_installs) == 1, "the Makefile's install of the repository changed: update this test"
    installs = [
        shlex.split(step)
        for args in arguments(name, "RUN")
        for step in args.split("&&")
        if re.match(r"\s*(python -m )?pip install\b", step)
    ]
    assert len(installs) == 1, f"{name}: one pip install of the repository"
    (install,) = installs
    assert f".[{make_installs[0]}]" in install, f"{name}: the extras differ from the Makefile's"
    assert not [word for word in install if re.match(r"torch\b", word)], f"{name} installs a torch of its own"
    assert "--constraint" in install, f"{name}: the image's torch is not held"
    (constraint_file,) = [install[i + 1] for i, word in enumerate(install) if word == "--constraint"]
    assert any(f"version('torch'))\" > {constraint_file}" in args for args in arguments(name, "RUN"))


@pytest.mark.parametrize("name", BASES)
def test_hub_cache_is_a_volume_and_paradit_runs_unprivileged(name):
    env = dict(re.findall(r"([A-Za-z_]\w*)=(\S+)", " ".join(arguments(name, "ENV"))))
    (volume,) = arguments(name, "VOLUME")
    assert env["HF_HOME"] in json.loads(volume)
    kinds = [kind for kind, _ in instructions(name)]
    users = [args for kind, args in instructions(name) if kind == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{name} runs as root"
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")


def test_the_two_images_differ_only_in_their_base():
    def without_base(name: str) -> list[tuple[str, str]]:
        return [step for step in instructions(name) if step[0] != "FROM"]

    assert without_base("Dockerfile.cuda") == without_base("Dockerfile.rocm")


def test_dockerignore_keeps_the_virtualenv_and_version_control_out_of_the_context():
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git"} <= ignored
