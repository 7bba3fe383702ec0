"""``paradit`` command line: a thin face over ``paradit.Engine``.

Errors paradit can name (bad input, missing checkpoints) print one line and exit 2, with no traceback.
Must not import torch.distributed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from paradit.errors import ParaditError
from paradit.optimize import ExecutionOptions
from paradit.parallel.config import ParallelConfig, default_plan
from paradit.presets import PRESETS
from paradit.request import GenerationRequest, GenerationResult


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage; one line is what we promise
        print(f"paradit: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paradit", description="Multi-GPU inference for diffusion transformers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = commands.add_parser("generate", help="generate images from a prompt")
    gen.add_argument("--model", default="flux2-tiny", help="preset name, checkpoint folder or hub id")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts in one batch")
    gen.add_argument("--negative-prompt", default=None, help="for models with true classifier-free guidance")
    gen.add_argument("--height", type=int)
    gen.add_argument("--width", type=int)
    gen.add_argument("--steps", type=int)
    gen.add_argument("--guidance", type=float)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--images-per-prompt", type=int, default=1)
    gen.add_argument("--out", default="out/paradit.png", help="PNG path; with several images, _N is appended")
    gen.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    gen.add_argument("--device", choices=["cuda", "cpu"])
    gen.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.add_argument("--quantize", choices=["none", "fp8"], default="none", help="fp8: e4m3 linears (sm89+, MI300)")
    gen.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="regional torch.compile of the repeated blocks (default: on GPUs only)",
    )
    gen.add_argument("--cuda-graphs", action="store_true", help="replay each step from a CUDA graph (short steps)")
    par = gen.add_argument_group("parallelism (one request across several GPUs or CPU processes)")
    par.add_argument("--gpus", type=int, help="processes in the group; default: the product of the degrees")
    par.add_argument("--ulysses", type=int, help="Ulysses (all-to-all over heads) degree")
    par.add_argument("--ring", type=int, help="Ring attention degree")
    par.add_argument("--cfg-parallel", action="store_true", help="guidance branches on the two halves of the group")
    par.add_argument("--tensor", type=int, help="tensor parallel degree (weights and heads sharded; fast links)")
    par.add_argument(
        "--comm-dtype", choices=["auto", "fp8"], default="auto", help="fp8: Ulysses/Ring traffic in FP8 with scales"
    )
    par.add_argument("--pipefusion", type=int, help="pipeline stages over the blocks (least traffic)")
    par.add_argument("--patches", type=int, default=1, help="pipefusion: image patches in flight per step")
    par.add_argument("--warmup-steps", type=int, default=1, help="pipefusion: exact steps before patching")
    par.add_argument("--max-gpu-memory", help="per-GPU cap, e.g. 32GiB: a plan that cannot fit is refused up front")
    par.add_argument(
        "--text-encoder-placement",
        choices=["auto", "gpu", "fp8", "offload"],
        default="auto",
        help="prompt encoders on rank 0's GPU, there with FP8 linears (with --quantize fp8), or in CPU memory streamed "
        "to it while encoding; auto: the first that fits under --max-gpu-memory (on the GPU without a cap)",
    )
    par.add_argument(
        "--verify-serial", action="store_true", help="also run the request in one process and report the difference"
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

    commands.add_parser("models", help="list the model presets")
    return parser


def output_paths(out: str, count: int) -> list[Path]:
    path = Path(out)
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{i}{path.suffix}") for i in range(count)]


def format_table(result: GenerationResult) -> str:
    t = result.timings
    rows = [
        ("text encoding", f"{t.text_encode_s:.3f} s"),
        ("denoise step (median)", f"{t.median_step_ms:.1f} ms x {len(t.step_ms)}"),
        ("VAE decode", f"{t.vae_decode_s:.3f} s"),
        ("total", f"{t.total_s:.3f} s"),
        (f"peak memory ({t.peak_memory_kind})", f"{t.peak_memory_bytes / 2**30:.2f} GiB"),
        ("parallel plan", t.plan),
        ("text encoder placement", t.text_encoders),
    ]
    if t.peak_memory_per_rank:
        rows.append(("peak memory per rank", " ".join(f"{b / 2**30:.2f}" for b in t.peak_memory_per_rank) + " GiB"))
    if t.comm_bytes_per_step:
        rows.append(("sent per step (rank 0)", f"{t.comm_bytes_per_step / 2**20:.2f} MiB"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def parallel_plan(args: argparse.Namespace, spec) -> ParallelConfig:
    """The plan the flags ask for: explicit degrees, or for ``--gpus N`` alone the default plan for N."""
    heads = spec.attention_heads
    has_cfg = spec.guidance_mode == "cfg"
    degrees = (args.ulysses, args.ring, args.tensor, args.pipefusion)
    explicit = any(degree is not None for degree in degrees) or args.cfg_parallel
    plan = default_plan(args.gpus or 1, has_cfg, heads)
    if explicit:
        plan = ParallelConfig(
            ulysses=args.ulysses or 1, ring=args.ring or 1, cfg=2 if args.cfg_parallel else 1, tensor=args.tensor or 1,
            pipefusion=args.pipefusion or 1,
        )  # fmt: skip
    return dataclasses.replace(plan, comm_dtype=args.comm_dtype, patches=args.patches, warmup_steps=args.warmup_steps)


def run_generate(args: argparse.Namespace) -> int:
    from paradit.engine import Engine, check_plan, parse_device, parse_dtype, resolve_model, validate_request

    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    spec = resolve_model(args.model, args.load_format)
    parallel = parallel_plan(args, spec)
    check_plan(spec, parallel, args.gpus or parallel.world_size, device)
    request = GenerationRequest(
        prompt=args.prompt if len(args.prompt) > 1 else args.prompt[0],
        negative_prompt=args.negative_prompt,
        height=args.height,
        width=args.width,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        num_images_per_prompt=args.images_per_prompt,
    )
    validate_request(spec, request)
    options = ExecutionOptions(quantize=args.quantize, compile=args.compile, cuda_graphs=args.cuda_graphs)
    options.validate(device)
    engine_args = dict(device=device, dtype=dtype, load_format=args.load_format, options=options)
    with Engine(
        spec,
        parallel=parallel,
        max_gpu_memory=args.max_gpu_memory,
        text_encoder_placement=args.text_encoder_placement,
        **engine_args,
    ) as engine:
        result = engine.generate(request, progress=not args.no_progress)
    if result is None:  # a non-zero rank under torchrun: rank 0 writes the images
        return 0
    paths = output_paths(args.out, len(result.images))
    for path, image in zip(paths, result.images):
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
    print(format_table(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    if args.verify_serial and parallel.world_size > 1:
        with Engine(spec, **engine_args) as serial_engine:
            serial = serial_engine.generate(request, progress=False)
        print(serial_comparison(result, serial))
    return 0


def serial_comparison(parallel: GenerationResult, serial: GenerationResult) -> str:
    """How far the parallel images are from the one-process ones, in float pixels and in 8-bit levels."""
    float_diff = (parallel.pixels - serial.pixels).abs().max().item()
    levels = max(
        int(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max())
        for a, b in zip(parallel.images, serial.images)
    )
    verdict = "equals" if levels <= 1 else "DIFFERS FROM"
    return (
        f"{parallel.timings.plan} image {verdict} the 1-process image: "
        f"max diff {float_diff:.2e} on [0, 1], {levels} 8-bit level(s)"
    )


def run_models() -> int:
    width = max(len(name) for name in PRESETS)
    for name, spec in PRESETS.items():
        size = f"{spec.width}x{spec.height}"
        print(f"{name:<{width}}  {spec.steps:>3} steps  {size:>9}  {spec.description}")
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    from paradit.engine import DTYPES, resolve_model
    from paradit.quantize import write_fp8_checkpoint

    spec = resolve_model(args.model, args.load_format)
    dummy = args.load_format == "dummy" or "folder" not in spec.extra
    layers = write_fp8_checkpoint(spec, Path(args.out), DTYPES[args.dtype], dummy)
    print(f"wrote {args.out}: {len(layers)} FP8 linears; run it with --model {args.out} --quantize fp8")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "models":
            return run_models()
        if args.command == "quantize":
            return run_quantize(args)
        return run_generate(args)
    except ParaditError as exc:
        print(f"paradit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
