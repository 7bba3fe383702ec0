"""Sparse attention chosen per request (a body's ``sparse_attention``): a tiny Wan server started without
``--sparse-attention`` makes, for a request that asks, the video a run started with the option makes, and for one
that does not, the dense video, each answer and MP4 saying which; bad choices are 400s naming what is allowed; the
wrappers a dense request passes through leave a compiled block's graph whole; ``generate --server`` sends the flags
as the field."""

from __future__ import annotations

import io
import json
import os

import httpx
import numpy as np
import pytest
import torch

from paradit.engine import Engine
from paradit.errors import InvalidRequest
from paradit.layers.sparse_attention import apply_sparse_attention
from paradit.options import ExecutionOptions, check_conflicts
from paradit.parallel.config import ParallelConfig
from paradit.pipelines.requests import resolve_sparse
from paradit.request import GenerationRequest, SparseAttentionConfig
from tests.test_serving import live_server, torch_threads

# 6 latent frames of 4 x 8 tokens: 192 tokens, two tiles, radial keeping 0.56 of the pairs.
VIDEO = {"prompt": "a boat", "size": "128x64", "frames": 21, "steps": 1, "seed": 3}
RADIAL = {"method": "radial", "dense_steps": 0, "dense_blocks": 0}


def request(sparse: SparseAttentionConfig | None = None) -> GenerationRequest:
    width, height = map(int, VIDEO["size"].split("x"))
    fields = {key: VIDEO[key] for key in ("prompt", "frames", "steps", "seed")}
    return GenerationRequest(**fields, height=height, width=width, sparse_attention=sparse)


def mp4_frames(data: bytes) -> tuple[np.ndarray, dict]:
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
        return frames, dict(container.metadata)


def served_video(client: httpx.Client, body: dict) -> tuple[dict, np.ndarray, dict]:
    job = client.post("/v1/videos", json=body).json()
    while job["status"] in ("queued", "in_progress"):
        job = client.get(f"/v1/videos/{job['id']}").json()
    assert job["status"] == "completed", job
    return job, *mp4_frames(client.get(f"/v1/videos/{job['id']}/content").content)


def encoded(result) -> np.ndarray:
    from paradit.outputs import encode_mp4

    return mp4_frames(encode_mp4(result.frames[0], 16))[0]


def test_a_request_asking_for_sparse_attention_gets_the_run_options_video_and_one_not_asking_the_dense_one():
    options = ExecutionOptions(sparse_attention="radial", sparse_dense_steps=0, sparse_dense_blocks=0)
    # The server's one-process group runs in a worker with every core's thread (worker.py): its MP4 equals these
    # only if their float pixels do, bit for bit.
    with torch_threads(os.cpu_count() or 1):
        with Engine("wan-tiny", device="cpu", options=options) as engine:
            run_option = engine.generate(request())
        with Engine("wan-tiny", device="cpu") as engine:
            dense = engine.generate(request())
    assert not torch.equal(run_option.pixels, dense.pixels)  # the mask drops pairs: the two differ
    with live_server(model="wan-tiny") as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        job, frames, tags = served_video(client, {**VIDEO, "sparse_attention": RADIAL})
        assert np.array_equal(frames, encoded(run_option))
        record = job["sparse_attention"]
        assert record["method"] == "radial" and record["settings"]["dense_steps"] == 0
        assert record["density"] == pytest.approx(run_option.timings.features["sparse_attention"].density)
        assert 0 < record["density"] < 1 and json.loads(tags["sparse_attention"]) == record

        job, frames, tags = served_video(client, VIDEO)
        assert np.array_equal(frames, encoded(dense))
        assert job["sparse_attention"] is None and "sparse_attention" not in tags

        for choice, named in (
            ({"method": "dense"}, "'radial' or 'svg2'"),
            ({**RADIAL, "top_p": 0.5}, "top_p is not a parameter of radial, which reads dense_steps, dense_blocks"),
            ({"method": "svg2"}, "start the server with --sparse-attention svg2"),
            ({"method": "radial", "decay_factor": 0}, "decay_factor: Input should be greater than 0"),
        ):
            refused = client.post("/v1/videos", json={**VIDEO, "sparse_attention": choice})
            assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.json()


def test_a_python_request_is_checked_as_the_run_options_are():
    with pytest.raises(InvalidRequest, match="unknown method 'full'; choose one of radial, svg2"):
        resolve_sparse(SparseAttentionConfig("full"))
    with pytest.raises(InvalidRequest, match="top_p 1.5 is not allowed; give a share above 0 and at most 1"):
        resolve_sparse(SparseAttentionConfig("svg2", top_p=1.5))
    with pytest.raises(InvalidRequest, match="dense_steps True is not allowed; give a whole number, 0 or more"):
        resolve_sparse(SparseAttentionConfig("radial", dense_steps=True))
    asked = SparseAttentionConfig("svg2", query_clusters=6)
    assert resolve_sparse(asked) is asked

    from types import SimpleNamespace

    # The run's refusals hold for a request's own choice.
    for plan, frames, message in (
        (ParallelConfig(), None, "masks a video's self-attention"),
        (ParallelConfig(pipefusion=2), 81, "--pipefusion"),
        (ParallelConfig(ring=2), 81, "svg2 clusters every token"),
    ):
        own = SimpleNamespace(frames=frames, cache=None, sparse_attention=SparseAttentionConfig("radial"))
        if plan.ring > 1:
            own.sparse_attention = SparseAttentionConfig("svg2")
        with pytest.raises(InvalidRequest, match=message):
            check_conflicts(plan, ExecutionOptions(sparse_attention="svg2"), "cuda", own)


def test_dense_requests_through_the_installed_wrappers_keep_a_compiled_block_whole():
    """A server's Wan runs with the sparse wrappers in place for the requests that ask: a dense request compiles to
    the graphs the model without them does (the wrapper's settings are guarded on, not a graph break)."""
    from paradit.families.wan.model import WanConfig, WanTransformer
    from tests.test_sparse_attention_parallel import inputs
    from tests.test_wan_model import tiny_config

    explanations = []
    for wrapped in (True, False):
        torch.manual_seed(0)
        model = WanTransformer(WanConfig.from_dict(tiny_config(16, 16, heads=3, head_dim=12))).eval()
        if wrapped:
            apply_sparse_attention(model, None).begin_request(None)
        torch._dynamo.reset()
        with torch.no_grad():
            explanations.append(torch._dynamo.explain(model)(*inputs()))
    wrapped, plain = explanations
    assert (wrapped.graph_count, wrapped.graph_break_count) == (plain.graph_count, plain.graph_break_count)


def test_generate_with_server_sends_the_sparse_flags_as_the_requests_field():
    from paradit.cli import build_parser
    from paradit.serving.client import request_body

    parser = build_parser()
    args = parser.parse_args(
        [
            "generate",
            "--prompt",
            "a",
            "--server",
            "http://x:1",
            "--sparse-attention",
            "radial",
            "--sparse-dense-steps",
            "4",
        ]
    )
    assert request_body(args)["sparse_attention"] == {"method": "radial", "dense_steps": 4}
    args = parser.parse_args(["generate", "--prompt", "a", "--server", "http://x:1", "--sparse-dense-steps", "4"])
    with pytest.raises(InvalidRequest, match="--sparse-dense-steps: give the --sparse-attention"):
        request_body(args)


def test_apply_finds_no_video_attention_in_an_image_model():
    from tests.test_sparse_attention_parallel import sparse_wan

    model, run = sparse_wan("radial")
    assert run.blocks == 2
    assert apply_sparse_attention(torch.nn.Linear(2, 2), None) is None
