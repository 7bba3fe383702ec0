"""The one front door (issue 49): every refusal made by ``settle`` before any worker starts (each row of
``options.CONFLICTS`` and each family rule, on the command line's path), one resolution of each request on every
path, and ``paradit plan`` printing the command that runs what it settled, for every preset on 1, 2 and 4 GPUs of
each hardware profile and on 2 and 4 CPU processes."""

from __future__ import annotations

import dataclasses
import re
import shlex
from types import SimpleNamespace

import httpx
import pytest

from paradit import Engine, GenerationRequest
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, PRESETS
from paradit.lora.refs import LoraRef, LoraSet
from paradit.machine import Machine
from paradit.options import CONFLICTS, Asked, ExecutionOptions, check_conflicts
from paradit.parallel import ParallelConfig
from paradit.planner.command import run_command
from paradit.planner.profile import all_profiles, load_profile
from paradit.request import SparseAttentionConfig
from paradit.settings import settle
from tests.test_cli import assert_one_line_error, run_cli
from tests.test_flux2_klein_kv import folder as kv_folder
from tests.test_flux2_klein_kv import picture
from tests.test_serving import live_server

EIGHT_GPUS = Machine(8, load_profile("h200-nvlink"), virtual=True)
TINY = ["--model", "flux2-tiny", "--prompt", "a fox", "--height", "32", "--width", "32", "--steps", "1"]
VIDEO = [
    "--model",
    "wan-tiny",
    "--prompt",
    "a boat",
    "--height",
    "32",
    "--width",
    "32",
    "--frames",
    "5",
    "--steps",
    "1",
]
# A command line that meets each row of CONFLICTS, on a machine of eight H200s (``no_workers``).
CONFLICTING = {
    "graphs with pipefusion": ["generate", *TINY, "--cuda-graphs", "--pipefusion", "2"],
    "sharded weights with graphs or swapped experts": [
        "generate",
        *TINY,
        "--ulysses",
        "2",
        "--shard-weights",
        "2",
        "--swap-experts",
    ],
    "graphs off a GPU": ["generate", *TINY, "--device", "cpu", "--cuda-graphs"],
    "graphs with swapped experts": ["generate", *TINY, "--cuda-graphs", "--swap-experts"],
    "exact attention steps without FP8 attention": ["generate", *TINY, "--attention-bf16-steps", "2"],
    "FP8 attention with graphs": ["generate", *TINY, "--attention", "fp8", "--cuda-graphs"],
    "graphs with switchable adapters as side paths": [
        "serve",
        "--model",
        "flux2-tiny",
        "--port",
        "0",
        "--lora",
        "style=style.safetensors",
        "--cuda-graphs",
    ],
    "fused adapter choices with swapped experts": [
        "serve",
        "--model",
        "flux2-tiny",
        "--port",
        "0",
        "--lora",
        "style=style.safetensors",
        "--lora-cache",
        "2",
        "--swap-experts",
    ],
    "step caching with pipefusion": ["generate", *TINY, "--cache", "first-block", "--pipefusion", "2"],
    "step caching with graphs": ["generate", *TINY, "--cache", "first-block", "--cuda-graphs"],
    "sparse attention parameters it does not read": ["generate", *VIDEO, "--sparse-decay-factor", "0.5"],
    "sparse attention on images": ["generate", *TINY, "--sparse-attention", "radial"],
    "sparse attention with pipefusion": ["generate", *VIDEO, "--sparse-attention", "radial", "--pipefusion", "2"],
    "svg2 with ring": ["generate", *VIDEO, "--sparse-attention", "svg2", "--ring", "2"],
    "sparse attention with graphs": ["generate", *VIDEO, "--sparse-attention", "radial", "--cuda-graphs"],
}
# Rows no command line meets (a server takes no parallel flags): asked through the Python API.
SERVED = LoraSet((LoraRef("style.safetensors", name="style"),), (), "unfused", switchable=True, cache=2)
ASKED = {
    "fused adapter choices with sharded weights": Asked(
        "flux2-tiny", parallel=ParallelConfig(ulysses=2, shard_weights=2), options=ExecutionOptions(lora=SERVED)
    ),
}
# Rows only a request's own field meets (a server's run was settled before it came): checked against the request.
REQUESTED = {
    "svg2 per request on a run planned without it": (
        ExecutionOptions(sparse_attention="radial"),
        SimpleNamespace(frames=5, cache=None, sparse_attention=SparseAttentionConfig("svg2")),
    ),
}


@pytest.fixture
def no_workers(monkeypatch):
    """A machine of eight H200s where starting a worker or a pipeline fails the test (the forkserver, which loads
    no model and which the command line starts early so that its imports overlap the checks, does not start)."""

    def started(*args, **kwargs):
        raise AssertionError("a worker or pipeline started before the refusal")

    for name in ("paradit.engine.WorkerGroup", "paradit.loader.build_pipeline"):
        monkeypatch.setattr(name, started)
    monkeypatch.setattr("paradit.cli.start_worker_server", lambda device: None)
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: EIGHT_GPUS))


def test_the_table_has_a_case_for_every_row():
    assert {conflict.name for conflict in CONFLICTS} == CONFLICTING.keys() | ASKED.keys() | REQUESTED.keys()


@pytest.mark.parametrize("conflict", CONFLICTS, ids=lambda conflict: conflict.name)
def test_every_conflict_is_refused_before_a_worker_starts(conflict, no_workers, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if conflict.name in ASKED:
        with pytest.raises(InvalidRequest, match=conflict.message.replace("(", r"\(").replace(")", r"\)")):
            settle(ASKED[conflict.name], machine=EIGHT_GPUS)
        return
    if conflict.name in REQUESTED:
        options, request = REQUESTED[conflict.name]
        with pytest.raises(InvalidRequest, match=re.escape(conflict.message)):
            check_conflicts(ParallelConfig(), options, "cuda", request)
        return
    code, _, err = run_cli(CONFLICTING[conflict.name], capsys)
    assert_one_line_error(code, err, conflict.message)
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_family_rule_is_refused_before_a_worker_starts(no_workers, capsys, tmp_path):
    """FLUX.2 KV's cached references under Ulysses were refused once the workers had loaded."""
    reference = tmp_path / "reference.png"
    picture(64, 80, 0).save(reference)
    argv = [
        "generate",
        "--model",
        str(kv_folder()),
        "--device",
        "cpu",
        "--prompt",
        "a fox",
        "--image",
        str(reference),
        "--ulysses",
        "2",
        "--out",
        str(tmp_path / "x.png"),
    ]
    capsys.readouterr()  # drop the checkpoint build's progress bars, printed when this test builds the cached folder
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "--ulysses")
    assert not (tmp_path / "x.png").exists()


@pytest.fixture
def resolutions(monkeypatch) -> list[str]:
    """The prompts of every request resolved in this process, as each family resolves one."""
    resolved = []
    for name, family in list(FAMILIES.items()):

        def counting(spec, request, resolve=family.resolve_request):
            resolved.append(request.prompt)
            return resolve(spec, request)

        monkeypatch.setitem(FAMILIES, name, dataclasses.replace(family, resolve_request=counting))
    return resolved


@pytest.mark.parametrize("plan", [[], ["--gpus", "2"]], ids=["1 process", "2 workers"])
def test_the_command_line_resolves_its_request_once(plan, resolutions, capsys, tmp_path):
    argv = ["generate", *TINY, "--device", "cpu", "--seed", "random", "--out", str(tmp_path / "x.png"), *plan]
    code, out, err = run_cli([*argv[:4], "count me", *argv[5:]], capsys)
    assert code == 0, err
    assert resolutions.count("count me") == 1


def test_the_python_api_the_server_and_plan_resolve_each_request_once(resolutions, capsys):
    Engine("flux2-tiny", device="cpu").generate(GenerationRequest(prompt="from python", steps=1, height=32, width=32))
    assert resolutions.count("from python") == 1
    with live_server("flux2-tiny") as (url, _):
        body = {"prompt": "over http", "size": "32x32", "steps": 1}
        assert httpx.post(url + "/v1/images/generations", json=body, timeout=120).status_code == 200
    assert resolutions.count("over http") == 1
    code, _, err = run_cli(["plan", "--model", "flux2-tiny", "--gpus", "2", "--height", "64", "--width", "64"], capsys)
    assert code == 0, err
    assert resolutions.count("a plan") == 1


def agreement_cases():
    for profile in sorted(all_profiles()):
        for gpus in (1, 2, 4):
            yield profile, gpus
    yield None, 2
    yield None, 4


def settled(asked: Asked, machine: Machine):
    """The settings, or the refusal with its numbers left out (a CPU's memory available moves between two calls)."""
    try:
        return settle(asked, machine=machine)
    except InvalidRequest as refused:
        return re.sub(r"[0-9.]+ GiB", "N GiB", str(refused))


@pytest.mark.parametrize("profile,gpus", list(agreement_cases()), ids=lambda value: str(value))
def test_plan_prints_the_command_that_runs_what_it_settled(profile, gpus):
    """For every preset: the "Run it" line ``paradit plan`` prints, run by ``generate``'s parser and ``settle``,
    settles to the plan, options and placement ``plan`` settled (or both refuse it alike)."""
    from paradit.cli import asked_for, build_parser

    machine = Machine(gpus, load_profile(profile), virtual=True) if profile else Machine.detect()
    device = "cpu" if profile is None else None
    for preset in PRESETS:
        asked = Asked(preset, device=device, load_format="dummy", gpus=gpus)
        planned = settled(asked, machine)
        if isinstance(planned, str):
            argv = ["generate", "--model", preset, "--gpus", str(gpus), "--prompt", "a"]
        else:
            argv = shlex.split(run_command(asked, planned))[1:]
        args = build_parser().parse_args(argv)
        again = settled(dataclasses.replace(asked_for(args, "generate"), load_format="dummy"), machine)
        if isinstance(planned, str):
            assert again == planned, (preset, argv)
        else:
            wanted = (planned.parallel, planned.options, planned.text_encoder_placement, planned.memory_plan)
            assert (again.parallel, again.options, again.text_encoder_placement, again.memory_plan) == wanted, argv
