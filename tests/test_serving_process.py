"""``paradit serve`` as its own process (the command line's path, signals included), tiny FLUX.2 on the CPU with
``--max-batch 4``: requests queued behind a busy group share a forward pass, each image within one 8-bit level of
what ``Engine.generate`` gives for its seed alone; ``paradit generate --server`` writes the image ``generate``
writes; a request whose run exhausts the device's memory (``tests/oom_site``, at one size) is a 503 naming the stage,
the server serving the next one; SIGTERM finishes the accepted requests, answers new ones 503, and exits 0."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from paradit import Engine, GenerationRequest
from paradit.cli import main
from tests.test_device_memory import OOM_SIZE, oom_environment

MODEL, SIZE, STEPS = "flux2-tiny", 32, 2
START_S = 120  # two cores shared with the test process: importing torch and loading take a while
GOOD = {"prompt": "a fox in the snow", "size": f"{SIZE}x{SIZE}", "steps": STEPS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    environment = oom_environment(tmp_path_factory.mktemp("serve"))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paradit",
            "serve",
            "--model",
            MODEL,
            "--device",
            "cpu",
            "--port",
            "0",
            "--max-batch",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment,
    )
    lines: list[str] = []
    deadline = time.monotonic() + START_S
    url = None
    while url is None and time.monotonic() < deadline and process.poll() is None:
        line = process.stdout.readline()
        lines.append(line)
        found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
        url = found and found[1]
    assert url, "the server did not start:\n" + "".join(lines)
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()  # keep the pipe drained
    yield process, url, lines
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def engine():
    return Engine(MODEL, device="cpu")


def image_of(answer: httpx.Response) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"]))))


def reference(engine: Engine, seed: int, prompt: str = GOOD["prompt"]) -> np.ndarray:
    request = GenerationRequest(prompt=prompt, height=SIZE, width=SIZE, steps=STEPS, seed=seed)
    return np.asarray(engine.generate(request).images[0])


async def post_together(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/images/generations", json=body) for body in bodies))


async def post_first_then_rest(url: str, bodies: list[dict], pause_s: float) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        first = asyncio.create_task(client.post("/v1/images/generations", json=bodies[0]))
        await asyncio.sleep(pause_s)
        rest = await asyncio.gather(*(client.post("/v1/images/generations", json=body) for body in bodies[1:]))
        return [await first, *rest]


def batch_counts(url: str) -> np.ndarray:
    """(batches of one image, batches, images) run so far, from /metrics."""
    metrics = httpx.get(url + "/metrics").text
    patterns = (
        r'paradit_batch_images_bucket\{le="1.0"\} (\S+)',
        r"paradit_batch_images_count (\S+)",
        r"paradit_batch_images_sum (\S+)",
    )
    return np.array([float(re.search(pattern, metrics)[1]) for pattern in patterns])


def test_queued_requests_share_a_batch_each_image_from_its_own_seed(server, engine):
    _, url, _ = server
    before = batch_counts(url)
    busy: list = []
    sender = threading.Thread(target=lambda: busy.extend(asyncio.run(post_together(url, [{**GOOD, "steps": 40}]))))
    sender.start()
    time.sleep(0.5)  # the busy request occupies the group; the next six queue behind it
    answers = asyncio.run(post_together(url, [{**GOOD, "seed": seed} for seed in range(6)]))
    sender.join()
    alone, batches, images = batch_counts(url) - before
    assert images == 7 and alone < batches < 7  # some batch held several requests
    for seed, answer in enumerate(answers):
        difference = np.abs(image_of(answer).astype(int) - reference(engine, seed)).max()
        assert difference <= 1, (seed, difference)  # a batch's rounding, not another seed's noise


def test_generate_with_server_writes_the_image_generate_writes(server, engine, tmp_path, capsys):
    _, url, _ = server
    out = tmp_path / "fox.png"
    argv = [
        "generate",
        "--server",
        url,
        "--prompt",
        GOOD["prompt"],
        "--height",
        str(SIZE),
        "--width",
        str(SIZE),
        "--steps",
        str(STEPS),
        "--seed",
        "3",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines() == ["seed 3", f"wrote {out}"]
    assert np.array_equal(np.asarray(Image.open(out)), reference(engine, 3))
    assert main([*argv, "--height", "40"]) == 2
    assert "the server answered 400: height 40 is not allowed" in capsys.readouterr().err
    assert main(["generate", "--server", url, "--prompt", "a", "--gpus", "2", "--out", str(out)]) == 2
    assert "--gpus: the server chose these when it started" in capsys.readouterr().err


def test_a_request_that_runs_out_of_device_memory_is_a_503_and_the_server_serves_on(server, engine):
    """It was a 500 "server_error" naming OutOfMemoryError; the server's capacity, not the client's input, is what
    failed: 503 with the stage and the figures, /health still 200, the next request served."""
    _, url, _ = server
    answer = httpx.post(url + "/v1/images/generations", json={**GOOD, "size": f"{OOM_SIZE}x{OOM_SIZE}"}, timeout=120)
    error = answer.json()["error"]
    assert answer.status_code == 503 and error["type"] == "out_of_memory", answer.text
    assert error["message"].startswith("out of memory on cpu at denoise step 1 of 2: 2.00 GiB more was asked for")
    assert httpx.get(url + "/health").status_code == 200
    assert np.array_equal(
        image_of(httpx.post(url + "/v1/images/generations", json={**GOOD, "seed": 5}, timeout=120)),
        reference(engine, 5),
    )


def test_sigterm_finishes_accepted_requests_refuses_new_ones_and_exits(server):
    process, url, lines = server
    answers: list = []
    bodies = [{**GOOD, "steps": 80, "seed": 1}, {**GOOD, "seed": 2, "prompt": "a"}, {**GOOD, "seed": 3, "prompt": "b"}]
    # The long request first, alone: the two short ones, sent together a moment later, would otherwise be batched
    # (--max-batch 4) and run first whenever they reached the queue before it.
    sender = threading.Thread(target=lambda: answers.extend(asyncio.run(post_first_then_rest(url, bodies, 1.0))))
    sender.start()
    deadline = time.monotonic() + 30
    while "paradit_queue_depth 2.0" not in httpx.get(url + "/metrics").text:  # one running, two waiting
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    refused = httpx.post(url + "/v1/images/generations", json=GOOD)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    sender.join(60)
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    assert process.wait(60) == 0, "".join(lines)
