"""The scheduler and the HTTP layer over stand-in engines (no model runs): batching, the bounded queue's 429,
timeouts, cancellation, a request failing in the workers, a group rebuilt after a worker died with the queue kept.
The real engines' side of these is in test_serving.py."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from paradit.errors import InvalidRequest
from paradit.families import FAMILIES
from paradit.request import GenerationRequest, GenerationResult, ResolvedRequest, Timings
from paradit.serving.jobs import JobCancelled, JobTimeout, QueueFull
from paradit.serving.metrics import Metrics
from paradit.serving.pace import Pace
from paradit.serving.scheduler import Scheduler
from paradit.serving.server import ServerConfig, create_app
from paradit.settings import resolve_model
from paradit.worker import RequestCancelled, RequestFailed, WorkerFailure

SPEC = resolve_model("flux2-tiny")
STEP_S = 0.02


class StandInEngine:
    """What the scheduler uses of an Engine: each step sleeps; a prompt can ask it to fail, to 'kill a worker', or to
    be stuck inside a step until its workers are killed (``abort``). ``running`` is the set of engines in a run, shared
    by all."""

    def __init__(self, runs: list, running: set, plan: str = "stand-in") -> None:
        self.runs = runs  # every batch it ran, as prompt lists
        self.running = running
        self.overlapped: list[set] = []  # who else ran while this one did
        self.plan = plan
        self.worker_pids: list[int] = []
        self.steps_done = 0
        self._cancel, self.aborted = threading.Event(), threading.Event()
        self.closed = False

    def generate(self, requests: list[ResolvedRequest]) -> list[GenerationResult]:
        self.runs.append([prompt for r in requests for prompt in r.prompts])
        self.running.add(self)
        try:
            return self._generate(requests)
        finally:
            self.overlapped.append(set(self.running))
            self.running.discard(self)

    def _generate(self, resolved: list[ResolvedRequest]) -> list[GenerationResult]:
        self._cancel.clear()
        for self.steps_done in range(resolved[0].steps + 1):
            if self._cancel.is_set():
                raise RequestCancelled("stopped")
            if resolved[0].prompts == ["worker dies"] and self.steps_done == 1:
                raise WorkerFailure("worker 0 exited with code -9\nthe worker group was stopped")
            if resolved[0].prompts == ["stuck"] and not self.aborted.wait(timeout=30):
                raise AssertionError("a stuck run was never aborted")
            if self.aborted.is_set():
                raise WorkerFailure("worker 0 exited with code -9; the worker group was stopped")
            if resolved[0].prompts == ["fails"]:
                raise RequestFailed("RuntimeError: the prediction is NaN")
            time.sleep(STEP_S)
        timings = Timings(step_ms=[STEP_S * 1000] * resolved[0].steps)
        return [GenerationResult(torch.zeros(r.batch, 3, 16, 16), r.seed, timings) for r in resolved]

    def cancel(self) -> None:
        self._cancel.set()

    def abort(self) -> None:
        self.aborted.set()

    def close(self) -> None:
        self.closed = True


@contextlib.contextmanager
def scheduler(groups: int = 1, **options):
    runs, engines, running = [], [], set()

    def build(index: int) -> StandInEngine:
        engines.append(StandInEngine(runs, running, "split" if options.get("auto") and index == 0 else "alone"))
        return engines[-1]

    check = lambda request: FAMILIES[SPEC.family].resolve_request(SPEC, request)  # noqa: E731
    scheduling = Scheduler(build, groups, check, Metrics(), **options)
    scheduling.start()
    try:
        yield scheduling, runs, engines
    finally:
        scheduling.close()


def request(prompt: str = "a fox", steps: int = 2, **fields) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, steps=steps, **{"height": 32, "width": 32, **fields})


def test_compatible_requests_share_a_batch_up_to_max_batch_images_each_keeping_its_seed():
    with scheduler(max_batch=4) as (scheduling, runs, _):
        busy = scheduling.submit(request("busy", steps=20))
        while busy.state == "queued":
            time.sleep(0.005)
        jobs = [scheduling.submit(request(f"p{i}", seed=i)) for i in range(3)]
        jobs.append(scheduling.submit(request("two", num_images_per_prompt=2, seed=9)))  # 3 + 2 > 4: next batch
        jobs.append(scheduling.submit(request("other size", seed=5, steps=3)))  # another key: its own batch
        results = [job.future.result(timeout=10) for job in [busy, *jobs]]
    assert runs == [["busy"], ["p0", "p1", "p2"], ["two"], ["other size"]]
    assert [r.seed for r in results[1:]] == [0, 1, 2, 9, 5]
    assert results[4].pixels.shape[0] == 2


def test_a_full_queue_refuses_with_a_retry_estimate_and_a_queued_job_can_be_cancelled():
    with scheduler(max_queue=2) as (scheduling, _, _):
        running = scheduling.submit(request(steps=50))
        while running.state == "queued":
            time.sleep(0.005)
        waiting = [scheduling.submit(request()) for _ in range(2)]
        with pytest.raises(QueueFull, match="queue is full") as refused:
            scheduling.submit(request())
        assert refused.value.retry_after >= 1
        scheduling.cancel(waiting[0], JobCancelled("by the test"))
        assert waiting[0].state == "cancelled" and isinstance(waiting[0].future.exception(), JobCancelled)
        scheduling.submit(request())  # its place is free again
        scheduling.cancel(running, JobCancelled("by the test"))
        with pytest.raises(JobCancelled):
            running.future.result(timeout=5)
        assert running.steps_done < 50


def test_a_request_past_its_timeout_stops_its_run():
    with scheduler(timeout_s=0.3) as (scheduling, _, _):
        job = scheduling.submit(request(steps=500))
        with pytest.raises(JobTimeout, match="within 0.3 s"):
            job.future.result(timeout=5)
        assert job.steps_done < 100
        assert scheduling.submit(request(steps=1)).future.result(timeout=5).seed is not None


def test_a_request_its_measured_pace_puts_past_the_deadline_is_refused_naming_steps_or_size():
    pace = Pace(SPEC, FAMILIES[SPEC.family])
    check = FAMILIES[SPEC.family].resolve_request
    # The faster step counts. A pace three times the tiny model's real one leaves the request that is let through its
    # 3 s to finish on a loaded machine.
    pace.record([check(SPEC, request(steps=1, height=64, width=64))], [300.0, 150.0])
    with scheduler(timeout_s=3.0, pace=pace) as (scheduling, _, _):
        for asked, param in (
            (request(steps=61, height=64, width=64), "steps"),
            (request(steps=20, height=512, width=512), "size"),
        ):
            with pytest.raises(InvalidRequest, match="past its 3 s timeout") as refused:
                scheduling.submit(asked)
            assert refused.value.param == param
        assert scheduling.submit(request(steps=30, height=64, width=64)).future.result(timeout=10)


def test_a_run_that_does_not_reach_a_step_boundary_is_killed_past_its_grace_and_the_group_rebuilt(monkeypatch):
    """A step that never ends (minutes of attention at a huge size) used to hold every request behind it."""
    monkeypatch.setattr("paradit.serving.scheduler.STOP_GRACE_S", 0.5)
    with scheduler(timeout_s=0.5) as (scheduling, _, engines):
        stuck = scheduling.submit(request("stuck"))
        started = time.monotonic()
        with pytest.raises(JobTimeout, match="within 0.5 s"):
            stuck.future.result(timeout=10)
        assert 1.0 <= time.monotonic() - started < 3, "the deadline, then the grace, then the kill"
        assert engines[0].aborted.is_set()
        assert scheduling.submit(request("after")).future.result(timeout=10).seed is not None
        assert len(engines) == 2 and scheduling.groups[0].restarts == 1


def test_a_failed_request_fails_alone_and_a_dead_worker_rebuilds_the_group_keeping_the_queue():
    with scheduler() as (scheduling, _, engines):
        failing = scheduling.submit(request("fails"))
        dying = scheduling.submit(request("worker dies"))
        queued = [scheduling.submit(request(f"after {i}", seed=i)) for i in range(3)]
        with pytest.raises(RequestFailed, match="NaN"):
            failing.future.result(timeout=5)
        with pytest.raises(WorkerFailure, match="exited with code -9"):
            dying.future.result(timeout=5)
        assert [job.future.result(timeout=10).seed for job in queued] == [0, 1, 2]
        assert len(engines) == 2 and engines[0].closed
        assert scheduling.groups[0].restarts == 1 and scheduling.health()[0] == "ok"


@contextlib.contextmanager
def app_in_thread(app):
    """``app`` served by uvicorn on a free port of 127.0.0.1 from a thread of this process; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.videos.close()


@contextlib.contextmanager
def http_server(scheduling: Scheduler, **config):
    with app_in_thread(create_app(scheduling, ServerConfig("flux2-tiny", **config), scheduling.metrics)) as url:
        yield url


def test_http_status_codes_for_a_full_queue_a_timeout_a_failure_a_large_body_and_a_missing_key():
    with scheduler(max_queue=1, timeout_s=1.0) as (scheduling, _, _), http_server(scheduling, api_key="k") as url:
        headers = {"Authorization": "Bearer k"}
        body = {"prompt": "a fox", "size": "32x32", "steps": 2}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            assert httpx.get(url + "/health").status_code == 200  # no key needed
            missing = httpx.post(url + "/v1/images/generations", json=body)
            assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
            wrong = httpx.post(url + "/v1/images/generations", json=body, headers={"Authorization": "Bearer x"})
            assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
            assert client.get("/metrics").status_code == 200 and httpx.get(url + "/metrics").status_code == 401

            failed = client.post("/v1/images/generations", json={**body, "prompt": "fails"})
            assert failed.status_code == 500
            assert failed.json()["error"]["message"] == "RuntimeError: the prediction is NaN"
            large = client.post("/v1/images/generations", json={**body, "prompt": "x" * (2 << 20)})
            assert large.status_code == 413 and "limit" in large.json()["error"]["message"]

            timed_out = client.post("/v1/images/generations", json={**body, "steps": 500})
            assert timed_out.status_code == 504 and "within 1 s" in timed_out.json()["error"]["message"]

            running = scheduling.submit(request(steps=40))
            while running.state == "queued":
                time.sleep(0.005)
            scheduling.submit(request(steps=40))  # the one place in the queue
            full = client.post("/v1/images/generations", json=body)
            assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
            assert "queue is full" in full.json()["error"]["message"]
            metrics = client.get("/metrics").text
    for outcome in ("unauthorized", "failed", "timeout", "rejected"):
        assert f'endpoint="/v1/images/generations",outcome="{outcome}"' in metrics
    # refused before routing, counted under the route it asked for
    assert 'endpoint="/v1/images/generations",outcome="too_large"' in metrics


def test_auto_splits_a_lone_request_and_runs_a_queue_on_the_single_gpus_never_both_at_once():
    with scheduler(groups=3, auto=True) as (scheduling, _, engines):
        spanning = engines[0] if engines[0].plan == "split" else next(e for e in engines if e.plan == "split")
        lone = scheduling.submit(request("alone", steps=3))
        lone.future.result(timeout=5)
        with scheduling._changed:  # queued all at once: no group sees a queue of one on the way
            burst = [scheduling.submit(request(f"burst {i}", steps=5)) for i in range(8)]
        for job in burst:
            job.future.result(timeout=10)
        last = scheduling.submit(request("alone again", steps=3))
        last.future.result(timeout=5)
        switches = scheduling.metrics.registry.get_sample_value("paradit_group_mode_switches_total")
    assert lone.plan == "split" and last.plan == "split"
    assert {job.plan for job in burst} == {"alone"}  # the queue was long: independent batches
    assert all(overlap == {spanning} for overlap in spanning.overlapped)  # the split group ran alone
    singles = [engine for engine in engines if engine.plan == "alone"]
    assert any(len(overlap) == 2 for engine in singles for overlap in engine.overlapped)  # the singles together
    assert switches == 2
