"""GPU smoke run of every ``paradit`` command-line option: each case runs ``python -m paradit ...`` end to end as its
own subprocess, with random full-size weights (``--load-format dummy``) and two steps, so that one crash, hang or
refusal is a failed row and the rest still run. Nothing here measures speed; the seconds are there to see what is
slow. A case passes when every command exits 0 and its output holds what the case expects (the ``wrote`` line, the
``--verify-serial`` verdict, the preset list).

Prints a table (case, exit code, pass/fail, seconds, command; the last stderr line under each failure) and writes
it as JSON to ``--json`` (default ``$OUT/smoke.json`` when ``OUT`` is set). Cases of two GPUs run when
``torch.cuda.device_count()`` is at least 2 and are skipped otherwise. ``--tiny`` maps every case to its family's
tiny preset on the CPU (processes joined by gloo for the multi-GPU plans), to check the script itself anywhere; the
cases only a GPU can run (FP8 kernels, CUDA graphs) are skipped there.

Each process builds its model and compiles its blocks (~20-45 s a case on one H200), so options that go together
share a case (FP8 linears with FP8 prompt encoders, compiled blocks with CUDA graphs, a batch with negative prompts)
to keep the one-GPU cases near 6 minutes; on two GPUs, run the groups as two calls of under 10 minutes each:

    python benchmarks/smoke.py --cases one-gpu      # on the GPU machine; --list names the cases
    python benchmarks/smoke.py --cases two-gpus --json /tmp/smoke2.json
    python benchmarks/smoke.py --tiny               # CPU, tiny presets
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The cheaper full-size presets: klein 4B for most options, SD3.5 medium (2.2B) where a case needs classifier-free
# guidance or writes an FP8 checkpoint folder (the quantize command runs on the CPU, so the smallest transformer),
# and Z-Image-Turbo for one option, so that each family but Qwen-Image (20B, the slowest to build) runs at full size.
KLEIN, CFG_MODEL, ZIMAGE = "flux2-klein-4b", "sd3.5-medium", "z-image-turbo"
TINY = {KLEIN: "flux2-tiny", CFG_MODEL: "sd3.5-tiny", ZIMAGE: "z-image-tiny"}
PROMPT = "a lighthouse on a cliff at dusk"
EQUALS = "image equals the 1-process image"  # what --verify-serial prints for an exact plan
WORK = "{work}"  # replaced by the run's scratch folder (images, the FP8 checkpoint)
GROUPS = {"one-gpu": 1, "two-gpus": 2}  # --cases names that select every case needing that many GPUs


@dataclass(frozen=True)
class Case:
    """``commands``: paradit argument lists run in order (the case stops at the first that fails); ``expect``: text
    the last command's stdout must hold; ``gpus``: GPUs the case needs; ``gpu_only``: refused on the CPU by design."""

    name: str
    commands: tuple[tuple[str, ...], ...]
    expect: str = "wrote "
    gpus: int = 1
    gpu_only: bool = False


def generate(name: str, *extra: str, model: str = KLEIN, dummy: bool = True) -> tuple[str, ...]:
    load = ("--load-format", "dummy") if dummy else ()
    return (
        "generate",
        "--model",
        model,
        *load,
        "--prompt",
        PROMPT,
        "--steps",
        "2",
        "--no-progress",
        "--out",
        f"{WORK}/{name}.png",
        *extra,
    )


def case(name: str, *extra: str, model: str = KLEIN, **fields) -> Case:
    return Case(name, (generate(name, *extra, model=model),), **fields)


# Two prompts, two images each, one negative prompt for all: the CFG batch a request can hold.
NEGATIVE_BATCH = ("--negative-prompt", "blurry", "--prompt", "a red fox in snow", "--images-per-prompt", "2")

CASES = [
    case("default"),  # on a GPU the blocks compile by default: this is --compile
    case("no-compile", "--no-compile"),
    case("compile-cuda-graphs", "--compile", "--cuda-graphs", gpu_only=True),
    case("quantize-fp8", "--quantize", "fp8", "--text-encoder-placement", "fp8", gpu_only=True),
    case("max-gpu-memory", "--max-gpu-memory", "32GiB"),
    case("text-encoder-offload", "--text-encoder-placement", "offload", model=ZIMAGE),
    case("negative-prompt-batch", *NEGATIVE_BATCH, model=CFG_MODEL),
    Case(
        "quantize-folder",
        (
            ("quantize", "--model", CFG_MODEL, "--load-format", "dummy", "--out", f"{WORK}/fp8-folder"),
            # The folder holds random FP8 weights already: no --load-format, the FP8 load path reads them.
            generate("quantize-folder", "--quantize", "fp8", model=f"{WORK}/fp8-folder", dummy=False),
        ),
        gpu_only=True,
    ),
    Case("models", (("models",),), expect=KLEIN),
    case("ulysses-2-verify-serial", "--gpus", "2", "--ulysses", "2", "--verify-serial", gpus=2, expect=EQUALS),
    case("ring-2", "--gpus", "2", "--ring", "2", gpus=2),
    case("cfg-parallel", "--gpus", "2", "--cfg-parallel", model=CFG_MODEL, gpus=2),
    case("tensor-2", "--gpus", "2", "--tensor", "2", gpus=2),
    case("pipefusion-2", "--gpus", "2", "--pipefusion", "2", "--patches", "2", "--warmup-steps", "1", gpus=2),
    case("comm-fp8", "--gpus", "2", "--ulysses", "2", "--comm-dtype", "fp8", gpus=2),
    case("max-gpu-memory-tensor-2", "--gpus", "2", "--tensor", "2", "--max-gpu-memory", "32GiB", gpus=2),
]


def resolve(command: tuple[str, ...], work: Path, tiny: bool, size: int) -> list[str]:
    """The argument list as run: the scratch folder filled in; for ``generate``, the device and size added (and under
    ``tiny`` the model swapped for its family's tiny preset on the CPU)."""
    argv = [arg.replace(WORK, str(work)) for arg in command]
    if tiny:
        argv = [TINY.get(arg, arg) for arg in argv]
    if argv[0] == "generate":
        argv += ["--device", "cpu" if tiny else "cuda", "--height", str(size), "--width", str(size)]
    return argv


def shell_line(commands: list[list[str]]) -> str:
    return " && ".join("paradit " + shlex.join(argv) for argv in commands)


def last_line(text: str) -> str:
    """The last non-empty line, progress bars' carriage returns counted as line breaks."""
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_command(argv: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Exit code (None on timeout), stdout and stderr of ``python -m paradit *argv``. It runs in its own session so
    that a timeout kills the worker processes it spawned as well."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "paradit", *argv],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err + f"\ntimed out after {timeout:.0f} s"


def run_case(case: Case, work: Path, args: argparse.Namespace, gpus: int) -> dict:
    commands = [resolve(command, work, args.tiny, args.size) for command in case.commands]
    row = {"case": case.name, "command": shell_line(commands)}
    if case.gpu_only and args.tiny:
        return {**row, "result": "skip", "note": "needs a GPU"}
    if case.gpus > gpus:
        return {**row, "result": "skip", "note": f"needs {case.gpus} GPUs, {gpus} here"}
    seconds = []
    for argv in commands:
        start = time.perf_counter()
        code, out, err = run_command(argv, args.timeout)
        seconds.append(round(time.perf_counter() - start, 1))
        if code != 0:
            break
    passed = code == 0 and case.expect in out
    row.update(
        exit_code=code, seconds=round(sum(seconds), 1), command_seconds=seconds, result="pass" if passed else "FAIL"
    )
    if not passed:
        row["note"] = last_line(err) if code != 0 else f"stdout lacks {case.expect!r}: {last_line(out)}"
    return row


def exit_cell(row: dict) -> str:
    if "exit_code" not in row:  # skipped
        return "-"
    return "timeout" if row["exit_code"] is None else str(row["exit_code"])


def print_rows(rows: list[dict]) -> None:
    headers = ("case", "exit", "result", "seconds", "command")
    cells = [headers] + [
        (row["case"], exit_cell(row), row["result"], str(row.get("seconds", "-")), row["command"]) for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers) - 1)]
    for line, row in zip(cells, [None, *rows]):
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1])
        if row is not None and row["result"] != "pass":
            print(f"    -> {row['note']}")


def environment(gpus: int) -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpu_count": gpus,
        "python": platform.python_version(),
    }


def selected(names: list[str] | None) -> list[Case]:
    if names is None:
        return CASES
    return [c for c in CASES if c.name in names or any(GROUPS.get(name) == c.gpus for name in names)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", nargs="+", choices=[*GROUPS, *(c.name for c in CASES)], help="run only these cases or groups"
    )
    parser.add_argument("--list", action="store_true", help="print the cases and their commands, run nothing")
    parser.add_argument("--tiny", action="store_true", help="the tiny presets on the CPU, to check the script itself")
    parser.add_argument("--size", type=int, help="image height and width (default 1024; 64 with --tiny)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per command before it is killed")
    parser.add_argument("--json", help="where to write the rows (default $OUT/smoke.json when OUT is set)")
    parser.add_argument("--work-dir", help="folder for the images and the FP8 checkpoint (default: a temporary one)")
    args = parser.parse_args()
    args.size = args.size or (64 if args.tiny else 1024)
    cases = selected(args.cases)
    if args.list:
        for c in cases:
            print(f"{c.name:<24} {shell_line([resolve(a, Path(WORK), args.tiny, args.size) for a in c.commands])}")
        return 0
    import torch

    # Under --tiny the multi-GPU plans run as CPU processes; the machine's cores stand in for the GPUs.
    gpus = 2 if args.tiny else torch.cuda.device_count()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="paradit-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for c in cases:
            rows.append(run_case(c, work, args, gpus))
            print(f"{c.name}: {rows[-1]['result']} {rows[-1].get('seconds', '')}", flush=True)
    finally:
        if args.work_dir is None:  # the FP8 folder of a full-size model is gigabytes
            shutil.rmtree(work, ignore_errors=True)
    print()
    print_rows(rows)
    json_path = args.json or (Path(os.environ["OUT"]) / "smoke.json" if "OUT" in os.environ else None)
    if json_path:
        payload = {"env": environment(0 if args.tiny else gpus), "tiny": args.tiny, "size": args.size, "rows": rows}
        Path(json_path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {json_path}")
    return 0 if all(row["result"] != "FAIL" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
