"""``paradit download`` and ``paradit models --local`` against a local stand-in of the Hugging Face hub (no network).

The stand-in answers the few requests huggingface_hub makes: the repository tree (paths, sizes, LFS ids), the
repository info, and ``resolve/`` for file metadata (HEAD) and bytes (GET, with Range). Gated repositories answer as
the hub does, with ``X-Error-Code: GatedRepo``.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import pytest
from huggingface_hub import constants, hf_hub_download

from paradit.checkpoint import check_components, resolve_checkpoint
from paradit.download import human_size
from paradit.families import PRESETS
from tests.test_cli import assert_one_line_error, run_cli

PRESET = "flux2-klein-4b"
REPO = PRESETS[PRESET].hub_id
MODEL_INDEX = {
    "_class_name": "Flux2KleinPipeline",
    "_diffusers_version": "0.37.0",
    "is_distilled": True,
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3ForCausalLM"],
    "tokenizer": ["transformers", "Qwen2TokenizerFast"],
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
    "image_encoder": [None, None],  # declared absent: nothing to fetch
}
SHARD = "transformer/diffusion_pytorch_model-00001-of-00002.safetensors"
# The loader reads these (sizes in bytes; the contents are random, each file different).
READS = {
    "model_index.json": None,
    "scheduler/scheduler_config.json": 310,
    "text_encoder/config.json": 720,
    "text_encoder/model.safetensors": 150_000,
    "tokenizer/chat_template.jinja": 400,
    "tokenizer/merges.txt": 5_000,
    "tokenizer/spiece.model": 3_000,
    "tokenizer/tokenizer.json": 9_000,
    "tokenizer/tokenizer_config.json": 600,
    "tokenizer/vocab.json": 7_000,
    "transformer/config.json": 500,
    "transformer/diffusion_pytorch_model.safetensors.index.json": 800,
    SHARD: 300_000,
    "transformer/diffusion_pytorch_model-00002-of-00002.safetensors": 200_000,
    "vae/config.json": 650,
    "vae/diffusion_pytorch_model.safetensors": 120_000,
}
# ... and not these: a root single-file checkpoint, pickle, Flax and ONNX copies, fp16 variants and their index,
# a component declared absent, a folder model_index.json does not list, the model card.
SKIPS = {
    "flux-2-klein-4b.safetensors": 400_000,
    "README.md": 2_000,
    "image_encoder/model.safetensors": 50_000,
    "unlisted/model.safetensors": 40_000,
    "text_encoder/pytorch_model.bin": 150_000,
    "text_encoder/pytorch_model.bin.index.json": 300,
    "text_encoder/flax_model.msgpack": 150_000,
    "text_encoder/model.fp16-00001-of-00002.safetensors": 75_000,
    "text_encoder/onnx/model.onnx": 150_000,
    "text_encoder/onnx/config.json": 700,
    "transformer/diffusion_pytorch_model.fp16.safetensors": 250_000,
    "transformer/diffusion_pytorch_model.safetensors.index.fp16.json": 800,
    "vae/diffusion_pytorch_model.bin": 120_000,
}


def pipeline_repo(seed: int = 0) -> dict[str, bytes]:
    draw = random.Random(seed)
    files = {path: file_bytes(path, size, draw) for path, size in {**READS, **SKIPS}.items() if size is not None}
    files["model_index.json"] = json.dumps(MODEL_INDEX).encode()
    return files


def file_bytes(path: str, size: int, draw: random.Random) -> bytes:
    """``size`` random bytes; a weights file's as one byte tensor behind its header, and a weights index naming its
    folder's shards, which the loader checks."""
    if path.endswith(".safetensors.index.json"):
        folder = path.rsplit("/", 1)[0]
        shards = sorted(s.rsplit("/", 1)[1] for s in READS if s.startswith(folder + "/") and "-of-" in s)
        return json.dumps({"weight_map": {f"tensor{i}": shard for i, shard in enumerate(shards)}}).ljust(size).encode()
    if not path.endswith(".safetensors"):
        return draw.randbytes(size)
    header_bytes = 128
    data = size - 8 - header_bytes
    header = json.dumps({"bytes": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}}).ljust(header_bytes)
    return header_bytes.to_bytes(8, "little") + header.encode() + draw.randbytes(data)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class HubStandIn:
    """Repositories by id (path -> bytes); which are gated and which tokens open them; faults to inject."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)
    granted_tokens: set[str] = field(default_factory=set)
    cut_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before the connection drops, once
    refuse_once: set[str] = field(default_factory=set)  # paths whose next GET answers 403
    requests: list[Request] = field(default_factory=list)
    endpoint: str = ""

    def fetched(self, repo_id: str) -> list[str]:
        """The files whose bytes were asked for (GET), in order."""
        prefix = f"/{repo_id}/resolve/"
        return [
            r.path[len(prefix) :].split("/", 1)[1]
            for r in self.requests
            if r.method == "GET" and r.path.startswith(prefix)
        ]

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # the tests read stderr: keep the server quiet
                pass

            def do_HEAD(self) -> None:
                self.answer(send_body=False)

            def do_GET(self) -> None:
                self.answer(send_body=True)

            def send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, send_body=True):
                self.send_response(status)
                for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                    self.send_header(name, value)
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def error(self, status: int, code: str, message: str, send_body: bool) -> None:
                self.send(status, message.encode(), {"X-Error-Code": code, "X-Error-Message": message}, send_body)

            def answer(self, send_body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(
                    Request(self.command, path, self.headers.get("Range"), self.headers.get("Authorization"))
                )
                api = path.startswith("/api/models/")
                parts = path.removeprefix("/api/models/" if api else "/").split("/")
                repo_id = "/".join(parts[:2])
                if repo_id not in hub.repos:
                    return self.error(404, "RepoNotFound", "Repository not found", send_body)
                files, commit = hub.repos[repo_id], hashlib.sha1(repo_id.encode()).hexdigest()
                if api and parts[2:3] == ["tree"]:
                    return self.send(200, json.dumps(tree(files)).encode(), {"Content-Type": "application/json"})
                if api:
                    info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": name} for name in files]}
                    return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
                filename = "/".join(parts[4:])  # org/name/resolve/<revision>/<path>
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                if repo_id in hub.gated and token not in hub.granted_tokens:
                    status = 403 if token else 401
                    return self.error(status, "GatedRepo", f"Access to model {repo_id} is restricted.", send_body)
                if filename not in files:
                    return self.error(404, "EntryNotFound", "Entry not found", send_body)
                if send_body and filename in hub.refuse_once:
                    hub.refuse_once.discard(filename)
                    return self.send(403, b"Forbidden for now", {"X-Error-Message": "Forbidden for now"})
                self.send_file(files[filename], filename, commit, send_body)

            def send_file(self, data: bytes, filename: str, commit: str, send_body: bool) -> None:
                etag = f'"{hashlib.sha256(data).hexdigest()}"'
                headers = {"X-Repo-Commit": commit, "ETag": etag, "Accept-Ranges": "bytes"}
                asked = self.headers.get("Range")
                if asked and send_body:
                    start = int(asked.removeprefix("bytes=").split("-")[0])
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                    return self.send(206, data[start:], headers)
                cut = hub.cut_after.pop(filename, None) if send_body else None
                if cut is None:
                    return self.send(200, data, headers, send_body)
                self.send_response(200)
                for name, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data[:cut])
                self.wfile.flush()
                self.close_connection = True

        return Handler


def tree(files: dict[str, bytes]) -> list[dict]:
    """The hub's recursive tree listing: folders, then files with their size and, for weights, LFS ids."""
    folders = sorted({path.rsplit("/", 1)[0] for path in files if "/" in path})
    entries = [{"type": "directory", "oid": hashlib.sha1(name.encode()).hexdigest(), "path": name} for name in folders]
    for path, data in sorted(files.items()):
        entry = {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": path}
        if not path.endswith((".json", ".txt", ".md", ".jinja")):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        entries.append(entry)
    return entries


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running stand-in, with huggingface_hub pointed at it, a fresh hub cache and no token."""
    stand_in = HubStandIn(repos={REPO: pipeline_repo()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), stand_in.handler())
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stand_in.endpoint = f"http://127.0.0.1:{server.server_port}"
    # huggingface_hub reads HF_ENDPOINT and HF_HOME when it is imported: set what they became.
    monkeypatch.setattr(constants, "ENDPOINT", stand_in.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", stand_in.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    yield stand_in
    server.shutdown()
    server.server_close()


def snapshot(repo_id: str) -> Path:
    folder = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return folder / hashlib.sha1(repo_id.encode()).hexdigest()


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file of a checkpoint folder, without huggingface_hub's bookkeeping in ``.cache/``."""
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in folder.rglob("*")
        if path.is_file() and ".cache" not in path.relative_to(folder).parts
    }


def test_download_fetches_only_the_files_the_pipeline_reads(hub, capsys):
    code, out, err = run_cli(["download", PRESET], capsys)
    assert code == 0, err
    folder = snapshot(REPO)
    files = hub.repos[REPO]
    assert files_under(folder) == {path: files[path] for path in READS}
    assert sorted(hub.fetched(REPO)) == sorted(READS)  # no byte of a skipped file crossed the wire
    check_components(folder, MODEL_INDEX, allow_pickle=False)  # the loader's own check of the components
    read_bytes = sum(len(files[path]) for path in READS)
    lines = out.strip().splitlines()
    assert lines[0] == (
        f"{REPO}: {len(READS)} files ({human_size(read_bytes)}) the pipeline reads; "
        f"skipping {len(SKIPS)} files ({human_size(sum(SKIPS.values()))})"
    )
    assert lines[1].startswith(
        f"fetching {len(READS) - 1} files ({human_size(read_bytes - len(files['model_index.json']))}) into "
        f"{constants.HF_HUB_CACHE} ("
    )
    assert lines[-1] == f"{folder}: run it with --model {PRESET}"

    hub.requests.clear()
    code, out, err = run_cli(["download", PRESET], capsys)
    assert code == 0, err
    assert hub.fetched(REPO) == []
    assert out.splitlines()[1] == f"all of them are already in {constants.HF_HUB_CACHE}"


def test_download_refuses_when_the_disk_has_too_little_space(hub, capsys, monkeypatch):
    needed = sum(len(data) for path, data in hub.repos[REPO].items() if path in READS and path != "model_index.json")
    free = needed // 3
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2 * needed, used=needed, free=free))
    code, out, err = run_cli(["download", PRESET], capsys)
    line = assert_one_line_error(code, err)
    assert line == (
        f"paradit: error: not enough disk space for {REPO}: {human_size(needed)} to fetch into "
        f"{constants.HF_HUB_CACHE}, {human_size(free)} free there; make room or choose another disk with --dir"
    )
    assert hub.fetched(REPO) == ["model_index.json"]  # it names the components; nothing else was fetched
    assert not any(path.endswith(".safetensors") for path in files_under(Path(constants.HF_HUB_CACHE)))

    free = needed - 1
    code, out, err = run_cli(["download", PRESET], capsys)
    assert_one_line_error(code, err, "not enough disk space")
    free = needed  # exactly enough
    code, out, err = run_cli(["download", PRESET], capsys)
    assert code == 0, err
    assert files_under(snapshot(REPO)).keys() == READS.keys()


def test_a_dropped_connection_resumes_with_a_range_request(hub, capsys, tmp_path):
    # huggingface_hub writes what it receives in chunks of DOWNLOAD_CHUNK_SIZE: cut after two whole chunks.
    cut = 2 * constants.DOWNLOAD_CHUNK_SIZE
    hub.repos[REPO][SHARD] = random.Random(1).randbytes(cut + 123_457)
    hub.cut_after[SHARD] = cut
    target = tmp_path / "klein"
    code, out, err = run_cli(["download", PRESET, "--dir", str(target)], capsys)
    assert code == 0, err
    shard_gets = [r.range for r in hub.requests if r.method == "GET" and r.path.endswith(SHARD)]
    assert shard_gets == [None, f"bytes={cut}-"]
    assert (target / SHARD).read_bytes() == hub.repos[REPO][SHARD]
    assert files_under(target) == {path: hub.repos[REPO][path] for path in READS}
    assert out.strip().splitlines()[-1] == f"{target.resolve()}: run it with --model {target}"


def test_a_failed_download_is_completed_by_the_next_run(hub, capsys):
    hub.refuse_once.add(SHARD)
    code, out, err = run_cli(["download", PRESET], capsys)
    # The progress bar of the files in flight comes first; the error is the last line.
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"paradit: error: the hub answered 403 for {REPO}: 403 Forbidden: Forbidden for now."
    )

    # The files the failed run finished stay on disk; the parallel fetches it stopped (which, depends on timing)
    # and the refused shard are all the next run fetches.
    kept = set(files_under(snapshot(REPO))) if snapshot(REPO).is_dir() else set()
    missing = sorted(set(READS) - kept)
    assert SHARD in missing
    hub.requests.clear()
    code, out, err = run_cli(["download", PRESET], capsys)
    assert code == 0, err
    assert sorted(hub.fetched(REPO)) == missing
    if missing == [SHARD]:
        assert out.splitlines()[1].startswith(f"fetching 1 file ({human_size(READS[SHARD])}) into ")
    assert files_under(snapshot(REPO)) == {path: hub.repos[REPO][path] for path in READS}


def test_gated_model_names_the_page_where_access_is_requested(hub, capsys, monkeypatch):
    hub.gated.add(REPO)
    page = f"{hub.endpoint}/{REPO}"
    code, out, err = run_cli(["download", PRESET], capsys)
    line = assert_one_line_error(code, err)
    assert line == (
        f"paradit: error: {REPO} is gated: accept its licence at {page}, then log in (`hf auth login`) or set HF_TOKEN"
    )

    monkeypatch.setenv("HF_TOKEN", "hf_not_granted")
    code, out, err = run_cli(["download", PRESET], capsys)
    line = assert_one_line_error(code, err)
    assert line == f"paradit: error: {REPO} is gated and this token has no access yet: request it at {page}"

    hub.granted_tokens.add("hf_granted")
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    hub.requests.clear()
    code, out, err = run_cli(["download", PRESET], capsys)
    assert code == 0, err
    assert {r.authorization for r in hub.requests if "/resolve/" in r.path} == {"Bearer hf_granted"}
    assert files_under(snapshot(REPO)).keys() == READS.keys()


def test_download_refuses_what_it_cannot_fetch(hub, capsys):
    code, _, err = run_cli(["download", "org/missing"], capsys)
    line = assert_one_line_error(code, err)
    assert line == (
        f"paradit: error: no model org/missing on the hub ({hub.endpoint}/org/missing); if it is private, log in "
        "(`hf auth login`) or set HF_TOKEN"
    )
    hub.repos["org/not-a-pipeline"] = {"README.md": b"an LLM"}
    code, _, err = run_cli(["download", "org/not-a-pipeline"], capsys)
    assert_one_line_error(code, err, "org/not-a-pipeline has no model_index.json: it is not a diffusers pipeline")
    code, _, err = run_cli(["download", "flux2-tiny"], capsys)
    assert_one_line_error(code, err, "flux2-tiny has random weights only: there is no checkpoint to download")
    code, _, err = run_cli(["download", "flux2-dvx"], capsys)
    assert_one_line_error(code, err, "'flux2-dvx' is neither a preset with a checkpoint (flux2-dev, ", "hub id")
    assert hub.fetched("org/missing") == []


def test_allow_pickle_fetches_the_pickle_weights_of_a_component_that_has_only_those(hub):
    """With --allow-pickle a hub id's .bin-only VAE was not fetched, so the README's advice failed for hub ids."""
    pickled_vae, vae = "org/pickled-vae", "vae/diffusion_pytorch_model.safetensors"
    hub.repos[pickled_vae] = {path: data for path, data in pipeline_repo().items() if path != vae}
    safe = resolve_checkpoint(pickled_vae)
    assert not (safe / "vae/diffusion_pytorch_model.bin").exists()
    folder = resolve_checkpoint(pickled_vae, allow_pickle=True)
    fetched = set(hub.fetched(pickled_vae))
    assert "vae/diffusion_pytorch_model.bin" in fetched and (folder / "vae/diffusion_pytorch_model.bin").is_file()
    assert not fetched & {"text_encoder/pytorch_model.bin", "text_encoder/pytorch_model.bin.index.json"}  # it has both
    check_components(folder, MODEL_INDEX, allow_pickle=True)


def test_models_local_lists_the_hub_cache_and_folders_with_sizes(hub, capsys, tmp_path):
    code, out, err = run_cli(["models", "--local"], capsys)
    assert (code, out.strip()) == (0, f"no checkpoints on disk (hub cache: {constants.HF_HUB_CACHE})")

    hub.repos["org/custom"] = pipeline_repo(seed=2)
    hub.repos["org/llm"] = {"config.json": b"{}", "model.safetensors": b"weights"}
    hf_hub_download("org/llm", "model.safetensors")  # in the cache, but not a pipeline: not listed
    folders = tmp_path / "models"
    for argv in (["download", PRESET], ["download", "org/custom", "--dir", str(folders / "custom")]):
        code, _, err = run_cli(argv, capsys)
        assert code == 0, err

    code, out, err = run_cli(["models", "--local", "--dir", str(folders)], capsys)
    assert code == 0, err
    size = human_size(sum(len(hub.repos[REPO][path]) for path in READS))
    custom_size = human_size(sum(len(hub.repos["org/custom"][path]) for path in READS))
    cached = Path(constants.HF_HUB_CACHE) / f"models--{REPO.replace('/', '--')}"
    width = len(str(folders / "custom"))
    assert out.strip().splitlines() == [
        f"{PRESET:<{width}}  {size:>10}  {cached}",
        f"{folders / 'custom'!s:<{width}}  {custom_size:>10}  {folders / 'custom'}",
    ]
