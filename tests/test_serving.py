"""``paradit serve`` on the CPU with the tiny models, each server in this process (uvicorn in a thread, every group's
workers spawned as processes): two groups of one process and one group of two (gloo, the plan ``generate`` picks for
two: CFG parallel). 200 concurrent requests, a fifth of them malformed in a dozen ways: every valid one returns the
image ``Engine.generate`` gives for its seed with the same plan, bit for bit; every malformed one a 400 naming the
field. A request without a seed answers the seed it drew, its image that seed's one-process image. A worker killed
mid-request: the request answered with an error within seconds, the group rebuilt. A client that leaves cancels its
request. ``DELETE`` stops a running video job within one step. The ``openai`` client works.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import random
import re
import signal
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from benchmarks.common import default_plan_for
from paradit import Engine, GenerationRequest, ParallelConfig
from paradit.request import SEED_LIMIT
from paradit.serving.launch import ServeSettings, build_scheduler
from paradit.serving.metrics import Metrics
from paradit.serving.server import create_app
from paradit.settings import Asked, resolve_model
from paradit.worker import RequestCancelled
from tests.test_serving_scheduler import app_in_thread

MODEL, SIZE, STEPS, KEY = "flux2-tiny", 32, 1, "test-key"
PROMPTS = ["a red fox in snow", "a lighthouse at dusk", "a bowl of ramen", "ein Haus am See, 夕暮れ"]
# Sixteen distinct valid requests (prompt, seed, image count, a negative prompt, and guidance: mostly off, which
# halves a request's work, and on, which CFG parallelism splits).
CASES = [
    {
        "prompt": PROMPTS[i % 4],
        "seed": 1000 + i,
        "size": f"{SIZE}x{SIZE}",
        "steps": STEPS,
        **({"n": 2} if i % 5 == 0 else {}),
        **({"guidance": 1.0} if i % 4 else {}),
        **({"negative_prompt": "blurry"} if i % 8 == 0 else {}),
    }
    for i in range(16)
]
GOOD = {"prompt": "a fox", "size": f"{SIZE}x{SIZE}", "steps": STEPS}
# (body, what the 400's message must name); a str body is sent as it is.
MALFORMED = [
    ({**GOOD, "size": "40x32"}, "width 40 is not allowed"),
    ({**GOOD, "size": "big"}, "size: give WIDTHxHEIGHT"),
    ({**GOOD, "size": "16x8208"}, "height 8208 is not allowed"),
    ({**GOOD, "steps": 0}, "steps:"),
    ({**GOOD, "steps": 501}, "steps:"),
    ({**GOOD, "n": 11}, "n:"),
    ({**GOOD, "n": "2"}, "n: Input should be a valid integer"),
    ({**GOOD, "quality": "hd"}, "quality: unknown field"),
    ({**GOOD, "prompt": ""}, "prompt:"),
    ({**GOOD, "prompt": "x" * 10_001}, "prompt:"),
    ({**GOOD, "prompt": "   "}, "prompt is empty"),
    ({**GOOD, "guidance": -1}, "guidance:"),
    ({**GOOD, "seed": -1}, "seed:"),
    ({**GOOD, "seed": 2**64}, "seed:"),
    ({**GOOD, "response_format": "xml"}, "response_format:"),
    ({**GOOD, "output_compression": 50}, "output_compression applies to jpeg and webp"),
    ({**GOOD, "model": "other"}, "model 'other' is not served here"),
    ({"size": "32x32"}, "prompt: Field required"),
    ('{"prompt": "a fox",', "body: the body is not valid JSON"),
    ("[1, 2]", "body: Input should be a valid dictionary"),
]
KILL_ANSWER_S = 15  # a request whose worker is killed is answered within this long
REBUILD_S = 90  # and its group serves again within this long (two processes import torch and load on two cores)


@contextlib.contextmanager
def live_server(model: str, **settings):
    """A server on a free port of 127.0.0.1, started in this process; yields (base URL, scheduler)."""
    metrics = Metrics()
    asked = Asked(model=model, device="cpu")
    scheduler, config = build_scheduler(ServeSettings(asked, max_queue=256, **settings), metrics)
    scheduler.start()
    try:
        with app_in_thread(create_app(scheduler, config, metrics)) as url:
            yield url, scheduler
    finally:
        scheduler.close()


class References:
    """``Engine.generate``'s images for each request body, with the plan the server's groups run (cached). An engine
    in this process runs with as many torch threads as each of the server's workers (one, two workers on two
    cores): a batch's rounding depends on how its rows are shared among threads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cache: dict[str, list[np.ndarray]] = {}

    def __call__(self, body: dict) -> list[np.ndarray]:
        key = repr(sorted((k, v) for k, v in body.items() if k != "response_format"))
        if key not in self.cache:
            width, height = map(int, body["size"].split("x"))
            request = GenerationRequest(
                prompt=body["prompt"],
                negative_prompt=body.get("negative_prompt"),
                height=height,
                width=width,
                steps=body["steps"],
                guidance=body.get("guidance"),
                seed=body["seed"],
                num_images_per_prompt=body.get("n", 1),
            )
            with torch_threads(max(1, (os.cpu_count() or 1) // 2)):
                self.cache[key] = [np.asarray(image) for image in self.engine.generate(request).images]
        return self.cache[key]


@contextlib.contextmanager
def torch_threads(count: int):
    """This process's torch threads set to ``count`` for a while: an engine that runs here, as a reference for a
    server's worker, must split its reductions among as many threads as that worker does (worker.py) to equal it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


async def send_all(url: str, bodies: list) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as client:

        async def send(body) -> httpx.Response:
            if isinstance(body, str):
                return await client.post("/v1/images/generations", content=body.encode())
            return await client.post("/v1/images/generations", json=body)

        return await asyncio.gather(*(send(body) for body in bodies))


def check_200_concurrent_requests(url: str, references: dict[str, References]) -> list[str]:
    """Send them and check every answer; ``references`` by the plan an answer names. The plans that answered."""
    valid = [dict(CASES[i % len(CASES)]) for i in range(160)]
    for body in valid[::8]:
        body["response_format"] = "url"
    malformed = [MALFORMED[i % len(MALFORMED)] for i in range(40)]
    order = [("valid", body) for body in valid] + [("malformed", case) for case in malformed]
    random.Random(0).shuffle(order)
    answers = asyncio.run(send_all(url, [body if kind == "valid" else body[0] for kind, body in order]))
    assert len(answers) == 200
    headers, plans = {"Authorization": f"Bearer {KEY}"}, []
    for (kind, body), answer in zip(order, answers):
        if kind == "malformed":
            expected = body[1]
            assert answer.status_code == 400, (body[0], answer.text)
            assert expected in answer.json()["error"]["message"], (expected, answer.text)
            continue
        assert answer.status_code == 200, answer.text
        data, plan = answer.json()["data"], answer.json()["plan"]
        plans.append(plan)
        if body.get("response_format") == "url":
            images = [decoded(httpx.get(item["url"], headers=headers).content) for item in data]
        else:
            images = [decoded(base64.b64decode(item["b64_json"])) for item in data]
        expected = references[plan](body)
        assert len(images) == len(expected) and all(np.array_equal(a, b) for a, b in zip(images, expected)), body
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    return plans


@pytest.fixture(scope="module")
def two_groups_of_one():
    with live_server(model=MODEL, gpus=2, group_size=1, api_key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def one_group_of_two():
    with live_server(model=MODEL, gpus=2, group_size=2, api_key=KEY) as server:
        yield server


def test_two_groups_of_one_process_serve_200_concurrent_requests_bit_exact(two_groups_of_one):
    url, scheduler = two_groups_of_one
    assert [group.plan for group in scheduler.groups] == ["1 process", "1 process"]
    assert set(check_200_concurrent_requests(url, {"1 process": References(Engine(MODEL, device="cpu"))})) == {
        "1 process"
    }


def test_the_openai_client_generates_against_the_server(two_groups_of_one):
    url, _ = two_groups_of_one
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    answer = client.images.generate(
        prompt=PROMPTS[0], size=f"{SIZE}x{SIZE}", response_format="b64_json", extra_body={"steps": STEPS, "seed": 5}
    )
    expected = References(Engine(MODEL, device="cpu"))(
        {"prompt": PROMPTS[0], "size": f"{SIZE}x{SIZE}", "steps": STEPS, "seed": 5}
    )
    assert np.array_equal(decoded(base64.b64decode(answer.data[0].b64_json)), expected[0])
    with pytest.raises(openai.BadRequestError, match="width 40 is not allowed"):
        client.images.generate(prompt="a fox", size="40x32")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).images.generate(prompt="a fox")
    assert [model.id for model in client.models.list()] == [MODEL]


@pytest.fixture(scope="module")
def cfg_parallel_references():
    with Engine(MODEL, device="cpu", parallel=default_plan_for(resolve_model(MODEL), 2)) as engine:
        yield References(engine)


def test_one_group_of_two_processes_serves_200_concurrent_requests_bit_exact(one_group_of_two, cfg_parallel_references):
    url, scheduler = one_group_of_two
    assert scheduler.groups[0].plan == "cfg 2"
    assert set(check_200_concurrent_requests(url, {"cfg 2": cfg_parallel_references})) == {"cfg 2"}


def test_a_request_without_a_seed_answers_the_seed_it_drew_and_that_seeds_image(one_group_of_two):
    """Both processes of the group denoise the one seed the server drew and named: the image is the one-process
    image of that seed."""
    url, _ = one_group_of_two
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    answer = client.images.generate(
        prompt=PROMPTS[1], size=f"{SIZE}x{SIZE}", response_format="b64_json", extra_body={"steps": 2}
    )
    seed = answer.model_extra["seed"]
    assert answer.model_extra["plan"] == "cfg 2" and 0 <= seed < SEED_LIMIT
    with Engine(MODEL, device="cpu") as engine:
        request = GenerationRequest(prompt=PROMPTS[1], height=SIZE, width=SIZE, steps=2, seed=seed)
        expected = np.asarray(engine.generate(request).images[0])
    served = decoded(base64.b64decode(answer.data[0].b64_json))
    assert np.abs(served.astype(int) - expected).max() <= 1


def test_auto_on_two_splits_a_lone_request_and_serves_a_crowd_on_each_process_bit_exact(cfg_parallel_references):
    singles = References(Engine(MODEL, device="cpu"))
    with live_server(model=MODEL, gpus=2, group_size="auto", api_key=KEY) as (url, scheduler):
        assert [group.plan for group in scheduler.groups] == ["cfg 2", "1 process", "1 process"]
        plans = check_200_concurrent_requests(url, {"cfg 2": cfg_parallel_references, "1 process": singles})
        assert plans.count("1 process") > len(plans) / 2  # a crowd: independent requests, mostly
        lone = asyncio.run(send_all(url, [{**CASES[1], "seed": 5}]))[0].json()
        assert lone["plan"] == "cfg 2"  # alone in the queue: split over both
        expected = cfg_parallel_references({**CASES[1], "seed": 5})[0]
        assert np.array_equal(decoded(base64.b64decode(lone["data"][0]["b64_json"])), expected)
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert float(re.search(r"^paradit_group_mode_switches_total (\S+)$", metrics, re.MULTILINE)[1]) >= 1


def long_request(url: str, results: list, timeout: float = 300) -> threading.Thread:
    """A request of many steps sent from a thread; its answer (or the client's exception) lands in ``results``."""

    def send() -> None:
        try:
            results.append(
                httpx.post(
                    url + "/v1/images/generations",
                    json={**GOOD, "steps": 400, "seed": 1},
                    headers={"Authorization": f"Bearer {KEY}"},
                    timeout=timeout,
                )
            )
        except httpx.HTTPError as exc:
            results.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_a_client_that_leaves_cancels_its_request_and_frees_the_group(one_group_of_two):
    url, scheduler = one_group_of_two
    group = scheduler.groups[0]
    results: list = []
    thread = long_request(url, results, timeout=1.5)  # the client gives up after 1.5 s, long before 400 steps
    thread.join()
    assert isinstance(results[0], httpx.ReadTimeout)
    wait_until(lambda: not group.batch, 5, "the group dropped the abandoned request")
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'endpoint="/v1/images/generations",outcome="cancelled"} 1.0' in metrics


def test_a_killed_worker_fails_its_request_then_the_group_is_rebuilt(one_group_of_two, cfg_parallel_references):
    url, scheduler = one_group_of_two
    group = scheduler.groups[0]
    workers = httpx.get(url + "/health").json()["groups"][0]["workers"]
    results: list = []
    thread = long_request(url, results)

    def running() -> bool:
        batch = group.batch
        return bool(batch) and scheduler.steps_done(batch[0]) >= 1

    wait_until(running, 30, "the request is running")
    os.kill(workers[1], signal.SIGKILL)
    killed = time.monotonic()
    thread.join(KILL_ANSWER_S)
    assert not thread.is_alive() and time.monotonic() - killed < KILL_ANSWER_S
    assert results[0].status_code == 500
    assert "worker 1 exited with code -9" in results[0].json()["error"]["message"]
    wait_until(lambda: httpx.get(url + "/health").json()["status"] == "ok", REBUILD_S, "the group serves again")
    health = httpx.get(url + "/health").json()["groups"][0]
    assert health["restarts"] == 1 and not set(health["workers"]) & set(workers)
    body = {**GOOD, "seed": 77}
    answer = httpx.post(url + "/v1/images/generations", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert np.array_equal(
        decoded(base64.b64decode(answer.json()["data"][0]["b64_json"])), cfg_parallel_references(body)[0]
    )


def test_delete_stops_a_running_video_job_within_one_step_and_the_next_job_completes():
    video = {"prompt": "a fox running", "size": "64x64", "frames": 9, "seed": 3}
    with live_server(model="wan-tiny") as (url, scheduler), httpx.Client(base_url=url, timeout=60) as client:
        long_job = client.post("/v1/videos", json={**video, "size": "128x128", "frames": 17, "steps": 500}).json()
        short_job = client.post("/v1/videos", json={**video, "steps": 2}).json()
        # the group may take the long job before its creation is answered; the short one waits behind it
        assert long_job["status"] in ("queued", "in_progress") and short_job["status"] == "queued"
        assert long_job["steps"] == 500 and long_job["frames"] == 17
        wait_until(lambda: client.get(f"/v1/videos/{long_job['id']}").json()["steps_done"] >= 3, 60, "it runs")
        running = client.get(f"/v1/videos/{long_job['id']}").json()
        assert running["status"] == "in_progress" and running["progress"] == 100 * running["steps_done"] // 500

        group = scheduler.groups[0]
        engine, at_cancel = group.engine, []
        cancel = engine.cancel
        engine.cancel = lambda: (at_cancel.append(engine.steps_done), cancel())
        job = group.batch[0]
        deleted = client.delete(f"/v1/videos/{long_job['id']}").json()
        assert deleted == {"id": long_job["id"], "object": "video.deleted", "deleted": True, "status": "cancelled"}
        assert job.steps_done <= at_cancel[0] + 1  # the step running when the stop came, and no more
        assert client.get(f"/v1/videos/{long_job['id']}").status_code == 404

        wait_until(lambda: client.get(f"/v1/videos/{short_job['id']}").json()["status"] == "completed", 60, "done")
        content = client.get(f"/v1/videos/{short_job['id']}/content")
        assert content.headers["content-type"] == "video/mp4"
        import av

        with av.open(io.BytesIO(content.content)) as container:
            frames = [frame.to_image() for frame in container.decode(video=0)]
        assert len(frames) == 9 and frames[0].size == (64, 64)
        refused = client.post("/v1/images/generations", json={"prompt": "a fox"})
        assert refused.status_code == 400 and "wan-tiny makes videos" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    "plan, steps", [(None, 300), (ParallelConfig(pipefusion=2, patches=2), 30)], ids=["one-process", "pipefusion"]
)
def test_engine_cancel_stops_a_run_and_the_engine_serves_on(plan, steps):
    """In one process the run stops at the next step boundary; PipeFusion's patch loop, whose steps end with patches
    still in flight between the stages, stops once it has drained (before decoding)."""
    request = GenerationRequest(prompt="a fox", height=SIZE, width=SIZE, steps=steps, seed=1)
    with Engine(MODEL, device="cpu", parallel=plan) as engine:
        outcome: list = []

        def run() -> None:
            try:
                outcome.append(engine.generate(request))
            except RequestCancelled as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: engine.steps_done >= 2, 60, "the run is under way")
        engine.cancel()
        at_cancel = engine.steps_done
        thread.join(60)
        assert isinstance(outcome[0], RequestCancelled)
        if plan is None:
            assert engine.steps_done <= at_cancel + 1
        else:
            assert engine.steps_done == steps
        after = GenerationRequest(prompt="a fox", height=SIZE, width=SIZE, steps=STEPS, seed=7)
        assert engine.generate(after).seed == 7 and engine.steps_done == STEPS
