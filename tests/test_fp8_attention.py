"""FP8 attention (``--attention fp8``): the Triton kernel run by Triton's interpreter on the CPU, against exact fp32
attention within a bound derived from the 8-bit formats; Ring's merge of its partial results; the engine through
every family's attention entry point and the parallel plans; the per-step switch; the refusals.

The bound. Round-to-nearest into e4m3 (3 mantissa bits) errs by at most u = 2^-4 of a value, and by u/√3 RMS when
the error is uniform. P (scaled to the format's largest power of two) and V (per channel) are each rounded once, so
each adds u/√3 of relative error to the output, whose terms average independent errors as they average the values. Q
and K in INT8 each err by half a step (step = the block's absolute maximum / 127), step/√12 RMS a coordinate, so a
score (scaled by 1/√D) errs by RMS δs = √(D/12) · (step_q · rms(k) + step_k · rms(q)) / √D, and moves the output by
δs of its spread, relative to the output's size about δs again. In all: relative L2 ≈ √(2 (u/√3)² + δs²); the tests
allow twice that, for the approximations (independence, uniform errors). A query's log-sum-exp moves by the errors
of its largest scores only: within 6 δs. Measured, the kernel's error is about two thirds of the estimate."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from paradit.engine import Engine
from paradit.errors import InvalidRequest
from paradit.layers import fp8_attention
from paradit.layers.attention import _masked_attention_with_lse
from paradit.layers.fp8_attention import KEY_TILE, fp8_attention_with_lse
from paradit.options import ExecutionOptions
from paradit.parallel.config import ParallelConfig
from paradit.parallel.sequence import merge_partials
from paradit.request import GenerationRequest

U = 2.0**-4  # e4m3's largest relative rounding error


def exact(q, k, v, key_mask=None):
    """fp32 attention and log-sum-exp in the entry point's (B, L, H, D) layout."""
    out, lse = _masked_attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), key_mask)
    return out.transpose(1, 2), lse


def score_error(q: torch.Tensor, k: torch.Tensor) -> float:
    """RMS δs above: the blocks' steps at their largest (queries per kernel tile bound above by the whole)."""
    k = k - k.mean(dim=1, keepdim=True)  # what the kernel quantizes
    step_q, step_k = q.abs().max().item() / 127, k.abs().max().item() / 127
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    return math.sqrt(q.shape[-1] / 12) * (step_q * rms(k) + step_k * rms(q)) / math.sqrt(q.shape[-1])


def output_bound(q, k) -> float:
    return 2 * math.sqrt(2 * (U / math.sqrt(3)) ** 2 + score_error(q, k) ** 2)


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(q_len: int, k_len: int, heads: int = 2, dim: int = 64, batch: int = 1, seed: int = 0, offset: float = 3.0):
    """N(0, 1) queries and values; keys N(0, 1) plus an offset per channel shared by every key (which the kernel's
    smoothing must remove: unsmoothed, the 8 bits would spend their range on it)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, heads, dim, generator=generator)
    shared = offset * torch.randn(1, 1, heads, dim, generator=generator)
    k = torch.randn(batch, k_len, heads, dim, generator=generator) + shared
    v = torch.randn(batch, k_len, heads, dim, generator=generator)
    return q, k, v


@pytest.mark.parametrize(
    "q_len, k_len, heads, dim, batch",
    [(300, 300, 2, 64, 1), (77, 333, 3, 128, 2), (256, 64, 1, 32, 1), (5, 2, 2, 24, 1)],
    ids=["self", "cross-uneven", "one-key-tile", "tiny-odd-head-dim"],
)
def test_kernel_is_within_the_derived_bound_of_exact_attention(q_len, k_len, heads, dim, batch):
    q, k, v = inputs(q_len, k_len, heads, dim, batch)
    out, lse = fp8_attention_with_lse(q, k, v)
    want, want_lse = exact(q, k, v)
    bound = output_bound(q, k)
    assert relative_l2(out, want) < bound < 0.15
    assert (lse - want_lse).abs().max().item() < 6 * score_error(q, k)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (batch, heads, q_len)


def test_smoothing_keeps_a_large_shared_key_component_within_the_bound():
    """A shared offset 30 times the keys' spread: without smoothing INT8's steps would be 30 times coarser."""
    q, k, v = inputs(200, 200, offset=30.0)
    out, lse = fp8_attention_with_lse(q, k, v)
    want, want_lse = exact(q, k, v)
    assert relative_l2(out, want) < output_bound(q, k)
    # The log-sum-exp gets back what smoothing took from the scores (q·mean: here about 30 per query).
    assert (lse - want_lse).abs().max().item() < 6 * score_error(q, k)


def test_padding_masked_keys_and_fully_masked_queries():
    q, k, v = inputs(130, 190, batch=2)
    key_mask = torch.ones(2, 190, dtype=torch.bool)
    key_mask[0, 150:] = False
    key_mask[1, :] = False  # every key of the second row masked: output 0, log-sum-exp -inf, as the exact kernel
    out, lse = fp8_attention_with_lse(q, k, v, key_mask)
    want, want_lse = exact(q, k, v, key_mask)
    assert relative_l2(out[0], want[0]) < output_bound(q[:1], k[:1, :150])
    assert (lse[0] - want_lse[0]).abs().max().item() < 6 * score_error(q[:1], k[:1, :150])
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))


def test_strided_inputs_as_the_projections_give_them():
    """Q, K, V as views of one fused projection (FLUX.2's single blocks): strides, not copies."""
    fused = torch.randn(1, 150, 3 * 2 * 64)
    q, k, v = (t.unflatten(-1, (2, 64)) for t in fused.chunk(3, dim=-1))
    out, _ = fp8_attention_with_lse(q, k, v)
    assert relative_l2(out, exact(q, k, v)[0]) < output_bound(q, k)


def test_ring_merge_of_the_kernels_partials_is_within_the_bound():
    """Ring attention merges each key block's partial result by its log-sum-exp. The kernel's blocks each smooth and
    scale their own keys, so their partials differ from exact ones; merged, they stay within the same bound of exact
    attention, and the exact partials merge to exact attention."""
    q, k, v = inputs(140, 3 * 90)
    merged = exact_merged = lse_acc = exact_lse = None
    for block in range(3):
        keys = slice(90 * block, 90 * (block + 1))
        merged, lse_acc = merge_partials(merged, lse_acc, *fp8_attention_with_lse(q, k[:, keys], v[:, keys]))
        exact_merged, exact_lse = merge_partials(exact_merged, exact_lse, *exact(q, k[:, keys], v[:, keys]))
    want, want_lse = exact(q, k, v)
    torch.testing.assert_close(exact_merged, want, atol=1e-5, rtol=1e-5)
    assert relative_l2(merged, want) < output_bound(q, k)
    assert (lse_acc.squeeze(-1).transpose(1, 2) - want_lse).abs().max().item() < 6 * score_error(q, k)


def test_tiles_loaded_through_tensor_descriptors_give_the_pointer_loads_result(monkeypatch):
    """Hopper loads the tiles through TMA descriptors, other GPUs through pointers: the same numbers either way."""
    q, k, v = inputs(77, 333, heads=3)
    by_pointers = fp8_attention_with_lse(q, k, v)
    monkeypatch.setattr(fp8_attention, "uses_descriptors", lambda device: True)
    by_descriptors = fp8_attention_with_lse(q, k, v)
    for got, want in zip(by_descriptors, by_pointers, strict=True):
        assert torch.equal(got, want)


def test_the_kernel_compiles_for_hopper_to_8_bit_warpgroup_products_fed_by_tma(tmp_path):
    """The interpreter runs the kernel's arithmetic, not its lowering. Triton's compiler runs on the CPU, so the
    kernel is compiled for sm_90 as the H200 launches it (benchmarks/fp8_attention_isa.py): Q·Kᵀ must multiply INT8
    and P·V e4m3 on the warpgroup MMA, its tiles copied by TMA. Compiled only, with the interpreter off."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_attention_isa.py"
    command = [
        sys.executable,
        str(script),
        "--targets",
        "hopper",
        "--configs",
        "64,128,4,3",
        "--out-dir",
        str(tmp_path),
    ]
    run = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads((tmp_path / "fp8_attention_isa.json").read_text())["rows"]
    matrix = row["matrix"].split()
    assert any(name.endswith(".s32.s8.s8") for name in matrix), matrix
    assert any(name.endswith(".f32.e4m3.e4m3") for name in matrix), matrix
    assert row["tma_loads"] > 0


def test_the_fastest_config_is_chosen_and_a_gpu_that_compiles_none_is_told_so(monkeypatch):
    import triton

    refused = triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")
    times = {(64, 128, 4, 3): 2.0, (128, 128, 8, 3): refused, (64, 128, 4, 2): 1.5}

    def timed(launch, **_):
        return launch()

    def launch(config):
        if isinstance(times[config], Exception):
            raise times[config]
        return times[config]

    monkeypatch.setattr(triton.testing, "do_bench", timed)
    assert fp8_attention.fastest(launch, list(times)) == (64, 128, 4, 2)
    # Two refused configs: a single one is taken untimed.
    with pytest.raises(RuntimeError, match=r"compiled none of the FP8 attention configs .*; run with --attention sdpa"):
        fp8_attention.fastest(launch, [(128, 128, 8, 3), (128, 128, 8, 3)])


def test_mi300s_fp8_format_is_within_the_same_bound(monkeypatch):
    """MI300 multiplies e4m3fnuz (largest 240, so P is scaled to 2^7, not 2^8): the same 3 mantissa bits, the same
    bound. What the interpreter can show of the ROCm path; benchmarks/fp8_attention_isa.py compiles it for gfx942
    (20-80 s an AMD target: not in the suite)."""
    monkeypatch.setattr(fp8_attention, "fp8_dtype", lambda device: torch.float8_e4m3fnuz)
    q, k, v = inputs(77, 333, heads=3)
    out, lse = fp8_attention_with_lse(q, k, v)
    want, want_lse = exact(q, k, v)
    assert relative_l2(out, want) < output_bound(q, k)
    assert (lse - want_lse).abs().max().item() < 6 * score_error(q, k)


def test_per_block_scales_follow_the_keys_range():
    """Keys whose scale changes 100-fold along the sequence: one scale for all would leave the small ones a few
    steps; per block of ``KEY_TILE`` keys each gets the whole INT8 range."""
    q, k, v = inputs(100, 4 * KEY_TILE, offset=0.0)
    k = k * torch.logspace(-1, 1, 4 * KEY_TILE)[None, :, None, None]
    q = q * 0.1
    out, _ = fp8_attention_with_lse(q, k, v)
    assert relative_l2(out, exact(q, k, v)[0]) < 2 * math.sqrt(2) * U / math.sqrt(3) * 1.2


# ---- the engine -----------------------------------------------------------------------------------------------------

MODEL, SIZE = "qwen-image-tiny", 64
REQUEST = GenerationRequest(prompt="a lighthouse", height=SIZE, width=SIZE, steps=3, seed=5)


def image(result) -> np.ndarray:
    return np.asarray(result.images[0], dtype=np.float32)


@pytest.fixture(scope="module")
def one_process_images():
    runs = {}
    choices = {
        "sdpa": ExecutionOptions(),
        "fp8": ExecutionOptions(attention="fp8"),
        "fp8 exact ends": ExecutionOptions(attention="fp8", attention_bf16_steps=2),
    }
    for name, options in choices.items():
        with Engine(MODEL, device="cpu", options=options) as engine:
            runs[name] = image(engine.generate(REQUEST))
    return runs


def test_the_engine_attends_in_fp8_through_the_entry_point(one_process_images):
    sdpa, fp8 = one_process_images["sdpa"], one_process_images["fp8"]
    assert np.abs(sdpa - fp8).max() > 0  # the kernel ran
    assert np.abs(sdpa - fp8).mean() < 2.0  # 8-bit levels: the image is the same one


def test_exact_steps_at_both_ends_cover_a_short_request_whole(one_process_images):
    """``attention_bf16_steps=2`` of 3 steps leaves no step in FP8: SDPA's image bit for bit."""
    assert np.array_equal(one_process_images["fp8 exact ends"], one_process_images["sdpa"])


@pytest.mark.parametrize(
    "plan",
    [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(pipefusion=2)],
    ids=["ulysses2", "ring2", "pipefusion2"],
)
def test_plans_attend_in_fp8_like_one_process(plan, one_process_images):
    """Ulysses gives each rank whole heads over the whole sequence, the kernel's very tiles: one process's image.
    Ring's blocks are quantized each on its own (its smoothing, its scales) and PipeFusion's warm-up step attends
    fresh keys as one process does: within 8-bit levels of one process's FP8 image, as FP8 is of SDPA's."""
    with Engine(MODEL, device="cpu", parallel=plan, options=ExecutionOptions(attention="fp8")) as engine:
        got = image(engine.generate(REQUEST))
    fp8 = one_process_images["fp8"]
    if plan.ulysses > 1:
        assert np.abs(got - fp8).max() <= 1.0
    else:
        assert np.abs(got - fp8).mean() < 2.0


def test_bad_attention_options_are_one_line_naming_the_choices():
    with pytest.raises(InvalidRequest, match="--attention 'fp4' is not allowed; choose one of sdpa, fp8"):
        Engine(MODEL, device="cpu", options=ExecutionOptions(attention="fp4"))
    with pytest.raises(InvalidRequest, match="--attention-bf16-steps keeps the first and last steps exact under FP8"):
        Engine(MODEL, device="cpu", options=ExecutionOptions(attention_bf16_steps=2))


def test_the_cpu_without_the_interpreter_and_a_machine_without_triton_are_refused():
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    command = [
        sys.executable,
        "-m",
        "paradit",
        "generate",
        "--model",
        MODEL,
        "--device",
        "cpu",
        "--prompt",
        "a",
        "--attention",
        "fp8",
        "--out",
        "never.png",
    ]
    run = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)
    assert run.returncode == 2 and not os.path.exists("never.png")
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "FP8 attention needs a GPU; on the CPU only Triton's interpreter runs it (TRITON_INTERPRET=1); run with "
            "--attention sdpa"
        )
    )
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from paradit.layers.fp8_attention import check_fp8_attention\nimport torch\n"
        "check_fp8_attention(torch.device('cpu'))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "FP8 attention needs Triton 3.4 or newer (pip install triton" in run.stderr
