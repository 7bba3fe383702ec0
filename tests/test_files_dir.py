"""``paradit serve --files-dir DIR``, over real HTTP on 127.0.0.1 with stand-in engines (no model runs): a video job
made through one server is answered, its MP4 byte for byte, by another over the same folder and by a new one after
the first is gone; one still running there reads as its last recorded status, and a DELETE there forgets it
everywhere; url images are served by any of them; the oldest jobs and files leave the folder first, whoever wrote
them; a folder that is a file is refused in one line before anything loads; without the option nothing is written."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import paradit.cli
import paradit.serving.launch
from paradit.cli import main
from paradit.families import FAMILIES
from paradit.request import GenerationRequest
from paradit.serving.metrics import Metrics
from paradit.serving.records import JobRecords
from paradit.serving.scheduler import Scheduler
from paradit.serving.server import ServerConfig, create_app
from paradit.serving.store import FILES, VIDEOS, DirectoryStore, FileStore, files_folder
from paradit.serving.videos import VideoJobs
from paradit.settings import resolve_model
from tests.test_serving_scheduler import StandInEngine, app_in_thread, scheduler

WAN = resolve_model("wan-tiny")
VIDEO = {"prompt": "a wave", "size": "32x32", "steps": 2, "frames": 5}
IMAGE = {"prompt": "a fox", "size": "32x32", "steps": 2, "response_format": "url"}


class VideoStandIn(StandInEngine):
    """Videos of the request's size and frames: noise drawn from its seed, so that each job's MP4 is its own."""

    def _generate(self, resolved):
        return [
            dataclasses.replace(
                result,
                pixels=torch.rand(
                    r.batch, r.frames, 3, r.height, r.width, generator=torch.Generator().manual_seed(r.seed)
                ),
            )
            for result, r in zip(super()._generate(resolved), resolved)
        ]


@pytest.fixture(scope="module")
def video_scheduling():
    check = lambda request: FAMILIES[WAN.family].resolve_request(WAN, request)  # noqa: E731
    scheduling = Scheduler(lambda index: VideoStandIn([], set()), 1, check, Metrics())
    scheduling.start()
    yield scheduling
    scheduling.close()


@pytest.fixture(scope="module")
def image_scheduling():
    with scheduler() as (scheduling, _, _):
        yield scheduling


@contextlib.contextmanager
def server(scheduling: Scheduler, folder: Path | None, video: bool = True, **config):
    """A server process's app over ``scheduling`` (served from a thread of this one); yields its base URL."""
    model = WAN.name if video else "flux2-tiny"
    app = create_app(scheduling, ServerConfig(model, video=video, files_dir=folder, **config), scheduling.metrics)
    with app_in_thread(app) as url:
        yield url


def eventually(condition, what: str, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.05)
    return value


def recorded(folder: Path) -> set[str]:
    return {path.stem for path in folder.glob("*.json")}


def stored(folder: Path) -> set[str]:
    """The files there, not the temporary folders (dot names) of one being written."""
    return {path.name for path in folder.iterdir() if not path.name.startswith(".")}


def status(url: str, video_id: str) -> dict:
    return httpx.get(f"{url}/v1/videos/{video_id}").json()


def completed(url: str, video_id: str) -> dict:
    return eventually(lambda: (now := status(url, video_id))["status"] == "completed" and now, f"{url} completed")


def test_a_video_job_is_answered_by_every_server_over_its_folder_also_after_its_own_is_gone(video_scheduling, tmp_path):
    with server(video_scheduling, tmp_path) as a, server(video_scheduling, tmp_path) as b:
        job = httpx.post(a + "/v1/videos", json={**VIDEO, "seed": 1}).json()
        assert status(b, job["id"])["status"] in ("queued", "in_progress", "completed")
        done = completed(a, job["id"])
        content = httpx.get(f"{a}/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.content[4:8] == b"ftyp"
        assert completed(b, job["id"]) == done
        elsewhere = httpx.get(f"{b}/v1/videos/{job['id']}/content")
        assert elsewhere.headers["content-type"] == "video/mp4" and elsewhere.content == content.content
    with server(video_scheduling, tmp_path) as restarted:
        assert status(restarted, job["id"]) == done
        assert httpx.get(f"{restarted}/v1/videos/{job['id']}/content").content == content.content
        assert httpx.get(f"{restarted}/v1/videos/{'0' * 32}").status_code == 404


def test_a_job_running_elsewhere_reads_as_its_last_record_and_a_delete_there_forgets_it_everywhere(
    video_scheduling, tmp_path
):
    with server(video_scheduling, tmp_path) as a, server(video_scheduling, tmp_path) as b:
        job = httpx.post(a + "/v1/videos", json={**VIDEO, "steps": 150, "seed": 2}).json()
        running = eventually(lambda: (now := status(b, job["id"]))["steps_done"] > 0 and now, "progress recorded")
        assert running["status"] == "in_progress" and running["progress"] == 100 * running["steps_done"] // 150
        deleted = httpx.delete(f"{b}/v1/videos/{job['id']}").json()
        assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True, "status": "in_progress"}
        assert httpx.get(f"{a}/v1/videos/{job['id']}").status_code == 404
        assert httpx.get(f"{b}/v1/videos/{job['id']}").status_code == 404
        assert not recorded(tmp_path / VIDEOS)
        # its run went on in a's process; once ended, its MP4 is not kept
        eventually(lambda: video_scheduling.health()[1] == 0 and not video_scheduling.groups[0].batch, "it ends")
    assert not stored(tmp_path / FILES)


def test_a_url_image_written_by_one_server_is_served_by_another_over_the_folder(image_scheduling, tmp_path):
    with server(image_scheduling, tmp_path, video=False) as a, server(image_scheduling, tmp_path, video=False) as b:
        answer = httpx.post(a + "/v1/images/generations", json=IMAGE)
        assert answer.status_code == 200, answer.text
        url = answer.json()["data"][0]["url"]
        name = url.rsplit("/", 1)[1]
        from_a, from_b = httpx.get(url), httpx.get(f"{b}/v1/files/{name}")
        assert from_b.status_code == 200 and from_b.headers["content-type"] == "image/png"
        assert from_b.content == from_a.content == (tmp_path / FILES / name).read_bytes()
        assert httpx.get(f"{b}/v1/files/..%2F{VIDEOS}").status_code == 404  # a name never leaves the folder


def test_the_oldest_jobs_and_files_leave_the_folder_first_whichever_process_wrote_them(video_scheduling, tmp_path):
    records = JobRecords(tmp_path / VIDEOS)
    files = DirectoryStore(tmp_path / FILES, 1 << 30)
    first, second = (VideoJobs(video_scheduling, files, WAN.name, keep=2, records=records) for _ in range(2))
    try:
        request = GenerationRequest(prompt="a wave", height=32, width=32, steps=1, frames=5)
        made = [process.create(request) for process in (first, second, first)]
        eventually(lambda: len(recorded(records.folder)) == 2, "the oldest record trimmed")
        newest = {entry.id for entry in made[1:]}
        assert recorded(records.folder) == newest
        assert first.get(made[0].id) is None and second.get(made[0].id) is None
        kept = lambda: {records.load(video_id).content for video_id in newest}  # noqa: E731
        eventually(lambda: None not in kept(), "the newest MP4s written")
        eventually(lambda: stored(files.folder) == kept(), "the oldest MP4 removed")
    finally:
        first.close()
        second.close()

    budget = DirectoryStore(tmp_path / "budget", 250)
    other = DirectoryStore(tmp_path / "budget", 250)
    names = [budget.put(b"a" * 100, "png"), other.put(b"b" * 100, "png"), budget.put(b"c" * 100, "webp")]
    assert sorted(stored(budget.folder)) == names[1:]
    assert budget.get(names[0]) is None and budget.get(names[2]) == (b"c" * 100, "image/webp")
    large = other.put(b"d" * 400, "mp4")  # past the budget alone: kept, every older one gone
    assert stored(budget.folder) == {large}
    assert budget.get(large) == (b"d" * 400, "video/mp4")


def test_a_files_dir_that_is_a_file_is_refused_in_one_line_before_anything_loads_and_a_missing_one_made(
    monkeypatch, capsys, tmp_path
):
    def build_scheduler(*args, **kwargs):
        raise AssertionError("an engine was built for a server whose folder cannot be written")

    monkeypatch.setattr(paradit.serving.launch, "build_scheduler", build_scheduler)
    monkeypatch.setattr(paradit.cli, "start_worker_server", lambda device: None)  # no workers are wanted here
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    serve = ["serve", "--model", "flux2-tiny", "--device", "cpu", "--port", "0", "--files-dir", str(taken)]
    expected = (
        f"paradit: error: --files-dir {taken}: it is a file, not a folder; give a folder this server can write to"
    )
    assert main(serve) == 2
    assert capsys.readouterr().err == expected + "\n"
    made = files_folder(tmp_path / "new" / "deeper")  # a folder that does not exist is made
    assert sorted(path.name for path in made.iterdir()) == [FILES, VIDEOS]


def test_serve_on_ray_refuses_a_files_dir_that_is_a_file_before_any_ray_starts(capsys, tmp_path):
    pytest.importorskip("ray")
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    serve = ["serve", "--ray", "--model", "flux2-tiny", "--device", "cpu", "--files-dir", str(taken)]
    assert main(serve) == 2
    assert capsys.readouterr().err == (
        f"paradit: error: --files-dir {taken}: it is a file, not a folder; give a folder this server can write to\n"
    )


def test_without_files_dir_nothing_is_written_to_disk(video_scheduling, image_scheduling, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with server(video_scheduling, None) as videos, server(image_scheduling, None, video=False) as images:
        job = httpx.post(videos + "/v1/videos", json={**VIDEO, "seed": 3}).json()
        completed(videos, job["id"])
        assert httpx.get(f"{videos}/v1/videos/{job['id']}/content").content[4:8] == b"ftyp"
        url = httpx.post(images + "/v1/images/generations", json=IMAGE).json()["data"][0]["url"]
        assert httpx.get(url).headers["content-type"] == "image/png"
        assert "paradit-records" not in {thread.name for thread in threading.enumerate()}
    assert not list(tmp_path.iterdir())
    app = create_app(image_scheduling, ServerConfig("flux2-tiny"), image_scheduling.metrics)
    assert isinstance(app.state.videos.files, FileStore) and app.state.videos.records is None
    app.state.videos.close()
