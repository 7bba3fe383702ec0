"""``paradit serve``'s details, over real HTTP on 127.0.0.1 with stand-in engines (no model runs) unless a real
process is the point: the API key covers the schema and its pages; ``response_format: url`` links never follow the
client's ``Host`` header; a second server on a busy port is refused before any engine is built; a size the model
refuses is the ``size`` field's 400; SIGHUP (a terminal closing) ends ``generate`` and ``serve`` as SIGTERM does,
leaving no process and no rendezvous folder behind; a request that cannot meet its deadline is refused up front, and
a run stuck inside a step is killed."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from PIL import Image

import paradit.cli
import paradit.serving.launch
from paradit import Engine, GenerationRequest
from paradit.cli import main
from paradit.serving.server import ServerConfig, create_app
from paradit.worker import WorkerFailure
from tests import test_processes
from tests.test_processes import descendants, generate, leftovers, process_id, still_alive
from tests.test_serving_scheduler import http_server, scheduler

start = test_processes.start  # the fixture: a run in a session and a TMPDIR of its own, killed at the end

KEY = "k"
BODY = {"prompt": "a fox", "size": "32x32", "steps": 2}
# FastAPI's own routes: the schema and the pages that show it.
SCHEMA_ROUTES = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


def test_the_api_key_covers_the_schema_and_its_pages_but_not_health():
    with scheduler() as (scheduling, _, _), http_server(scheduling, api_key=KEY) as url:
        for path in (*SCHEMA_ROUTES, "/no-such-route"):
            refused = httpx.get(url + path)
            assert refused.status_code == 401, (path, refused.text)
            assert refused.headers["www-authenticate"] == "Bearer" and "API key" in refused.json()["error"]["message"]
        for path in SCHEMA_ROUTES:
            assert httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
        assert httpx.get(url + "/openapi.json", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200


@contextlib.contextmanager
def app_on(host: str):
    """A stand-in server's app on ``host`` (a free port) served from a thread, without an API key; yields its port."""
    with scheduler() as (scheduling, _, _):
        app = create_app(scheduling, ServerConfig("flux2-tiny"), scheduling.metrics)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        try:
            yield server.servers[0].sockets[0].getsockname()[1]
        finally:
            server.should_exit = True
            thread.join(10)
            app.state.videos.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_file_urls_name_the_address_the_request_reached_never_the_host_header(host):
    """Bound to every interface, the link names the interface the client reached (here 127.0.0.1)."""
    with app_on(host) as port:
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/images/generations",
            json={**BODY, "response_format": "url"},
            headers={"Host": "evil.example.com"},
        )
        assert answer.status_code == 200, answer.text
        url = answer.json()["data"][0]["url"]
        assert url.startswith(f"http://127.0.0.1:{port}/v1/files/"), url
        image = httpx.get(url)
        assert image.status_code == 200 and image.headers["content-type"] == "image/png"


def test_a_second_server_on_a_busy_port_is_refused_before_any_engine_is_built(monkeypatch, capsys):
    def build_scheduler(*args, **kwargs):
        raise AssertionError("an engine was built for a server that cannot listen")

    monkeypatch.setattr(paradit.serving.launch, "build_scheduler", build_scheduler)
    monkeypatch.setattr(paradit.cli, "start_worker_server", lambda device: None)  # no workers are wanted here
    with scheduler() as (scheduling, _, _), http_server(scheduling) as url:
        port = int(url.rsplit(":", 1)[1])
        code = main(["serve", "--model", "flux2-tiny", "--device", "cpu", "--port", str(port)])
        assert httpx.get(url + "/health").status_code == 200  # the first server serves on
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("paradit: error:") and f"port {port} on 127.0.0.1" in line and "--port" in line, line


def test_a_size_the_model_refuses_is_a_400_naming_size_and_the_allowed_values():
    with scheduler() as (scheduling, _, _), http_server(scheduling, api_key=KEY) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        for size in ("40x32", "16x8208"):
            with pytest.raises(openai.BadRequestError) as refused:
                client.images.generate(prompt="a fox", size=size)
            message = refused.value.body["message"]
            assert refused.value.body["param"] == "size", message
            assert "size" in message and "multiples of 16 from 16 to 8192" in message and '"auto"' in message
            assert "128x128" in message, message  # what auto gives for this model
        assert client.images.generate(prompt="a fox", size="32x32", extra_body={"steps": 1}).data
        bad_steps = httpx.post(
            url + "/v1/images/generations",
            json={**BODY, "size": "40x32", "steps": 0},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert bad_steps.status_code == 400 and bad_steps.json()["error"]["param"] == "steps"
    with scheduler() as (scheduling, _, _), http_server(scheduling, video=True) as url:
        refused = httpx.post(url + "/v1/videos", json={**BODY, "size": "40x32"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "size", refused.text


@test_processes.pytestmark
def test_sighup_to_generate_in_a_closing_terminal_stops_it_as_sigterm_does(start, tmp_path):
    """A terminal that closes hangs up its whole foreground process group, the workers included."""
    run = start(generate(tmp_path, "--no-progress"))
    run.workers()
    processes = descendants(run.proc.pid)
    os.killpg(run.proc.pid, signal.SIGHUP)
    code = run.wait(timeout=30)
    assert code == 128 + signal.SIGTERM and run.messages() == ["paradit: terminated"], run.stderr
    assert not still_alive(processes)
    assert not leftovers(run.tmpdir)


@test_processes.pytestmark
def test_sighup_to_serve_in_a_closing_terminal_finishes_the_accepted_request_and_exits(start):
    """The workers, hung up with the terminal too, leave the ending to the server, which drains as for SIGTERM."""
    run = start(["-m", "paradit", "serve", "--model", "flux2-tiny", "--device", "cpu", "--port", "0"])
    found = run.wait_until(lambda: re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", run.stderr), "it serves")
    processes = descendants(run.proc.pid)
    answers: list[tuple[httpx.Response, float]] = []
    # About a second of denoising alone (longer on a loaded machine): still running when the terminal closes, which
    # comes within one 0.1 s poll of a group taking it.
    body = {**BODY, "steps": 40}

    def send() -> None:
        answer = httpx.post(found[1] + "/v1/images/generations", json=body, timeout=120)
        answers.append((answer, time.monotonic()))

    sender = threading.Thread(target=send)
    sender.start()
    taken = 'paradit_latency_seconds_count{phase="queue"} 1.0'  # a group took it
    run.wait_until(lambda: taken in httpx.get(found[1] + "/metrics").text, "the request running")
    hung_up = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGHUP)
    code = run.wait(timeout=120)
    sender.join(10)
    assert code == 0 and "draining" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert [answer.status_code for answer, _ in answers] == [200], run.stderr
    assert answers[0][1] > hung_up  # it was still running at the signal: the drain finished it
    assert not still_alive(processes)
    assert not leftovers(run.tmpdir)


def test_the_busy_port_check_holds_the_port_it_found_free():
    """The socket is bound and listening before the engines load, so that no other process takes the port then."""
    with paradit.serving.launch.listen("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        with pytest.raises(OSError), socket.create_server(("127.0.0.1", port)):
            pass


def test_a_request_that_cannot_meet_its_deadline_is_refused_up_front_and_the_next_one_runs():
    """``{"size": "4096x4096"}`` with ``--timeout 20`` ran for 431 s before its 504, and the small request behind it
    got a 504 without running. Now the server's measured pace refuses it at once, naming size (or steps), and
    ``--max-pixels`` bounds what one request may ask."""
    from tests.test_serving import live_server

    with live_server("flux2-tiny", timeout_s=20, max_pixels=4096 * 4096) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as client:
            for body, param, words in (
                ({"size": "4096x4096"}, "size", "would take about"),
                ({"size": "8192x4096"}, "size", "--max-pixels"),
            ):
                started = time.monotonic()
                refused = client.post("/v1/images/generations", json={"prompt": "a fox", **body})
                assert time.monotonic() - started < 5
                error = refused.json()["error"]
                assert refused.status_code == 400 and error["param"] == param and words in error["message"], error
                assert "20 s timeout" in error["message"] or words == "--max-pixels", error
            answer = client.post("/v1/images/generations", json={"prompt": "a fox", "steps": 2})
            assert answer.status_code == 200 and answer.json()["data"][0]["b64_json"], answer.text


def png_of(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (90, 40, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_default_pixel_bound_is_four_times_the_model_default_size_and_counts_input_images():
    """A reference lengthens every block's sequence as the target's pixels do: 128x128 with a 256x256 reference
    (65536 + 16384 pixels) is past flux2-tiny's 65536, with a 64x64 one within."""
    from tests.test_serving import live_server

    with live_server("flux2-tiny") as (url, _), httpx.Client(base_url=url, timeout=120) as client:
        refused = client.post("/v1/images/generations", json={"prompt": "a fox", "size": "272x256", "steps": 1})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "size" and "65536 pixels" in error["message"], error
        assert client.post("/v1/images/generations", json={"prompt": "a fox", "size": "256x256", "steps": 1}).is_success
        form = {"prompt": "a fox", "size": "128x128", "steps": "1"}
        refused = client.post("/v1/images/edits", data=form, files={"image": ("a.png", png_of(256))})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "image", error
        assert "input images of 65536 pixels" in error["message"] and "--max-pixels" in error["message"], error
        assert client.post("/v1/images/edits", data=form, files={"image": ("a.png", png_of(64))}).is_success


@test_processes.pytestmark
def test_abort_kills_a_group_inside_a_step_at_once_and_leaves_no_process():
    """What the scheduler does to a run that will not reach a step boundary: a 2048x2048 step lasts seconds here."""
    engine = Engine("flux2-tiny", device="cpu", isolate=True)
    workers, outcome = [process_id(pid) for pid in engine.worker_pids], []

    def run():
        try:
            engine.generate(GenerationRequest(prompt="a fox", steps=50, height=2048, width=2048))
        except WorkerFailure as failure:
            outcome.append((str(failure), time.monotonic()))

    runner = threading.Thread(target=run)
    runner.start()
    time.sleep(1)
    aborted = time.monotonic()
    engine.abort()
    runner.join(10)
    assert outcome and "exited with code -9" in outcome[0][0] and outcome[0][1] - aborted < 3, outcome
    assert not still_alive(workers)
    with pytest.raises(WorkerFailure, match="create a new Engine"):
        engine.generate(GenerationRequest(prompt="a fox", steps=1))


def test_client_faults_in_an_edit_form_or_a_body_are_400s_naming_the_field_and_kept_curves_serve_mag(
    tmp_path, monkeypatch
):
    """An image sent as text, a value past what any dtype holds, MagCache without a curve where none was kept, another
    method's cache parameter: each the client's 400 naming its field. The form takes the JSON body's objects
    (``cache``, ``lora``) as JSON text, and MagCache without a curve takes the one ``--cache-calibrate`` kept for the
    served model."""
    from paradit.cache_options import keep_curve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    form = {"prompt": "a fox", "size": "32x32", "steps": "2"}
    image = {"image": ("a.png", png_of(64))}
    stray = {"method": "first-block", "cache_interval": 3}  # taylorseer's
    with scheduler() as (scheduling, _, _), http_server(scheduling) as url, httpx.Client(base_url=url) as client:
        refusals = [
            (client.post("/v1/images/edits", data={**form, "image": "a.png"}), "image", "file part"),
            (client.post("/v1/images/edits", data={**form, "cache": "{method"}, files=image), "cache", "JSON text"),
            (client.post("/v1/images/generations", json={**BODY, "guidance": 1e300}), "guidance", "3.4e+38"),
            (client.post("/v1/images/generations", json={**BODY, "cache": {"method": "mag"}}), "cache", "calibrated"),
            (client.post("/v1/images/generations", json={**BODY, "cache": stray}), "cache", "not a parameter of"),
        ]
        for answer, param, words in refusals:
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["param"] == param and words in error["message"], error
        cached = {**form, "cache": '{"method": "first-block", "threshold": 0.1}'}
        assert client.post("/v1/images/edits", data=cached, files=image).is_success
        keep_curve("flux2-tiny", [1.0, 1.0])
        assert client.post("/v1/images/generations", json={**BODY, "cache": {"method": "mag"}}).is_success
        metrics = client.get("/metrics").text
    assert 'endpoint="/v1/images/edits",outcome="invalid"} 2.0' in metrics
    assert 'outcome="failed"' not in metrics
