"""The server's Prometheus metrics, in a registry of their own: servers in one process (tests) do not collide."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# From a tiny model's step on a CPU to a long video on a loaded server.
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 600, 1800)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        gauge, counter, histogram = (partial(kind, registry=self.registry) for kind in (Gauge, Counter, Histogram))
        self.queue_depth = gauge("paradit_queue_depth", "Requests waiting for a group.")
        self.requests = counter(
            "paradit_requests", "Requests answered, by endpoint and outcome.", ["endpoint", "outcome"]
        )
        self.latency = histogram(
            "paradit_latency_seconds",
            "Seconds per phase: queue (waiting for a group), text_encode, denoise and decode (the group's run), "
            "encode (the image or video file, and an image answer's JSON), total (the HTTP request).",
            ["phase"],
            buckets=SECONDS_BUCKETS,
        )
        self.batch_images = histogram(
            "paradit_batch_images", "Images per forward pass.", buckets=(1, 2, 4, 8, 16, 32, 64)
        )
        self.steps = counter("paradit_denoise_steps", "Denoise steps run.", ["group"])
        self.steps_per_second = gauge(
            "paradit_steps_per_second", "Denoise steps per second in each group's last run.", ["group"]
        )
        self.peak_memory = gauge(
            "paradit_peak_memory_bytes",
            "Peak memory in each group's last run, per worker (device memory on GPUs, process RSS on the CPU).",
            ["group", "rank"],
        )
        self.cached_steps = counter(
            "paradit_cached_steps", "Denoise steps whose blocks the step cache skipped.", ["group"]
        )
        self.cached_blocks = counter(
            "paradit_cached_block_evaluations", "Transformer block evaluations the step cache skipped.", ["group"]
        )
        self.restarts = counter("paradit_group_restarts", "Worker groups rebuilt after a worker died.", ["group"])
        self.mode_switches = counter(
            "paradit_group_mode_switches",
            "Times --group-size auto switched between splitting batches across every GPU and independent batches.",
        )

    def record_run(self, group: int, timings, images: int) -> None:
        denoise_s = sum(timings.step_ms) / 1000
        self.latency.labels("text_encode").observe(timings.text_encode_s)
        self.latency.labels("denoise").observe(denoise_s)
        self.latency.labels("decode").observe(timings.vae_decode_s)
        self.batch_images.observe(images)
        self.steps.labels(str(group)).inc(len(timings.step_ms))
        cache = timings.features.get("step_cache")
        self.cached_steps.labels(str(group)).inc(cache.skipped_steps if cache else 0)
        self.cached_blocks.labels(str(group)).inc(cache.blocks_skipped if cache else 0)
        if denoise_s > 0:
            self.steps_per_second.labels(str(group)).set(len(timings.step_ms) / denoise_s)
        for rank, peak in enumerate(timings.peak_memory_per_rank or [timings.peak_memory_bytes]):
            self.peak_memory.labels(str(group), str(rank)).set(peak)
