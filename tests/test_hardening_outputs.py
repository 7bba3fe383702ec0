"""Every output is checked before the work and written whole or not at all; ordinary conditions (a full disk, a
closed pipe, a mistyped hub id or server URL, an unreachable hub) are one line, never an internal error."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import constants
from PIL import Image
from safetensors import SafetensorError
from safetensors.torch import load_file

import paradit.fp8_checkpoint
import paradit.loader
import paradit.runtime
import paradit.weights
from paradit.download import human_size
from tests.checkpoint_cache import copy_of
from tests.test_cli import assert_one_line_error, run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--steps", "1", "--height", "32", "--width", "32", "--no-progress"]
FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def generate(model: str, out: Path | str, *flags: str) -> list[str]:
    return ["generate", "--model", model, "--prompt", "a lighthouse", *TINY, "--out", str(out), *flags]


def listing(folder: Path) -> list[str]:
    """Every path under ``folder``, hidden ones included: what a failure left behind."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def fill_the_disk_after(limit: int):
    """A writer that writes ``limit`` bytes of what it is given, then finds the disk full."""

    def write(self: Path, data, *args, **kwargs) -> int:
        with open(self, "wb") as file:
            file.write((data.encode() if isinstance(data, str) else data)[:limit])
        raise FULL

    return write


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("the work started before its output was checked")

    monkeypatch.setattr(paradit.loader, "load_pipeline", refuse)
    monkeypatch.setattr(paradit.runtime, "load_transformer", refuse)  # what the conversion imports when it starts


@pytest.mark.parametrize(
    "record,fragment",
    [
        ("/proc/run.json", "/proc is not a folder paradit can write to"),
        ("{tmp}", "is a folder; give a file name"),
        ("{tmp}/", "is a folder; give a file name"),
    ],
)
def test_an_unwritable_json_path_is_refused_before_anything_loads(record, fragment, tmp_path, capsys, nothing_loads):
    argv = generate("flux2-tiny", tmp_path / "x.png", "--json", record.format(tmp=tmp_path))
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "--json", fragment)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("out", ["x.png", "x.jpg", "x.webp"])
def test_a_full_disk_leaves_no_half_written_image(out, tmp_path, capsys, monkeypatch):
    def save(image, target, *args, **kwargs):
        Path(target).write_bytes(b"\x89PNG" + bytes(8188))  # the 8 KiB PIL had written when the disk filled up
        raise FULL

    monkeypatch.setattr(Image.Image, "save", save)
    code, _, err = run_cli(generate("flux2-tiny", tmp_path / out), capsys)
    assert_one_line_error(code, err, f"cannot write {tmp_path / out}: No space left on device")
    assert listing(tmp_path) == []


def test_a_full_disk_leaves_no_half_written_video_or_frame(tmp_path, capsys, monkeypatch):
    args = ["--frames", "5"]
    monkeypatch.setattr(Path, "write_bytes", fill_the_disk_after(8192))
    code, _, err = run_cli(generate("wan-tiny", tmp_path / "v.mp4", *args), capsys)
    assert_one_line_error(code, err, f"cannot write {tmp_path / 'v.mp4'}: No space left on device")
    assert listing(tmp_path) == []

    monkeypatch.undo()
    saved = []
    original = Image.Image.save

    def save(image, target, *args, **kwargs):  # the third frame meets the full disk
        if len(saved) == 2:
            Path(target).write_bytes(bytes(100))
            raise FULL
        saved.append(target)
        original(image, target, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save)
    code, _, err = run_cli(generate("wan-tiny", f"{tmp_path / 'frames'}/", *args), capsys)
    assert_one_line_error(code, err, f"cannot write {tmp_path / 'frames' / '0002.png'}: No space left on device")
    assert listing(tmp_path) == ["frames", "frames/0000.png", "frames/0001.png"]  # whole frames only
    for name in ("0000.png", "0001.png"):
        with Image.open(tmp_path / "frames" / name) as frame:
            frame.load()


def test_a_full_disk_leaves_no_half_written_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Path, "write_text", fill_the_disk_after(100))
    code, _, err = run_cli(generate("flux2-tiny", tmp_path / "x.png", "--json", str(tmp_path / "run.json")), capsys)
    assert_one_line_error(code, err, f"cannot write {tmp_path / 'run.json'}: No space left on device")
    assert listing(tmp_path) == ["x.png"]  # the image is whole; the record is not there at all

    monkeypatch.undo()
    code, _, err = run_cli(generate("flux2-tiny", tmp_path / "x.png", "--json", str(tmp_path / "run.json")), capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "run.json").read_text())["files"] == [str(tmp_path / "x.png")]
    assert listing(tmp_path) == ["run.json", "x.png"]  # nothing temporary stays beside a written output


@pytest.fixture
def source(klein_checkpoint, tmp_path) -> Path:
    """A checkpoint of its own, so that one written into it by mistake would not reach the shared cache."""
    return copy_of(klein_checkpoint, tmp_path / "source")


def quantize(source: Path, out: Path | str) -> list[str]:
    return ["quantize", "--model", str(source), "--out", str(out)]


@pytest.mark.parametrize(
    "out,fragment",
    [
        ("file", "is a file; give a new folder"),
        ("full", "is not empty; give a new folder"),
        ("/proc/fp8", "/proc is not a folder paradit can write to"),
        ("source/fp8", "is inside the checkpoint it quantizes; give a folder outside"),
        ("source/vae/fp8", "is inside the checkpoint it quantizes"),
    ],
)
def test_quantize_refuses_an_out_it_cannot_write_before_any_work(out, fragment, source, tmp_path, capfd, nothing_loads):
    (tmp_path / "file").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    before = listing(source)
    code, _, err = run_cli(quantize(source, tmp_path / out), capfd)
    assert_one_line_error(code, err, "--out", fragment)
    assert listing(source) == before


def test_quantize_refuses_a_disk_without_room_for_the_checkpoint(source, tmp_path, capfd, monkeypatch):
    """The room it needs is the FP8 transformer's, converted on the meta device: the bytes it then writes."""
    for model in (str(source), "flux2-tiny"):
        with monkeypatch.context() as patch:
            patch.setattr(paradit.fp8_checkpoint.shutil, "disk_usage", lambda path: SimpleNamespace(free=100_000))
            code, _, err = run_cli(["quantize", "--model", model, "--out", str(tmp_path / "fp8")], capfd)
        line = assert_one_line_error(code, err, f"--out {tmp_path / 'fp8'} needs ", f"; {tmp_path} has 97.66 KiB free")
        code, _, err = run_cli(["quantize", "--model", model, "--out", str(tmp_path / "fp8")], capfd)
        assert code == 0, err
        files = (tmp_path / "fp8" / "transformer").glob("*.safetensors")
        written = sum(tensor.nbytes for file in files for tensor in load_file(file).values())
        assert f"needs {human_size(written)};" in line
        shutil.rmtree(tmp_path / "fp8")


def test_quantize_into_a_full_disk_leaves_nothing_and_a_rerun_succeeds(source, tmp_path, capfd, monkeypatch):
    out = tmp_path / "models" / "fp8"
    out.parent.mkdir()

    def full_at_the_shard(state, path, *args, **kwargs):
        Path(path).write_bytes(bytes(8192))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def another_disk(source, target, *args, **kwargs):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    def full_at_a_copy(source, target, *args, **kwargs):
        Path(target).write_bytes(bytes(100))
        raise FULL

    for fill in ("shard", "copy"):
        with monkeypatch.context() as patch:
            if fill == "shard":
                patch.setattr(paradit.weights, "save_file", full_at_the_shard)
            else:  # the components are copied, not linked
                patch.setattr(os, "link", another_disk)
                patch.setattr(paradit.fp8_checkpoint.shutil, "copy2", full_at_a_copy)
            code, _, err = run_cli(quantize(source, out), capfd)
        assert_one_line_error(code, err, f"cannot write {out}: ", "No space left on device")
        assert listing(out.parent) == []
    code, _, err = run_cli(quantize(source, out), capfd)
    assert code == 0, err
    assert listing(out.parent)[0] == "fp8" and not any(name.startswith(".") for name in listing(out.parent))
    assert json.loads((out / "transformer" / "config.json").read_text())["quantization_config"]["modules"]


def test_a_closed_pipe_ends_the_output_quietly(tmp_path):
    """``paradit models | head -1``: once the reader is gone, paradit stops as commands killed by SIGPIPE do."""
    reader, writer = os.pipe()
    os.close(reader)
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where a trace file would be written
    proc = subprocess.run(
        [sys.executable, "-m", "paradit", "models"],
        cwd=REPO_ROOT,
        stdout=writer,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=60,
    )
    os.close(writer)
    assert (proc.returncode, proc.stderr) == (141, "")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("model", ["org/..", "org/-name", "org/na--me", "org/name.", "o" * 97 + "/x"])
def test_download_refuses_an_invalid_hub_id_in_one_line(model, capsys, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # never asked: the id is checked first
    code, _, err = run_cli(["download", model], capsys)
    assert_one_line_error(code, err, f"{model!r} is not a hub id (org/name): ")


def test_an_unreachable_hub_is_one_line(tmp_path):
    """huggingface_hub retries five times, warning twice for each (its own handler and paradit's): one line says it."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = "import time; time.sleep = lambda s: None; from paradit.cli import main; raise SystemExit(main())"
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", script, "download", "org/name"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"paradit: error: could not reach the hub at http://127.0.0.1:{port}\n"


@pytest.mark.parametrize(
    "server",
    ["notaurl", "localhost:8000", "ftp://host:21", "http://", "http://host:port", "http://host:99999", "http://host:0"],
)
def test_server_must_be_a_url_of_host_and_port(server, tmp_path, capsys):
    code, _, err = run_cli(["generate", "--prompt", "x", "--server", server, "--out", str(tmp_path / "x.png")], capsys)
    assert_one_line_error(code, err, f"--server {server} is not a server URL; give http://host:port")
    assert listing(tmp_path) == []
