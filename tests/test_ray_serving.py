"""paradit's server as Ray Serve replicas, on one local Ray instance on the CPU (tiny models, 2 steps, 64x64).
``paradit serve --ray ADDRESS`` joined to it serves two replicas of tiny FLUX.2 (one CPU process each): 40 concurrent
requests, 10 of them malformed, give the images ``Engine.generate`` gives for their seeds and 10 JSON 400s, both
replicas serving and no malformed one reaching them; a replica's process killed mid-load is replaced, every request
answered (an image, or a 503 with ``Retry-After``), the next 10 all images; SIGTERM drains (the request in flight
answered, a new one 503), the command exits 0, its application deleted and its replicas' processes gone.
``paradit.serving.ray_app`` serves tiny Wan (one replica) beside it: a video job made by that replica is fetched
through the front after the replica is gone. Ray's options are refused in one line before Ray starts."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from paradit import Engine, GenerationRequest
from paradit.cli import main
from paradit.errors import InvalidRequest
from tests.test_processes import process_id

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

IMAGES, VIDEOS, KEY = "flux2-tiny", "wan-tiny", "test-key"
SIZE, STEPS = 64, 2
GOOD = {"prompt": "a fox in the snow", "size": f"{SIZE}x{SIZE}", "steps": STEPS}
MALFORMED = [
    ({**GOOD, "size": "40x64"}, "width 40 is not allowed"),
    ({**GOOD, "steps": 0}, "steps:"),
    ({**GOOD, "n": 11}, "n:"),
    ({**GOOD, "quality": "hd"}, "quality: unknown field"),
    ({**GOOD, "prompt": "   "}, "prompt is empty"),
    ({**GOOD, "seed": -1}, "seed:"),
    ({**GOOD, "model": "other"}, "model 'other' is not served here"),
    ({**GOOD, "size": "4096x4096"}, "--max-pixels"),
    ({"size": "64x64"}, "prompt: Field required"),
    ('{"prompt": "a fox",', "body: the body is not valid JSON"),
]
START_S = 300  # Ray, Serve and two replicas importing torch on two busy cores
GONE_S = 30


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray with Serve on a free port: ``paradit serve --ray ADDRESS`` connected to it serves tiny FLUX.2 at /
    (two replicas), ``ray_app`` tiny Wan under /videos (one); yields both URLs, the command and its output."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"port": port})
        address = ray.get_runtime_context().gcs_address
        command = [sys.executable, "-m", "paradit", "serve", "--ray", address, "--model", IMAGES, "--device", "cpu"]
        command += ["--replicas", "2", "--api-key", KEY]
        images = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(images.stdout), daemon=True).start()  # keep the pipe drained
        from paradit.serving import ray_app

        serve.run(ray_app(model=VIDEOS, device="cpu"), name="videos", route_prefix="/videos")
        deadline = time.monotonic() + START_S
        while not any("paradit: serving" in line for line in lines) and time.monotonic() < deadline:
            assert images.poll() is None, "paradit serve --ray ended:\n" + "".join(lines)
            time.sleep(0.2)
        served = next((line for line in lines if "paradit: serving" in line), "")
        assert f"http://127.0.0.1:{port}" in served, "".join(lines)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/videos", images, lines
        if images.poll() is None:
            images.kill()
            images.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def engine():
    return Engine(IMAGES, device="cpu")


def reference(engine: Engine, seed: int) -> np.ndarray:
    request = GenerationRequest(prompt=GOOD["prompt"], height=SIZE, width=SIZE, steps=STEPS, seed=seed)
    return np.asarray(engine.generate(request).images[0])


def image_of(answer: httpx.Response) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"]))))


async def post_together(url: str, bodies: list, headers: dict | None = None) -> list[httpx.Response]:
    headers = headers or {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as client:
        return await asyncio.gather(
            *(
                client.post("/v1/images/generations", **({"json": body} if isinstance(body, dict) else raw(body)))
                for body in bodies
            )
        )


def raw(body: str) -> dict:
    return {"content": body, "headers": {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}}


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def is_up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def steps_by_replica(url: str) -> dict[str, float]:
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return {
        group: float(count)
        for group, count in re.findall(r'paradit_denoise_steps_total\{group="(\d+)"\} (\S+)', metrics)
    }


def test_concurrent_requests_give_generate_s_images_and_400s_from_both_replicas(cluster, engine):
    images, _, _, _ = cluster
    assert httpx.post(images + "/v1/images/generations", json=GOOD, timeout=30).status_code == 401  # the API key
    bodies = [{**GOOD, "seed": 100 + i} for i in range(30)]
    bodies[5:5] = [body for body, _ in MALFORMED]  # among the others
    answers = asyncio.run(post_together(images, bodies))
    refused = [(answer, message) for answer, (_, message) in zip(answers[5:15], MALFORMED)]
    for answer, message in refused:
        assert answer.status_code == 400, answer.text
        assert message in answer.json()["error"]["message"]
    made = answers[:5] + answers[15:]
    for i, answer in enumerate(made):
        assert answer.json()["seed"] == 100 + i
        np.testing.assert_array_equal(image_of(answer), reference(engine, 100 + i))
    steps = steps_by_replica(images)
    assert len(steps) == 2 and all(count > 0 for count in steps.values()), steps  # both replicas served some
    assert sum(steps.values()) == 30 * STEPS  # and no malformed request reached one


def one_image(url: str) -> int:
    (answer,) = asyncio.run(post_together(url, [GOOD]))
    return answer.status_code


def kill_a_replica(url: str) -> int:
    rows = health(url)["groups"]
    assert rows, "no replica has answered yet"
    pid = rows[0]["workers"][0]
    os.kill(pid, signal.SIGKILL)
    return pid


def replica_states(app: str) -> dict:
    return serve.status().applications[app].deployments["ParaditGroup"].replica_states


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def test_a_killed_replica_is_replaced_and_every_request_answered(cluster):
    images, _, _, _ = cluster
    bodies = [{**GOOD, "steps": 40, "seed": i} for i in range(8)]
    outcome: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: outcome.extend(asyncio.run(post_together(images, bodies))))
    sender.start()
    time.sleep(1.0)  # both replicas busy
    killed = kill_a_replica(images)
    sender.join()
    for answer in outcome:
        if answer.status_code == 503:
            assert int(answer.headers["Retry-After"]) >= 1 and answer.json()["error"]["type"] == "unavailable"
        else:
            assert answer.status_code == 200, answer.text
    wait_until(lambda: process_id(killed) is None, GONE_S, "the killed replica is gone")
    # Serve's router drops a replica once a call to it fails (a request sent there is sent once more): a few requests
    # one at a time, until three in a row are answered, leave the router routing to live replicas only.
    answered = []
    wait_until(lambda: answered.append(one_image(images)) or answered[-3:] == [200] * 3, 60, "requests are answered")
    answers = asyncio.run(post_together(images, [{**GOOD, "seed": 200 + i} for i in range(10)]))
    assert [answer.status_code for answer in answers] == [200] * 10
    # Replaced: a new replica starts in its place (checked last, in the module's final test, to let it start).


def mp4_frames(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def test_a_video_job_is_fetched_through_the_front_after_its_replica_is_gone(cluster):
    _, videos, _, _ = cluster
    with httpx.Client(base_url=videos, timeout=60) as client:
        job = client.post("/v1/videos", json={"prompt": "a wave", "size": "32x32", "frames": 5, "steps": STEPS})
        assert job.status_code == 200, job.text
        video_id = job.json()["id"]
        wait_until(lambda: client.get(f"/v1/videos/{video_id}").json()["status"] == "completed", 120, "it completes")
        killed = kill_a_replica(videos)
        wait_until(lambda: process_id(killed) is None, GONE_S, "its replica is gone")
        view = client.get(f"/v1/videos/{video_id}").json()
        assert (view["status"], view["size"], view["frames"], view["steps_done"]) == ("completed", "32x32", 5, STEPS)
        content = client.get(f"/v1/videos/{video_id}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        frames = mp4_frames(content.content)
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)


def test_sigterm_drains_then_the_command_ends_with_its_replicas(cluster):
    images, _, command, lines = cluster
    wait_until(lambda: replica_states("paradit").get("RUNNING", 0) == 2, START_S, "the killed replica is replaced")
    pids = [pid for row in health(images)["groups"] for pid in row["workers"]]
    slow: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: slow.extend(asyncio.run(post_together(images, [{**GOOD, "steps": 150}]))))
    sender.start()
    time.sleep(1.0)  # it runs
    command.send_signal(signal.SIGTERM)
    wait_until(lambda: health(images)["status"] == "draining", 30, "it drains")
    (refused,) = asyncio.run(post_together(images, [GOOD]))
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_shutting_down"
    sender.join()
    assert slow[0].status_code == 200, slow[0].text  # accepted before the signal: finished
    assert command.wait(60) == 0, "".join(lines)
    assert not is_up(images)  # the application is deleted
    wait_until(lambda: all(process_id(pid) is None for pid in pids), GONE_S, "its replicas' processes are gone")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "2"], "--replicas size Ray Serve replicas; add --ray [ADDRESS]"),
        (["--ray", "--gpus", "2"], "instead of --gpus and --group-size"),
        (["--ray", "--replicas", "2", "--max-replicas", "3"], "not both"),
        (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is more than --max-replicas 2"),
        (["--ray", "--min-replicas", "2"], "give --max-replicas too"),
        (["--ray", "--target-queue", "4"], "--target-queue steers autoscaling"),
    ],
)
def test_ray_options_are_refused_in_one_line_before_ray_starts(flags, message, capsys):
    assert main(["serve", "--model", IMAGES, "--device", "cpu", *flags]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error


def test_ray_app_takes_serve_s_options_by_name_and_refuses_others():
    with pytest.raises(InvalidRequest, match="not paradit serve's options: --ray --colour red"):
        from paradit.serving import ray_app

        ray_app(colour="red")
