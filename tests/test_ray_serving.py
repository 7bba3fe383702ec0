"""``paradit serve --ray`` on a local Ray instance on the CPU: two replicas of one CPU worker each behind one front,
and a video app of one replica; the cluster and both apps start once for every test."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from paradit.cli import main
from paradit.engine import Engine
from paradit.options import Asked, ServeSettings
from tests.test_serving import KEY, MALFORMED, MODEL, SIZE, STEPS, References, decoded, send_all

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from paradit.serving.ray_app import ray_app  # noqa: E402

VIDEO_MODEL = "wan-tiny"
REPLACED_S = 60  # a killed replica's successor serves within this long (it imports torch and warms up on 2 cores)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def replica_pids(app: str) -> list[int]:
    """The process ids of ``app``'s live GroupReplica actors (Serve names each actor after its app and deployment)."""
    names = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(f"SERVE_REPLICA::{app}#GroupReplica#")
    ]
    pids = []
    for name in names:
        try:
            actor = ray.get_actor(name, namespace="serve")
            pids.append(ray.get(actor.__ray_call__.remote(lambda replica: os.getpid()), timeout=5))
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue  # gone since it was listed, or still starting
    return sorted(pids)


def settings(model: str) -> ServeSettings:
    return ServeSettings(asked=Asked(model=model, device="cpu"), api_key=KEY)


@pytest.fixture(scope="module")
def cluster():
    """(images URL, videos URL): flux2-tiny on 2 replicas, wan-tiny on 1, each replica one CPU worker."""
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:  # both apps' replicas load at once: the video app is not waited for until the image app runs
        serve._run(ray_app(settings(VIDEO_MODEL)), name="videos", route_prefix="/videos", _blocking=False)
        serve.run(ray_app(settings(MODEL), replicas=2), name="images", route_prefix="/images")
        while serve.status().applications["videos"].status != "RUNNING":
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/images", f"http://127.0.0.1:{port}/videos"
    finally:
        ray.shutdown()  # every actor with it: Serve's own graceful shutdown would only add seconds


def body(seed: int) -> dict:
    return {
        "prompt": "a red fox in snow",
        "size": f"{SIZE}x{SIZE}",
        "steps": STEPS,
        "seed": seed,
        "response_format": "b64_json",
    }


def served_by_replica(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    rows = [line for line in text.splitlines() if line.startswith("paradit_replica_requests_total{")]
    return {row.split('"')[1]: float(row.rsplit(" ", 1)[1]) for row in rows}


def test_40_concurrent_requests_give_engine_generate_images_and_the_same_400s(cluster):
    url, _ = cluster
    valid = [body(2000 + i) for i in range(30)]
    malformed = MALFORMED[:10]
    answers = asyncio.run(send_all(url, [*valid, *(case for case, _ in malformed)]))
    references = References(Engine(MODEL, device="cpu"))
    for sent, answer in zip(valid, answers[:30]):
        assert answer.status_code == 200, answer.text
        images = [decoded(base64.b64decode(item["b64_json"])) for item in answer.json()["data"]]
        assert len(images) == 1 and np.array_equal(images[0], references(sent)[0]), sent
    for (_, message), answer in zip(malformed, answers[30:]):
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
        assert message in answer.json()["error"]["message"]
    served = served_by_replica(url)
    assert len(served) == 2 and all(count > 0 for count in served.values()) and sum(served.values()) >= 30


def test_a_killed_replica_is_replaced_and_its_requests_retried_or_refused_with_retry_after(cluster):
    url, _ = cluster
    before = replica_pids("images")
    assert len(before) == 2

    async def load_then_kill():
        sending = asyncio.ensure_future(send_all(url, [body(3000 + i) for i in range(12)]))
        await asyncio.sleep(0.3)
        os.kill(before[0], signal.SIGKILL)
        return await sending

    for answer in asyncio.run(load_then_kill()):
        assert answer.status_code == 200 or (answer.status_code == 503 and int(answer.headers["Retry-After"]) > 0), (
            answer.text
        )
    deadline = time.monotonic() + REPLACED_S
    while (now := replica_pids("images")) == before or len(now) < 2:
        assert time.monotonic() < deadline, f"replicas {now} after killing {before[0]}"
        time.sleep(0.5)
    assert before[0] not in now
    answers = asyncio.run(send_all(url, [body(4000 + i) for i in range(10)]))
    assert [answer.status_code for answer in answers] == [200] * 10


def test_a_video_job_is_fetched_through_the_front_after_its_replica_is_gone(cluster):
    _, url = cluster
    headers = {"Authorization": f"Bearer {KEY}"}
    job = httpx.post(
        url + "/v1/videos", headers=headers, json={"prompt": "a wave", "size": "32x32", "steps": 1, "frames": 5}
    ).json()
    deadline = time.monotonic() + 60
    while (status := httpx.get(f"{url}/v1/videos/{job['id']}", headers=headers).json())["status"] != "completed":
        assert status["status"] in ("queued", "in_progress") and time.monotonic() < deadline, status
        time.sleep(0.2)
    (pid,) = replica_pids("videos")
    os.kill(pid, signal.SIGKILL)
    while pid in replica_pids("videos"):
        time.sleep(0.2)
    content = httpx.get(f"{url}/v1/videos/{job['id']}/content", headers=headers)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    assert content.content[4:8] == b"ftyp" and len(content.content) > 1000


def test_sigterm_to_paradit_serve_on_a_cluster_drains_and_takes_only_its_app_away(cluster):
    """``paradit serve --ray ADDRESS`` on the running cluster: SIGTERM answers the accepted request, takes its app
    off the cluster and exits 0; the cluster and its other apps serve on."""
    images, _ = cluster
    root = images.removesuffix("/images")
    port = root.rsplit(":", 1)[1]
    command = ["-m", "paradit", "serve", "--ray", ray.get_runtime_context().gcs_address, "--model", MODEL]
    command += ["--device", "cpu", "--host", "127.0.0.1", "--port", port]
    server = subprocess.Popen([sys.executable, *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + REPLACED_S
        while getattr(serve.status().applications.get("paradit"), "status", None) != "RUNNING":
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()
            time.sleep(0.5)
        answers = []
        sender = threading.Thread(
            target=lambda: answers.append(
                httpx.post(root + "/v1/images/generations", json={**body(5), "steps": 30}, timeout=120)
            )
        )
        sender.start()
        while httpx.get(root + "/health").json()["queue"] == 0:  # in flight at the front
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        assert server.wait(REPLACED_S) == 0, server.stderr.read()
        sender.join()
    finally:
        server.kill()
    assert [answer.status_code for answer in answers] == [200], answers[0].text
    assert "paradit" not in serve.status().applications
    assert httpx.get(images + "/health").is_success


def test_the_command_line_refuses_replica_bounds_the_wrong_way_round_in_one_line(capsys):
    """Before any Ray starts."""
    serve_ray = ["serve", "--ray", "--model", MODEL, "--device", "cpu", "--min-replicas", "3", "--max-replicas", "2"]
    assert main(serve_ray) == 2
    assert capsys.readouterr().err == (
        "paradit: error: --min-replicas 3 is past --max-replicas 2; give a smaller --min-replicas\n"
    )
