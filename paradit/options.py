"""The records a run, a server and each command take, and ``CONFLICTS``; nothing heavy: parsers come before torch."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from paradit.errors import InvalidRequest
from paradit.families.default import DEFAULT_MODEL
from paradit.flags import (
    GENERATE,
    PLAN,
    SERVE,
    finite,
    generate_option,
    nonnegative,
    option,
    positive,
    serve_option,
)
from paradit.lora.refs import MODES, LoraSet, adapters_in, parse_adapter
from paradit.parallel.config import COMM_DTYPES, PARALLEL, ParallelConfig, parallel_option
from paradit.request import (
    SPARSE_ATTENTIONS,
    SPARSE_PARAMETER_NAMES,
    SPARSE_PARAMETERS,
    GenerationRequest,
    StepCacheConfig,
)

if TYPE_CHECKING:
    import torch

    from paradit.request import ResolvedRequest
    from paradit.spec import ModelSpec

DEVICES = ("cuda", "cpu")
DTYPES = ("bf16", "fp16", "fp32")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("none", "fp8")
ATTENTIONS = ("sdpa", "fp8")
PLACEMENTS = ("gpu", "fp8", "offload")  # where the prompt encoders live (``text_encoder``)
LINKS = ("nvlink", "pcie", "measure")

# --verify-serial's least PSNR for lossy plans (tiny models' measured deviations sit well above: docs/benchmarks.md).
LOSSY_PSNR_DB = 30.0

MEMORY = "memory"


def above_zero(text: str) -> float:
    if (value := finite(text)) <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not allowed; give a number above 0")
    return value


def share(text: str) -> float:
    if not 0 < (value := finite(text)) <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} is not allowed; give a share above 0 and at most 1")
    return value


execution_option = functools.partial(option, group="how the run executes")
sparse_option = functools.partial(option, group="sparse attention (video self-attention; lossy)")
lora_option = functools.partial(generate_option, group="LoRA adapters (applied to the transformer)")
served_lora_option = functools.partial(serve_option, group="LoRA adapters each request may choose (its lora field)")


@dataclass(frozen=True)
class ExecutionOptions:
    """How the transformers execute; None leaves the choice to the tuned configuration, the planner or the device."""

    quantize: str | None = execution_option(
        choices=QUANTIZATIONS, help="fp8: e4m3 linears (sm89+, MI300, RDNA 4); default none, or the planner's"
    )
    compile: bool | None = execution_option(
        action=argparse.BooleanOptionalAction,
        help="regional torch.compile of the repeated blocks (default: on GPUs only)",
    )
    cuda_graphs: bool | None = execution_option(
        action="store_true", help="replay each step from a CUDA graph (short steps)"
    )
    swap_experts: bool | None = option(
        action="store_true",
        group=MEMORY,
        help="models with two experts: one expert on the GPU, the other in pinned host memory, swapped at the "
        "boundary (chosen by itself when the GPU's memory leaves no room for both)",
    )
    lora: LoraSet = option(factory=LoraSet)
    attention: str | None = execution_option(
        choices=ATTENTIONS,
        help="fp8: self-attention in 8 bits through paradit's Triton kernel (sm89+, MI300, RDNA 4; long sequences, "
        "such as video); default sdpa",
    )
    attention_bf16_steps: int = execution_option(
        0,
        type=nonnegative,
        metavar="N",
        help="with --attention fp8: the first and last N steps attend exactly, in the run's dtype",
    )

    sparse_attention: str | None = sparse_option(
        choices=SPARSE_ATTENTIONS,
        help="LOSSY: a video's self-attention attends only the 128x128 tiles a block mask keeps (skipping the rest): "
        "radial, the static mask of Radial attention (Li et al. 2025; its spatial window shrinks with temporal "
        "distance), or svg2, per-head k-means clusters of the queries and keys and each query cluster's top-p key "
        "clusters (Sparse VideoGen2); the density it ran at is reported; never chosen unasked",
    )
    sparse_dense_steps: int | None = sparse_option(
        type=nonnegative,
        metavar="N",
        help="the first N steps dense (default: radial 12, the paper's; svg2 a fifth of the steps, SVG2's)",
    )
    sparse_dense_blocks: int | None = sparse_option(
        type=nonnegative,
        metavar="N",
        help="the first N blocks dense at every step (default: radial 1, the paper's; svg2 3 in 100, rounded up)",
    )
    sparse_decay_factor: float | None = sparse_option(
        type=above_zero, help="radial: scales the window of frames 2 or more apart (default 1, the paper's)"
    )
    sparse_query_clusters: int | None = sparse_option(
        type=positive, metavar="N", help="svg2: k-means clusters of each head's queries (default 300)"
    )
    sparse_key_clusters: int | None = sparse_option(
        type=positive, metavar="N", help="svg2: k-means clusters of each head's keys (default 1000)"
    )
    sparse_top_p: float | None = sparse_option(
        type=share,
        help="svg2: each query cluster attends the key clusters holding this share of its attention (default 0.9)",
    )

    def compiles(self, device) -> bool:
        return device.type == "cuda" if self.compile is None else self.compile

    def sparse_parameters(self) -> dict[str, object]:
        """The sparse-attention parameters given, by name: for their refusals and the run's record."""
        return {
            name: value for name in SPARSE_PARAMETER_NAMES if (value := getattr(self, f"sparse_{name}")) is not None
        }


@dataclass(frozen=True)
class Asked:
    """What a user asked for; None (and ``auto``) leave the choice to paradit."""

    model: str | ModelSpec = option(
        DEFAULT_MODEL, help="preset name, checkpoint folder or hub id", absent=DEFAULT_MODEL
    )
    device: str | None = execution_option(choices=DEVICES, help="default: cuda when a GPU is visible")
    dtype: str | torch.dtype | None = execution_option(choices=DTYPES, help="the run's dtype")
    load_format: str = execution_option("auto", choices=LOAD_FORMATS, help="dummy: random weights")
    allow_pickle: bool = execution_option(
        False, action="store_true", help="load a checkpoint's pickle (.bin) weights: they can run code"
    )
    gpus: int | None = parallel_option(
        type=positive, help="processes in the group; default: the product of the degrees"
    )
    parallel: ParallelConfig | None = None
    comm_dtype: str | None = parallel_option(
        choices=COMM_DTYPES, help="fp8: Ulysses/Ring traffic in FP8 with scales (default auto)"
    )
    patches: int | None = parallel_option(
        type=positive, help="pipefusion: image patches in flight per step (default 1)"
    )
    warmup_steps: int | None = parallel_option(
        type=positive, help="pipefusion: exact steps before patching (default 1)"
    )
    shard_weights: int | None = parallel_option(
        type=positive,
        metavar="N",
        help="each of N neighbouring GPUs keeps 1/N of the weights, gathering each block just before it runs (FSDP; "
        "with ulysses, ring, cfg; N divides the GPUs)",
    )
    options: ExecutionOptions = option(factory=ExecutionOptions)
    max_gpu_memory: str | int | None = option(
        group=MEMORY, help="per-GPU cap with its unit, e.g. 32GiB or 30GB: a plan that cannot fit is refused"
    )
    text_encoder_placement: str = option(
        "auto",
        choices=("auto", *PLACEMENTS),
        group=MEMORY,
        help="prompt encoders on rank 0's GPU, there with FP8 linears (with --quantize fp8), or in CPU memory streamed "
        "to it while encoding; auto: the first that fits the GPU's memory (its cap, or what it has free)",
    )


@dataclass(frozen=True)
class LoraFlags:
    """The adapters' flags: ``generate``'s by path and scale, ``serve``'s by name (each request chooses among them)."""

    lora: list[str] | None = lora_option(
        action="append",
        metavar="PATH[:SCALE]",
        help="a .safetensors file, a folder or a hub id; repeatable; scale default 1 (of a model with two experts: "
        "the high-noise one; with --server: NAME[:SCALE] of the server's adapters)",
    )
    lora_2: list[str] | None = lora_option(
        action="append", metavar="PATH[:SCALE]", help="a second expert's (the low-noise one)"
    )
    lora_weight_name: str | None = lora_option(help="the adapter file inside a folder or hub repository")
    lora_mode: str = lora_option(
        "fused",
        choices=MODES,
        absent="fused",
        help="fused into the weights at load (no cost per step), or low-rank side paths beside the linears",
    )
    named: list[str] | None = served_lora_option(
        name="--lora", action="append", metavar="NAME=PATH", help="an adapter and its name; repeatable"
    )
    named_2: list[str] | None = served_lora_option(
        name="--lora-2", action="append", metavar="NAME=PATH", help="a second expert's (the low-noise one)"
    )
    lora_dir: str | None = served_lora_option(
        help="every .safetensors adapter in this folder, named by its file's stem"
    )
    lora_cache: int = served_lora_option(
        0,
        type=nonnegative,
        metavar="N",
        absent=0,
        help="choices of adapters and scales kept fused into weights of their own, the N most recently used: no cost "
        "per step, one merge a miss, the weights they change held N+1 times (0: side paths beside the weights)",
    )

    def lora_set(self) -> LoraSet | None:
        """The adapters these flags name (None: none); a server's are loaded unchosen."""
        served = tuple(parse_adapter(text, "--lora", named=True) for text in self.named or ())
        served += adapters_in(self.lora_dir) if self.lora_dir else ()
        served_2 = tuple(parse_adapter(text, "--lora-2", named=True) for text in self.named_2 or ())
        if served or served_2:
            return LoraSet(served, served_2, "unfused", switchable=True, cache=self.lora_cache)
        if self.lora_cache:
            raise InvalidRequest("--lora-cache keeps choices of named adapters: give --lora NAME=PATH or --lora-dir")
        first = tuple(parse_adapter(text, "--lora", self.lora_weight_name) for text in self.lora or ())
        second = tuple(parse_adapter(text, "--lora-2", self.lora_weight_name) for text in self.lora_2 or ())
        return LoraSet(first, second, self.lora_mode) if first or second else None


def group_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; give 1 or more, or auto") from None


@dataclass(frozen=True)
class ServeSettings:
    """What ``paradit serve`` was asked for; ``asked``'s unset options follow the tuned choice for a group's size."""

    asked: Asked = option(factory=Asked)
    gpus: int = serve_option(1, type=positive, absent=1, help="GPUs to serve with (CPU processes with --device cpu)")
    group_size: int | str | None = serve_option(
        type=group_size,
        help="GPUs per group, each running the plan generate chooses for that many: --gpus (the default) splits each "
        "request over all of them (lowest latency), 1 serves independent requests on each (most throughput); auto "
        "chooses per batch from the queue (each GPU then holds the model twice)",
    )
    host: str = serve_option(
        "127.0.0.1",
        absent="127.0.0.1",
        help="the address to listen on (0.0.0.0: every interface) and url answers link to (under 0.0.0.0: the one a "
        "request reached; never its Host)",
    )
    port: int = serve_option(8000, type=int, absent=8000, help="0: any free one; one in use is refused before loading")
    api_key: str | None = serve_option(
        help="require `Authorization: Bearer KEY` on every route but /health (default: $PARADIT_API_KEY)"
    )
    max_batch: int = serve_option(
        1,
        type=positive,
        absent=1,
        help="images per forward pass: queued requests of the same size, steps and guidance run together (more "
        "throughput; a batched image can differ from the unbatched one in its last bits)",
    )
    max_queue: int = serve_option(64, type=positive, absent=64, help="requests waiting; more get 429 (Retry-After)")
    timeout_s: float = serve_option(
        600.0,
        name="--timeout",
        type=positive,
        absent=600,
        help="seconds a request may take, its wait included: one its measured pace puts at 3x that is refused, a "
        "run past it stopped within a step",
    )
    max_pixels: int | None = serve_option(
        type=positive, help="width x height a request may ask for (default 4x the model's default size)"
    )
    files_dir: Path | None = serve_option(
        type=Path,
        metavar="DIR",
        help="keep url images, MP4s and video jobs' records in this folder (made if missing) instead of in memory: "
        "every server over the same folder (a shared mount: NFS, a PVC) answers for them, also after a restart",
    )


@dataclass(frozen=True)
class GenerateFlags:
    out: str | None = generate_option(
        help="image path, its format from the extension (.png, .jpg, .jpeg, .webp); a video's: .mp4 (H.264), or a "
        "folder (or an image extension: x.png -> x/) for one image per frame; with several images or videos, _N is "
        "appended to the name (default: out/paradit.png, out/paradit.mp4 for video models)"
    )
    json: str | None = generate_option(help="also write the closing table, the seed and the plan to this JSON file")
    server: str | None = generate_option(
        help="send the request to a running `paradit serve` at this URL (http://host:port) instead"
    )
    api_key: str | None = generate_option(help="with --server: the server's API key (default: $PARADIT_API_KEY)")
    devices: str | None = generate_option(
        help="which GPUs, e.g. 2,3 (sets CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES for this run)"
    )
    no_progress: bool = generate_option(False, action="store_true", help="hide the progress bar")
    verify_serial: bool = generate_option(
        False,
        action="store_true",
        group=PARALLEL,
        help="also run the request in one process and compare: exit 3 when an exact plan differs by more than one "
        f"8-bit level, or a lossy one (FP8 transport, PipeFusion patches) falls under {LOSSY_PSNR_DB:.0f} dB PSNR",
    )


@dataclass(frozen=True)
class PlanFlags:
    profile: str | None = option(
        commands=(PLAN,),
        help="plan for this hardware profile's GPUs instead of this machine (see paradit/planner/profiles/)",
    )
    link: str | None = option(
        choices=LINKS,
        commands=(PLAN,),
        help="the profile's GPU with these links; measure: probe this machine's matmul, attention and collectives",
    )


LOCAL_RAY = "local"  # ``--ray`` alone: a Ray instance started here


@dataclass(frozen=True)
class RayFlags:
    """``paradit serve --ray``: its groups as Ray Serve replicas behind one front (serving/ray_app.py)."""

    ray: str | None = serve_option(
        nargs="?",
        const=LOCAL_RAY,
        metavar="ADDRESS",
        group="ray",
        help="serve on Ray: auto (the cluster `ray start` made here), ray://HOST:PORT, or nothing for a local instance",
    )
    replicas: int = serve_option(1, type=positive, absent=1, group="ray", help="replicas, each one group")
    gpus_per_replica: int = serve_option(
        1, type=positive, absent=1, group="ray", help="GPUs each replica's group holds (CPUs with --device cpu)"
    )
    min_replicas: int | None = serve_option(
        type=positive, group="ray", help="autoscale from this many replicas (with --max-replicas)"
    )
    max_replicas: int | None = serve_option(
        type=positive, group="ray", help="autoscale up to this many, aiming at 2 requests in flight per replica"
    )


# The records each command takes flags from, in the order its help lists them.
COMMANDS: dict[str, tuple[type, ...]] = {
    GENERATE: (Asked, GenerationRequest, StepCacheConfig, GenerateFlags, LoraFlags, ExecutionOptions, ParallelConfig),
    SERVE: (Asked, ServeSettings, RayFlags, LoraFlags, ExecutionOptions),
    PLAN: (Asked, GenerationRequest, PlanFlags, ExecutionOptions, ParallelConfig),
}


@dataclass(frozen=True)
class Conflict:
    """Options that do not combine (``request``: None where the run's settings are checked alone), and the line."""

    name: str
    applies: Callable[[ParallelConfig, ExecutionOptions, str, ResolvedRequest | None], bool]
    message: str
    param: str | None = None


def _sparse_parameter_unread(options: ExecutionOptions) -> bool:
    given = options.sparse_parameters()
    return bool(given) and not set(given) <= set(SPARSE_PARAMETERS.get(options.sparse_attention, ()))


def _sparse_method(options: ExecutionOptions, request: ResolvedRequest | None) -> str | None:
    """The sparse attention a request runs with: its own (a server's ``sparse_attention`` field), else the run's."""
    own = getattr(request, "sparse_attention", None)
    return own.method if own is not None else options.sparse_attention


def _caches(request: ResolvedRequest | None) -> bool:
    return request is not None and request.cache is not None


CONFLICTS = (
    # PipeFusion counts steps on the host to choose warm-up or patched steps; a graph replay would skip that.
    Conflict(
        "graphs with pipefusion",
        lambda parallel, options, device, request: bool(options.cuda_graphs) and parallel.pipefusion > 1,
        "CUDA graphs do not combine with pipefusion yet; drop --cuda-graphs or --pipefusion",
    ),
    # A graph replays the addresses it captured, which each gather allocates anew; sharding keeps 1/N of each expert.
    Conflict(
        "sharded weights with graphs or swapped experts",
        lambda parallel, options, device, request: (
            bool(parallel.shard_weights) and bool(options.cuda_graphs or options.swap_experts)
        ),
        "--shard-weights does not combine with --cuda-graphs or --swap-experts; drop one",
    ),
    # A merge copies into whole weights, which sharding splits.
    Conflict(
        "fused adapter choices with sharded weights",
        lambda parallel, options, device, request: bool(parallel.shard_weights and options.lora.cache),
        "--lora-cache does not combine with --shard-weights; drop one (--lora-cache 0: side paths)",
    ),
    Conflict(
        "graphs off a GPU",
        lambda parallel, options, device, request: bool(options.cuda_graphs) and device != "cuda",
        "CUDA graphs need a GPU; run without --cuda-graphs",
    ),
    # A graph replays the addresses it captured; a swap moves them.
    Conflict(
        "graphs with swapped experts",
        lambda parallel, options, device, request: bool(options.cuda_graphs and options.swap_experts),
        "CUDA graphs do not combine with swapped experts; drop one of the two options",
    ),
    Conflict(
        "exact attention steps without FP8 attention",
        lambda parallel, options, device, request: options.attention_bf16_steps > 0 and options.attention != "fp8",
        "--attention-bf16-steps keeps the first and last steps exact under FP8 attention; give --attention fp8 with "
        "it, or drop it",
        param="attention_bf16_steps",
    ),
    # A replay would keep the kernels, and each step's choice of precision, of its capture.
    Conflict(
        "FP8 attention with graphs",
        lambda parallel, options, device, request: options.attention == "fp8" and bool(options.cuda_graphs),
        "FP8 attention does not combine with CUDA graphs yet; drop --cuda-graphs or give --attention sdpa",
        param="attention",
    ),
    # A graph replays the side paths it captured; fused choices copy into the captured weights instead.
    Conflict(
        "graphs with switchable adapters as side paths",
        lambda parallel, options, device, request: (
            bool(options.cuda_graphs) and options.lora.switchable and not options.lora.cache
        ),
        "CUDA graphs replay one choice of adapters; give --lora-cache 1 or more (choices fused into the weights), or "
        "drop --cuda-graphs",
    ),
    # Fused choices would pin each expert's copies on the device.
    Conflict(
        "fused adapter choices with swapped experts",
        lambda parallel, options, device, request: bool(options.swap_experts and options.lora.cache),
        "--lora-cache does not combine with swapped experts; give --lora-cache 0 (side paths) or drop --swap-experts",
    ),
    # A skip decided at the head block must reach the step's every block: PipeFusion runs them ahead, a graph fixed.
    Conflict(
        "step caching with pipefusion",
        lambda parallel, options, device, request: _caches(request) and parallel.pipefusion > 1,
        "step caching does not combine with PipeFusion; drop the cache or --pipefusion",
        param="cache",
    ),
    Conflict(
        "step caching with graphs",
        lambda parallel, options, device, request: _caches(request) and bool(options.cuda_graphs),
        "step caching does not combine with CUDA graphs; drop the cache or --cuda-graphs",
        param="cache",
    ),
    Conflict(
        "sparse attention parameters it does not read",
        lambda parallel, options, device, request: _sparse_parameter_unread(options),
        "a --sparse-* parameter is given that the run's --sparse-attention does not read (radial: "
        "--sparse-dense-steps, --sparse-dense-blocks, --sparse-decay-factor; svg2: --sparse-dense-steps, "
        "--sparse-dense-blocks, --sparse-query-clusters, --sparse-key-clusters, --sparse-top-p); give the "
        "--sparse-attention that reads it, or drop it",
        param="sparse_attention",
    ),
    # The mask is a video's: its (frames, rows, columns) grid; images have none.
    Conflict(
        "sparse attention on images",
        lambda parallel, options, device, request: (
            bool(_sparse_method(options, request)) and request is not None and request.frames is None
        ),
        "--sparse-attention (a request's sparse_attention) masks a video's self-attention; this model makes images: "
        "drop it",
        param="sparse_attention",
    ),
    # PipeFusion's patches attend a K/V buffer of the whole sequence, not tiles in place.
    Conflict(
        "sparse attention with pipefusion",
        lambda parallel, options, device, request: bool(_sparse_method(options, request)) and parallel.pipefusion > 1,
        "--sparse-attention does not combine with --pipefusion; use ulysses or ring",
        param="sparse_attention",
    ),
    # SVG2 clusters every token of a head; Ring splits a head's tokens over its ranks.
    Conflict(
        "svg2 with ring",
        lambda parallel, options, device, request: _sparse_method(options, request) == "svg2" and parallel.ring > 1,
        "--sparse-attention svg2 clusters every token of a head, which Ring splits: use ulysses, or radial",
        param="sparse_attention",
    ),
    # A replay would keep the mask and the dense/sparse choice of its capture.
    Conflict(
        "sparse attention with graphs",
        lambda parallel, options, device, request: bool(_sparse_method(options, request) and options.cuda_graphs),
        "--sparse-attention does not combine with CUDA graphs yet; drop --cuda-graphs",
        param="sparse_attention",
    ),
    # SVG2's permuted copies and centroids are in the memory plan only of a run started with it.
    Conflict(
        "svg2 per request on a run planned without it",
        lambda parallel, options, device, request: (
            getattr(request, "sparse_attention", None) is not None
            and request.sparse_attention.method == "svg2"
            and options.sparse_attention != "svg2"
        ),
        "sparse_attention svg2 needs the memory a run started with --sparse-attention svg2 plans for; ask radial, or "
        "start the server with --sparse-attention svg2",
        param="sparse_attention",
    ),
)


def check_conflicts(
    parallel: ParallelConfig, options: ExecutionOptions, device: str, request: ResolvedRequest | None = None
) -> None:
    for conflict in CONFLICTS:
        if conflict.applies(parallel, options, device, request):
            raise InvalidRequest(conflict.message, param=conflict.param)
