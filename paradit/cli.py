"""``paradit`` command line: a thin face over ``paradit.Engine``.

Errors paradit can name (bad input, missing checkpoints) print one line and exit 2, with no traceback (the device
running out of memory: one line, exit 1); an unexpected error prints one line naming the file that holds its trace,
and exits 1. Everything heavy (torch, the model families) is imported only by the command that needs it, so that help
and refusals answer at once.
Must not import torch.distributed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from paradit import __version__
from paradit.cache_options import add_cache_arguments, cache_config, keep_curve
from paradit.errors import InvalidRequest, ParaditError, report_warnings
from paradit.families import DEFAULT_MODEL, PRESETS
from paradit.outputs import IMAGE_FORMATS, VIDEO_SUFFIX, output_paths, read_image, save_images, save_videos
from paradit.parallel.config import ParallelConfig
from paradit.request import SEED_LIMIT
from paradit.worker import start_worker_server

# --verify-serial: the least PSNR against the one-process image that a lossy plan must keep (measured CPU deviations
# of PipeFusion and FP8 transport on the tiny models sit well above it: docs/benchmarks.md).
LOSSY_PSNR_DB = 30.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage; one line is what we promise
        print(f"paradit: error: {message}", file=sys.stderr)
        sys.exit(2)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown in --help, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def whole_number(text: str, problem: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}") from None


def positive(text: str) -> int:
    """A whole number of 1 or more (degrees, counts, sizes)."""
    if (value := whole_number(text, "is not a whole number")) < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; give 1 or more")
    return value


def nonnegative(text: str) -> int:
    """A whole number of 0 or more (steps kept exact)."""
    if (value := whole_number(text, "is not a whole number")) < 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; give 0 or more")
    return value


def finite(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def seed(text: str) -> int | None:
    """A 64-bit seed, or ``random`` (drawn, then printed)."""
    if text == "random":
        return None
    if not 0 <= (value := whole_number(text, "is neither a whole number nor 'random'")) < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; give 0 to {SEED_LIMIT - 1} or 'random'")
    return value


def group_size(text: str) -> int | str:
    """GPUs per serving group, or ``auto``."""
    if text == "auto":
        return text
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; give 1 or more, or auto") from None


def add_execution_options(parser: argparse.ArgumentParser) -> None:
    """How a run executes, the same for ``generate`` and ``serve`` (unset: the tuned choice for ``--gpus N``)."""
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when a GPU is visible")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto", help="dummy: random weights")
    parser.add_argument(
        "--allow-pickle", action="store_true", help="load a checkpoint's pickle (.bin) weights: they can run code"
    )
    parser.add_argument(
        "--quantize", choices=["none", "fp8"], help="fp8: e4m3 linears (sm89+, MI300); default none, or the planner's"
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="regional torch.compile of the repeated blocks (default: on GPUs only)",
    )
    parser.add_argument("--cuda-graphs", action="store_true", help="replay each step from a CUDA graph (short steps)")
    parser.add_argument(
        "--attention",
        choices=["sdpa", "fp8"],
        help="fp8: self-attention in 8 bits through paradit's Triton kernel (sm89+, MI300, RDNA 4; long sequences, "
        "such as video); default sdpa",
    )
    parser.add_argument(
        "--attention-bf16-steps",
        type=nonnegative,
        default=0,
        metavar="N",
        help="with --attention fp8: the first and last N steps attend exactly, in the run's dtype",
    )
    parser.add_argument(
        "--swap-experts",
        action="store_true",
        help="models with two experts: one expert on the GPU, the other in pinned host memory, swapped at "
        "the boundary (chosen by itself when --max-gpu-memory leaves no room for both)",
    )
    parser.add_argument(
        "--max-gpu-memory", help="per-GPU cap with its unit, e.g. 32GiB or 30GB: a plan that cannot fit is refused"
    )
    parser.add_argument(
        "--text-encoder-placement",
        choices=["auto", "gpu", "fp8", "offload"],
        default="auto",
        help="prompt encoders on rank 0's GPU, there with FP8 linears (with --quantize fp8), or in CPU memory streamed "
        "to it while encoding; auto: the first that fits under --max-gpu-memory (on the GPU without a cap)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paradit", description="Multi-GPU inference for diffusion transformers.")
    parser.add_argument("--version", action="version", version=f"paradit {__version__}")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)

    gen = commands.add_parser("generate", help="generate images from a prompt", formatter_class=_Help)
    gen.add_argument("--model", default=DEFAULT_MODEL, help="preset name, checkpoint folder or hub id")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts in one batch")
    gen.add_argument("--negative-prompt", default=None, help="for models with true classifier-free guidance")
    # Sizes and steps are checked against the model, which knows its bounds.
    gen.add_argument("--height", type=int, help="pixels (default: the model's)")
    gen.add_argument("--width", type=int, help="pixels (default: the model's)")
    gen.add_argument("--steps", type=int, help="denoise steps (default: the model's)")
    gen.add_argument("--guidance", type=finite, help="guidance scale (default: the model's)")
    gen.add_argument("--seed", type=seed, default=0, help="a 64-bit seed, or 'random'")
    gen.add_argument("--images-per-prompt", type=int, default=1)
    gen.add_argument("--frames", type=int, help="video models: frames per video, 4k+1 (default: the model's)")
    gen.add_argument("--fps", type=positive, help="video models: frames per second of the MP4 (default: the model's)")
    gen.add_argument(
        "--image",
        action="append",
        help="an input image, repeatable where the model takes several: "
        "image-to-video's first frame, a reference to edit from, image-to-image's start",
    )
    gen.add_argument(
        "--strength",
        type=finite,
        help="image-to-image (with --image): the share of the steps run from "
        "the noised image, above 0 to 1 (default 0.6; inpainting: the model pipeline's)",
    )
    gen.add_argument(
        "--mask",
        help="inpainting (with --image): a picture of the image's size, white where it is "
        "repainted, black where it is kept",
    )
    gen.add_argument("--guidance-2", type=finite, help="models with a low-noise expert: its guidance scale")
    add_cache_arguments(gen)
    gen.add_argument(
        "--out",
        help=f"image path, its format from the extension ({', '.join(IMAGE_FORMATS)}); a video's: {VIDEO_SUFFIX} "
        "(H.264), or a folder (or an image extension: x.png -> x/) for one image per frame; with several images or "
        "videos, _N is appended to the name (default: out/paradit.png, out/paradit.mp4 for video models)",
    )
    gen.add_argument("--json", help="also write the closing table, the seed and the plan to this JSON file")
    gen.add_argument(
        "--server", help="send the request to a running `paradit serve` at this URL (http://host:port) instead"
    )
    gen.add_argument("--api-key", help="with --server: the server's API key (default: $PARADIT_API_KEY)")
    gen.add_argument(
        "--devices", help="which GPUs, e.g. 2,3 (sets CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES for this run)"
    )
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    lora = gen.add_argument_group("LoRA adapters (applied to the transformer)")
    lora.add_argument(
        "--lora",
        action="append",
        metavar="PATH[:SCALE]",
        help="a .safetensors file, a folder or a hub id; "
        "repeatable; scale default 1 (of a model with two experts: the high-noise one; with --server: NAME[:SCALE] "
        "of the server's adapters)",
    )
    lora.add_argument("--lora-2", action="append", metavar="PATH[:SCALE]", help="a second expert's (the low-noise one)")
    lora.add_argument("--lora-weight-name", help="the adapter file inside a folder or hub repository")
    lora.add_argument(
        "--lora-mode",
        choices=["fused", "unfused"],
        default="fused",
        help="fused into the weights at load (no cost per step), or low-rank side paths beside the linears",
    )
    gen.set_defaults(run=run_generate)
    add_execution_options(gen)
    par = gen.add_argument_group("parallelism (one request across several GPUs or CPU processes)")
    par.add_argument("--gpus", type=positive, help="processes in the group; default: the product of the degrees")
    par.add_argument("--ulysses", type=positive, help="Ulysses (all-to-all over heads) degree")
    par.add_argument("--ring", type=positive, help="Ring attention degree")
    par.add_argument("--cfg-parallel", action="store_true", help="guidance branches on the two halves of the group")
    par.add_argument("--tensor", type=positive, help="tensor parallel degree (weights and heads sharded; fast links)")
    par.add_argument(
        "--comm-dtype", choices=["auto", "fp8"], help="fp8: Ulysses/Ring traffic in FP8 with scales (default auto)"
    )
    par.add_argument("--pipefusion", type=positive, help="pipeline stages over the blocks (least traffic)")
    par.add_argument(
        "--shard-weights",
        type=positive,
        metavar="N",
        help="each of N neighbouring GPUs keeps 1/N of the weights, "
        "gathering each block just before it runs (FSDP; with ulysses, ring, cfg; N divides the GPUs)",
    )
    par.add_argument("--patches", type=positive, help="pipefusion: image patches in flight per step (default 1)")
    par.add_argument("--warmup-steps", type=positive, help="pipefusion: exact steps before patching (default 1)")
    par.add_argument(
        "--verify-serial",
        action="store_true",
        help="also run the request in one process and compare: exit 3 when an exact plan differs by more than one "
        f"8-bit level, or a lossy one (FP8 transport, PipeFusion patches) falls under {LOSSY_PSNR_DB:.0f} dB PSNR",
    )

    quant = commands.add_parser(
        "quantize", help="write an FP8 checkpoint folder (e4m3 linears, one scale per output channel), on the CPU"
    )
    quant.add_argument("--model", required=True, help="preset name, checkpoint folder or hub id")
    quant.add_argument("--out", required=True, help="a new folder for the FP8 checkpoint")
    quant.add_argument(
        "--load-format", choices=["auto", "dummy"], default="auto", help="dummy: quantize random weights"
    )
    quant.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="the layers kept unquantized")
    quant.set_defaults(run=run_quantize)

    planner = commands.add_parser(
        "plan",
        help="rank every parallel plan for a model on N GPUs by predicted time, and say why the best wins",
        formatter_class=_Help,
    )
    planner.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="preset name, or a checkpoint folder or hub id of a "
        "preset's architecture (the planner's FLOP counts are per preset)",
    )
    planner.add_argument("--gpus", type=positive, required=True)
    planner.add_argument("--profile", help="hardware profile (default: this machine's, else h200-nvlink)")
    planner.add_argument(
        "--link",
        choices=["nvlink", "pcie", "measure"],
        help="the profile's GPU with these links; measure: probe this machine's matmul, attention and collectives",
    )
    planner.add_argument("--gpu-memory", help="memory per GPU with its unit, e.g. 32GiB (default: the profile's)")
    planner.add_argument("--size", help="WIDTHxHEIGHT (default: the model's)")
    planner.add_argument("--frames", type=positive, help="video models: frames (default: the model's)")
    planner.add_argument(
        "--quantize", choices=["none", "fp8"], help="FP8 compute or not (default: bf16 unless nothing fits without FP8)"
    )
    planner.add_argument(
        "--attention", choices=["sdpa", "fp8"], default="sdpa", help="fp8: predict with the FP8 attention kernel's rate"
    )
    planner.set_defaults(run=run_plan)

    models = commands.add_parser("models", help="list the model presets, or with --local the checkpoints on disk")
    models.add_argument("--local", action="store_true", help="list the pipelines in the hub cache, with their sizes")
    models.add_argument(
        "--dir", action="append", default=[], help="a checkpoint folder, or a folder of them, to list (implies --local)"
    )
    models.set_defaults(run=run_models)

    serve = commands.add_parser(
        "serve", help="serve a model over HTTP: OpenAI's Images API, video jobs, metrics", formatter_class=_Help
    )
    serve.add_argument("--model", default=DEFAULT_MODEL, help="preset name, checkpoint folder or hub id")
    serve.add_argument("--gpus", type=positive, default=1, help="GPUs to serve with (CPU processes with --device cpu)")
    serve.add_argument(
        "--group-size",
        type=group_size,
        help="GPUs per group, each running the plan generate chooses for that many: --gpus (the default) splits each "
        "request over all of them (lowest latency), 1 serves independent requests on each (most throughput); auto "
        "chooses per batch from the queue (each GPU then holds the model twice)",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (0.0.0.0: every interface) and "
        "url answers link to (under 0.0.0.0: the one a request reached; never its Host)",
    )
    serve.add_argument("--port", type=int, default=8000, help="0: any free one; one in use is refused before loading")
    serve.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` on every route but /health (default: $PARADIT_API_KEY)"
    )
    serve.add_argument(
        "--max-batch",
        type=positive,
        default=1,
        help="images per forward pass: queued requests of the same size, steps and guidance run together (more "
        "throughput; a batched image can differ from the unbatched one in its last bits)",
    )
    serve.add_argument("--max-queue", type=positive, default=64, help="requests waiting; more get 429 (Retry-After)")
    serve.add_argument(
        "--timeout",
        type=positive,
        default=600,
        help="seconds a request may take, its wait "
        "included: one its measured pace puts at 3x that is refused, a run past it stopped within "
        "a step",
    )
    serve.add_argument(
        "--max-pixels", type=positive, help="width x height a request may ask for (default 4x the model's default size)"
    )
    lora = serve.add_argument_group("LoRA adapters each request may choose (its lora field)")
    lora.add_argument("--lora", action="append", metavar="NAME=PATH", help="an adapter and its name; repeatable")
    lora.add_argument("--lora-2", action="append", metavar="NAME=PATH", help="a second expert's (the low-noise one)")
    lora.add_argument("--lora-dir", help="every .safetensors adapter in this folder, named by its file's stem")
    lora.add_argument(
        "--lora-cache",
        type=int,
        default=0,
        metavar="N",
        help="choices of adapters and scales kept "
        "fused into weights of their own, the N most recently used: no cost per step, one merge a miss, "
        "the weights they change held N+1 times (default 0: side paths beside the weights)",
    )
    add_execution_options(serve)
    serve.set_defaults(run=run_serve)

    down = commands.add_parser(
        "download", help="fetch a checkpoint from the Hugging Face hub: only the files paradit reads"
    )
    down.add_argument("model", help="preset name or hub id (org/name)")
    down.add_argument("--dir", help="the checkpoint folder to write (default: the hub cache, where --model finds it)")
    down.set_defaults(run=run_download)
    return parser


def format_table(result) -> str:
    t = result.timings
    rows = [
        ("seed", str(result.seed)),
        ("text encoding", f"{t.text_encode_s:.3f} s"),
        ("first denoise step", f"{t.step_ms[0]:.1f} ms" if t.step_ms else "-"),
        *([("denoise step (median)", f"{t.median_step_ms:.1f} ms x {len(t.step_ms) - 1} more")] * (len(t.step_ms) > 1)),
        ("VAE decode", f"{t.vae_decode_s:.3f} s"),
        ("total", f"{t.total_s:.3f} s"),
        (f"peak memory ({t.peak_memory_kind})", f"{t.peak_memory_bytes / 2**30:.2f} GiB" + peak_details(t)),
        ("parallel plan", t.plan),
        ("text encoder placement", t.text_encoders),
    ]
    if t.peak_memory_per_rank:
        rows.append(("peak memory per rank", " ".join(f"{b / 2**30:.2f}" for b in t.peak_memory_per_rank) + " GiB"))
    if t.comm_bytes_per_step:
        rows.append(("sent per step (rank 0)", f"{t.comm_bytes_per_step / 2**20:.2f} MiB"))
    if (cache := t.features.get("step_cache")) is not None:
        rows.append(
            (
                "step cache",
                f"{cache.skipped_steps} of {len(cache.skipped)} steps skipped, "
                f"{cache.blocks_skipped} block evaluations",
            )
        )
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def peak_details(t) -> str:
    """What the allocator held at most beside what tensors took, and the memory plan's estimate, where known."""
    details = [f"{t.peak_reserved_bytes / 2**30:.2f} held by the allocator"] if t.peak_reserved_bytes else []
    details += [f"planned {t.memory_estimate_bytes / 2**30:.2f}"] if t.memory_estimate_bytes else []
    return f" ({', '.join(details)})" if details else ""


def asked_for(args: argparse.Namespace):
    """What the flags ask for (a ``settings.Asked``): a plan of the degrees given, or for ``--gpus N`` alone the one
    paradit chooses."""
    from paradit.settings import Asked

    flag = functools.partial(getattr, args)  # serve takes no parallel flags: its groups' plans are chosen
    degrees = {name: flag(name, None) for name in ("ulysses", "ring", "tensor", "pipefusion")}
    degrees["cfg"] = 2 if flag("cfg_parallel", False) else None
    explicit = any(degrees.values())  # a degree given is 1 or more (``positive``)
    parallel = ParallelConfig(**{name: degree or 1 for name, degree in degrees.items()}) if explicit else None
    return Asked(
        args.model,
        args.device,
        args.dtype,
        args.load_format,
        args.allow_pickle,
        args.gpus,
        parallel,
        flag("comm_dtype", None),
        flag("patches", None),
        flag("warmup_steps", None),
        args.quantize,
        args.compile,
        args.cuda_graphs or None,
        args.swap_experts,
        args.max_gpu_memory,
        args.text_encoder_placement,
        shard_weights=flag("shard_weights", None),
        lora=(served_lora_set if args.run is run_serve else lora_set)(args),
        attention=args.attention,
        attention_bf16_steps=args.attention_bf16_steps,
    )


def served_lora_set(args: argparse.Namespace):
    """A server's named adapters (None: none), loaded unchosen: each request names those it wants."""
    from paradit.lora import LoraSet
    from paradit.lora.refs import adapters_in, parse_named

    first = tuple(parse_named(text) for text in args.lora or ()) + (adapters_in(args.lora_dir) if args.lora_dir else ())
    second = tuple(parse_named(text) for text in args.lora_2 or ())
    if not first and not second:
        if args.lora_cache:
            raise InvalidRequest("--lora-cache keeps choices of named adapters: give --lora NAME=PATH or --lora-dir")
        return None
    return LoraSet(first, second, "unfused", switchable=True, cache=args.lora_cache)


def lora_set(args: argparse.Namespace):
    """The adapters the flags name (None: none)."""
    from paradit.lora import LoraSet, parse_lora

    first, second = getattr(args, "lora", None) or [], getattr(args, "lora_2", None) or []
    if not first and not second:
        return None
    weight_name = args.lora_weight_name

    def refs(texts: list[str]) -> tuple:
        return tuple(parse_lora(text, weight_name) for text in texts)

    return LoraSet(refs(first), refs(second), args.lora_mode)


def run_generate(args: argparse.Namespace) -> int:
    if args.server is not None:
        from paradit.serving.client import generate_remote

        return generate_remote(args)
    if args.devices is not None:  # before torch sees the GPUs; spawned workers inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HIP_VISIBLE_DEVICES"] = args.devices
    if args.no_progress:  # workers' transformers and diffusers read this when they are imported
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from paradit.pipelines.requests import check_text
    from paradit.request import GenerationRequest

    # What needs no model is checked first, before any heavy import or worker: a bad prompt or an unreadable image
    # is refused at once.
    check_text("prompt", args.prompt)
    check_text("negative_prompt", [args.negative_prompt or ""])
    request = GenerationRequest(
        prompt=args.prompt if len(args.prompt) > 1 else args.prompt[0],
        negative_prompt=args.negative_prompt,
        height=args.height,
        width=args.width,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        num_images_per_prompt=args.images_per_prompt,
        frames=args.frames,
        guidance_2=args.guidance_2,
        image=[read_image(path) for path in args.image] if args.image else None,
        fps=args.fps,
        strength=args.strength,
        mask=None if args.mask is None else read_image(args.mask, "--mask"),
        cache=cache_config(args),
    )
    degrees = (args.gpus, args.ulysses, args.ring, args.tensor, args.pipefusion)
    if args.cfg_parallel or args.shard_weights or any((degree or 1) > 1 for degree in degrees):
        start_worker_server(args.device)  # its imports overlap this process's, below
    from paradit.engine import Engine
    from paradit.outputs import replaced, writable_folder
    from paradit.settings import settle

    if args.no_progress:  # this process imported them already
        import diffusers
        import transformers

        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()

    run = settle(asked_for(args), request)
    video = run.family.video
    paths = output_paths(
        args.out or ("out/paradit.mp4" if video else "out/paradit.png"),
        len(args.prompt) * args.images_per_prompt,
        video,
    )
    if args.json is not None:  # checked as --out is, before anything runs
        writable_folder("--json", args.json)
    if run.origin is not None:
        print(f"paradit: {run.origin}; parallel flags replace it")
    with Engine(settings=run) as engine:
        result = engine.generate(request, progress=not args.no_progress)
    if result is None:  # a non-zero rank under torchrun: rank 0 writes the images
        return 0
    resolved = result.request
    settings = {
        "prompt": resolved.prompts,
        "negative_prompt": resolved.negative_prompts,
        "seed": result.seed,
        "model": run.spec.name,
        "steps": resolved.steps,
        "guidance": resolved.guidance,
        "plan": result.timings.plan,
        "software": f"paradit {__version__}",
        **({"lora": lora_record(run.options.lora)} if run.options.lora else {}),
        **({"image": args.image} if args.image else {}),
        **({"mask": args.mask} if args.mask else {}),
        **({"strength": resolved.strength} if resolved.strength is not None else {}),
        **({"cache": dataclasses.asdict(resolved.cache)} if resolved.cache is not None else {}),
        **({"frames": resolved.frames, "fps": resolved.fps} if result.is_video else {}),
    }
    metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in settings.items()}
    if result.is_video:
        paths = save_videos(result.frames, paths, resolved.fps, metadata)
    else:
        save_images(result.images, paths, metadata)
    print(format_table(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    if resolved.cache is not None and resolved.cache.calibrate:
        curve = result.timings.features["step_cache"].mag_ratios
        print(f"MagCache ratios ({len(curve)} steps): {', '.join(f'{r:.5f}' for r in curve)}")
        print(f"kept in {keep_curve(args.model, curve)} for the next --cache mag run of {args.model}")
    code, comparison = 0, None
    if args.verify_serial and run.parallel.world_size > 1:
        # The same model and options in one process, uncapped with its encoders resident, as a plain Engine runs.
        alone = dataclasses.replace(
            run, parallel=ParallelConfig(), memory_cap=None, memory_plan=None, text_encoder_placement="gpu", origin=None
        )
        with Engine(settings=alone) as serial_engine:
            serial = serial_engine.generate(dataclasses.replace(request, seed=result.seed), progress=False)
        code, comparison = serial_comparison(result, serial, exact=run.parallel.exact)
        print(comparison)
    if args.json is not None:
        timings = {**dataclasses.asdict(result.timings), "median_step_ms": result.timings.median_step_ms}
        record = {**settings, "timings": timings, "files": [str(p) for p in paths], "verify_serial": comparison}
        with replaced(Path(args.json)) as temporary:
            temporary.write_text(json.dumps(record, indent=2) + "\n")
    return code


def lora_record(lora) -> dict:
    """The adapters and scales of a run, for the PNG metadata and ``--json``."""

    def refs(adapters) -> list[dict]:
        return [{"source": ref.source, "scale": ref.scale, "weight_name": ref.weight_name} for ref in adapters]

    return {"transformer": refs(lora.transformer), "transformer_2": refs(lora.transformer_2), "mode": lora.mode}


def serial_comparison(parallel, serial, exact: bool) -> tuple[int, str]:
    """How far the parallel images are from the one-process ones (float pixels, 8-bit levels, PSNR), and the exit
    code: 3 when an exact plan differs by more than one level or a lossy one falls under ``LOSSY_PSNR_DB``."""
    diff = parallel.pixels - serial.pixels
    float_diff, mse = diff.abs().max().item(), diff.square().mean().item()
    psnr = 10 * math.log10(1 / mse) if mse > 0 else float("inf")
    # The images' 8-bit levels, rounded as ``GenerationResult.images`` rounds them.
    levels = int(((parallel.pixels * 255).round() - (serial.pixels * 255).round()).abs().max())
    within = levels <= 1 if exact else psnr >= LOSSY_PSNR_DB
    verdict = "equals" if levels <= 1 else "is within tolerance of" if within else "DIFFERS FROM"
    kind = "video" if parallel.is_video else "image"
    line = (
        f"{parallel.timings.plan} {kind} {verdict} the 1-process {kind}: max diff {float_diff:.2e} on [0, 1], "
        f"{levels} 8-bit level(s), PSNR {psnr:.1f} dB ({'exact plan' if exact else 'lossy plan'})"
    )
    return (0 if within else 3), line


def run_models(args: argparse.Namespace) -> None:
    if args.local or args.dir:
        from paradit.download import format_local_models, local_models

        print(format_local_models(local_models(args.dir)))
        return
    width = max(len(name) for name in PRESETS)
    for name, spec in PRESETS.items():
        size = f"{spec.width}x{spec.height}"
        print(f"{name:<{width}}  {spec.steps:>3} steps  {size:>9}  {spec.description}")


def run_download(args: argparse.Namespace) -> None:
    from paradit.download import download

    download(args.model, args.dir)


def run_serve(args: argparse.Namespace) -> None:
    start_worker_server(args.device)  # every group runs in workers; the forkserver's imports overlap this process's
    from paradit.serving.launch import ServeSettings, serve

    settings = ServeSettings(
        asked_for(args),
        gpus=args.gpus,
        group_size=args.group_size,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        api_key=args.api_key or os.environ.get("PARADIT_API_KEY"),
        max_pixels=args.max_pixels,
    )
    serve(settings, host=args.host, port=args.port)


def run_plan(args: argparse.Namespace) -> None:
    from paradit.planner.command import plan_text

    print(
        plan_text(
            args.model,
            args.gpus,
            args.profile,
            args.link,
            args.gpu_memory,
            args.size,
            args.frames,
            args.quantize,
            args.attention,
        )
    )


def run_quantize(args: argparse.Namespace) -> None:
    from paradit.fp8_checkpoint import check_out, write_fp8_checkpoint
    from paradit.settings import DTYPES, resolve_model

    check_out(Path(args.out))  # before resolving the model, which may download it
    spec = resolve_model(args.model, args.load_format)
    layers = write_fp8_checkpoint(spec, Path(args.out), DTYPES[args.dtype])
    print(f"wrote {args.out}: {len(layers)} FP8 linears; run it with --model {args.out} --quantize fp8")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    report_warnings()
    received = []

    def interrupt(signum, frame) -> None:
        """SIGINT or SIGTERM: unwind, so that the engine stops its workers and removes its files on the way out; a
        second signal would cut that short, so it is ignored."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        received.append(signum)
        raise KeyboardInterrupt

    def forward_hang_ups() -> None:
        """SIGHUP as SIGTERM to the main thread until main returns. Blocked, it is blocked in every process started
        from here (workers, their forkserver, the resource tracker), so a closing terminal leaves the ending to us."""
        while signal.sigwait({signal.SIGHUP}) and not returned.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    # Handlers and masks can only be set on the main thread; main() called elsewhere keeps the defaults.
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM) if on_main_thread}
    for sig in previous:
        signal.signal(sig, interrupt)
    returned, forwarder = threading.Event(), threading.Thread(target=forward_hang_ups, daemon=True)
    if on_main_thread and hasattr(signal, "pthread_sigmask"):  # POSIX
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        forwarder.start()
    try:
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        code = args.run(args) or 0  # generate returns its exit code; the other commands succeed or raise
        sys.stdout.flush()  # a reader gone (`paradit models | head -1`) shows here, where it is handled, not at exit
        return code
    except BrokenPipeError:  # stdout's reader is gone: stop quietly, as a command killed by SIGPIPE does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that Python's flush at exit cannot fail
        return 128 + 13  # the shell's code for death by SIGPIPE (13; Windows has no signal.SIGPIPE)
    except ParaditError as exc:
        print(f"paradit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        terminated = received == [signal.SIGTERM]
        print(f"paradit: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)  # the shell's code for death by that signal
    except Exception as exc:  # noqa: BLE001 - a user sees one line; the trace goes to a file for the bug report
        with tempfile.NamedTemporaryFile("w", prefix="paradit-error-", suffix=".log", delete=False) as log:
            traceback.print_exc(file=log)
        print(f"paradit: internal error: {type(exc).__name__}: {exc}; full trace in {log.name}", file=sys.stderr)
        return 1
    finally:
        if forwarder.is_alive():
            returned.set()
            signal.pthread_kill(forwarder.ident, signal.SIGHUP)  # ends its wait
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler set outside Python, which cannot be put back from here
                signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
