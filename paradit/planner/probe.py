"""``paradit plan --link measure``: this machine's rates, bytes counted as ``parallel/comm.py`` counts them."""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from paradit.planner.profile import HardwareProfile

MATMUL_SIZE = 8192
SDPA_TOKENS = 4096
SDPA_WIDTH = 3072  # heads x head size of the probed attention
MESSAGE_BYTES = 64 * 2**20
ITERATIONS = 10


def _seconds(fn: Callable[[], object], device: torch.device, iterations: int = ITERATIONS) -> float:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(iterations):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_tflops(device: torch.device, size: int = MATMUL_SIZE) -> float:
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * size**3 / _seconds(lambda: a @ b, device) / 1e12


def attention_tflops(device: torch.device, head_dim: int, tokens: int = SDPA_TOKENS) -> float:
    heads = SDPA_WIDTH // head_dim
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    seconds = _seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), device)
    return 4 * heads * head_dim * tokens**2 / seconds / 1e12


def _collectives_worker(rank: int, world: int, init_file: str, backend: str, nbytes: int, results) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        elements = nbytes // 2
        send = torch.randn(elements, device=device).to(torch.bfloat16)
        gathered = [torch.empty_like(send) for _ in range(world)]
        received = torch.empty_like(send)
        peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world

        def ring() -> None:
            ops = [dist.P2POp(dist.isend, send, peer_next), dist.P2POp(dist.irecv, received, peer_prev)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        # Bytes one rank sends, as the runtime's counters count them.
        probes = {
            "all_to_all": (lambda: dist.all_to_all_single(received, send), nbytes * (world - 1) / world),
            "send_recv": (ring, nbytes),
            "all_reduce": (lambda: dist.all_reduce(send), 2 * nbytes * (world - 1) / world),
            "all_gather": (lambda: dist.all_gather(gathered, send), nbytes * (world - 1)),
        }
        rates = {}
        for name, (run, sent) in probes.items():
            dist.barrier()
            rates[name] = sent / _seconds(run, device) / 1e9
        if rank == 0:
            results.put(rates)
    finally:
        dist.destroy_process_group()


def collective_gbps(world: int, device_type: str = "cuda", nbytes: int = MESSAGE_BYTES) -> dict[str, float]:
    backend = "nccl" if device_type == "cuda" else "gloo"
    results = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, f"probe-{socket.gethostname()}-{os.getpid()}")
        mp.spawn(_collectives_worker, args=(world, init_file, backend, nbytes, results), nprocs=world)
    return results.get()


def measured_profile(base: HardwareProfile, gpus: int) -> HardwareProfile:
    """``base`` with this machine's rates (FP8 matmul at the base's ratio to bf16)."""
    device = torch.device("cuda", 0)
    bf16 = matmul_tflops(device)
    matmul = {precision: bf16 * rate / base.matmul_tflops["bf16"] for precision, rate in base.matmul_tflops.items()}
    attention = {dim: attention_tflops(device, dim) for dim in (64, 128)}
    links = collective_gbps(gpus) if gpus > 1 else base.link_gbps
    return dataclasses.replace(
        base,
        name=f"{base.name} (measured here)",
        predicted=False,
        matmul_tflops=matmul,
        attention_tflops=attention,
        link_gbps=links,
        description=f"{torch.cuda.get_device_name(0)}, rates measured by a probe of this machine",
    )
