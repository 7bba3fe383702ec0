"""The front's RemoteScheduler under ``paradit serve --ray``, with a stand-in for the replicas: a request whose replica
dies is run once more with the same seed, one that loses two replicas ends in ReplicaLost (503, Retry-After), and a
drain waits for the accepted requests."""

from __future__ import annotations

import asyncio

import pytest

from paradit.options import Asked
from paradit.request import GenerationRequest
from paradit.serving.jobs import COMPLETED, FAILED, Draining
from paradit.serving.remote import RETRY_AFTER_S, RemoteScheduler, ReplicaLost
from paradit.settings import settle


class Died(Exception):
    pass


def scheduler_over(deaths: int):
    """A scheduler whose first ``deaths`` runs die; the seeds each run was sent."""
    sent: list[int] = []

    async def run(request: GenerationRequest, video: bool):
        sent.append(request.seed)
        if len(sent) <= deaths:
            raise Died
        return f"image of seed {request.seed}", "1 process"

    check = settle(Asked(model="flux2-tiny", device="cpu")).resolve
    return RemoteScheduler(check, run, (Died,), timeout_s=10), sent


def outcome(deaths: int, request: GenerationRequest):
    async def submitted():
        scheduler, sent = scheduler_over(deaths)
        job = scheduler.submit(request)
        ended = asyncio.wrap_future(job.future)
        await asyncio.wait([ended])
        ended.exception()  # read here, so that asyncio does not report it as never retrieved
        return job, sent

    return asyncio.run(submitted())


def test_a_request_whose_replica_dies_runs_again_with_the_seed_drawn_once():
    job, sent = outcome(1, GenerationRequest(prompt="a fox", steps=1))
    assert job.state == COMPLETED and len(sent) == 2 and sent[0] == sent[1] == job.resolved.seed
    assert job.future.result() == f"image of seed {job.resolved.seed}" and job.plan == "1 process"


def test_a_request_that_loses_two_replicas_is_refused_with_retry_after():
    job, sent = outcome(2, GenerationRequest(prompt="a fox", steps=1, seed=7))
    assert job.state == FAILED and sent == [7, 7]
    with pytest.raises(ReplicaLost) as lost:
        job.future.result()
    assert lost.value.retry_after == RETRY_AFTER_S


def test_draining_refuses_new_requests_and_finishes_once_the_accepted_ones_have_run():
    """SIGTERM's drain under --ray: the accepted request still runs to its image, a new one gets Draining (503)."""

    async def drained():
        release = asyncio.Event()

        async def run(request: GenerationRequest, video: bool):
            await release.wait()
            return f"image of seed {request.seed}", "1 process"

        check = settle(Asked(model="flux2-tiny", device="cpu")).resolve
        scheduler = RemoteScheduler(check, run, (Died,), timeout_s=10)
        accepted = scheduler.submit(GenerationRequest(prompt="a fox", steps=1, seed=3))
        scheduler.drain()
        with pytest.raises(Draining):
            scheduler.submit(GenerationRequest(prompt="a hare", steps=1))
        finishing = asyncio.ensure_future(scheduler.finished())
        await asyncio.sleep(0.05)
        waited = not finishing.done()  # the accepted request holds the drain
        release.set()
        await finishing
        return waited, accepted

    waited, accepted = asyncio.run(drained())
    assert waited and accepted.state == COMPLETED and accepted.future.result() == "image of seed 3"
