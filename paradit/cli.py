"""``paradit`` command line: a named error prints one line (exit 2; out of memory 1), another names its trace file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

from paradit import __version__
from paradit.cache_options import cache_config, keep_curve
from paradit.errors import InvalidRequest, ParaditError, report_warnings
from paradit.families import PRESETS
from paradit.flags import GENERATE, PLAN, SERVE, add_flags, flagged_fields, flags_given, from_args
from paradit.lora.refs import LoraSet
from paradit.options import (
    COMMANDS,
    LOAD_FORMATS,
    LOSSY_PSNR_DB,
    Asked,
    ExecutionOptions,
    LoraFlags,
    RayFlags,
    ServeSettings,
)
from paradit.outputs import output_paths, replaced, save_images, save_videos, sparse_record, writable_folder
from paradit.parallel.config import ParallelConfig
from paradit.request import GenerationRequest
from paradit.worker import reportable, start_worker_server


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage; one line is what we promise
        print(f"paradit: error: {message}", file=sys.stderr)
        sys.exit(2)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paradit", description="Multi-GPU inference for diffusion transformers.")
    parser.add_argument("--version", action="version", version=f"paradit {__version__}")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)

    helps = {
        GENERATE: "generate images from a prompt",
        SERVE: "serve a model over HTTP: OpenAI's Images API, video jobs, metrics",
        PLAN: "what generate would run for a model on N GPUs (or CPU processes), and on GPUs the plans it was "
        "chosen from, ranked by predicted time",
    }
    for command, run in ((GENERATE, run_generate), (SERVE, run_serve), (PLAN, run_plan)):
        sub = commands.add_parser(command, help=helps[command], formatter_class=_Help)
        add_flags(sub, command, *COMMANDS[command])
        sub.set_defaults(run=run)

    quant = commands.add_parser(
        "quantize", help="write an FP8 checkpoint folder (e4m3 linears, one scale per output channel), on the CPU"
    )
    quant.add_argument("--model", required=True, help="preset name, checkpoint folder or hub id")
    quant.add_argument("--out", required=True, help="a new folder for the FP8 checkpoint")
    quant.add_argument("--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: quantize random weights")
    quant.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="the layers kept unquantized")
    quant.set_defaults(run=run_quantize)

    models = commands.add_parser("models", help="list the model presets, or with --local the checkpoints on disk")
    models.add_argument("--local", action="store_true", help="list the pipelines in the hub cache, with their sizes")
    models.add_argument(
        "--dir", action="append", default=[], help="a checkpoint folder, or a folder of them, to list (implies --local)"
    )
    models.set_defaults(run=run_models)

    down = commands.add_parser(
        "download", help="fetch a checkpoint from the Hugging Face hub: only the files paradit reads"
    )
    down.add_argument("model", help="preset name or hub id (org/name)")
    down.add_argument("--dir", help="the checkpoint folder to write (default: the hub cache, where --model finds it)")
    down.set_defaults(run=run_download)
    return parser


def format_table(result) -> str:
    t = result.timings
    details = [f"{t.peak_reserved_bytes / 2**30:.2f} held by the allocator"] if t.peak_reserved_bytes else []
    details += [f"planned {t.memory_estimate_bytes / 2**30:.2f}"] if t.memory_estimate_bytes else []
    peak = f"{t.peak_memory_bytes / 2**30:.2f} GiB" + (f" ({', '.join(details)})" if details else "")
    rows = [
        ("seed", str(result.seed)),
        ("text encoding", f"{t.text_encode_s:.3f} s"),
        ("first denoise step", f"{t.step_ms[0]:.1f} ms" if t.step_ms else "-"),
        *([("denoise step (median)", f"{t.median_step_ms:.1f} ms x {len(t.step_ms) - 1} more")] * (len(t.step_ms) > 1)),
        ("VAE decode", f"{t.vae_decode_s:.3f} s"),
        ("total", f"{t.total_s:.3f} s"),
        (f"peak memory ({t.peak_memory_kind})", peak),
        ("parallel plan", t.plan),
        ("text encoder placement", t.text_encoders),
    ]
    if t.peak_memory_per_rank:
        rows.append(("peak memory per rank", " ".join(f"{b / 2**30:.2f}" for b in t.peak_memory_per_rank) + " GiB"))
    if t.comm_bytes_per_step:
        rows.append(("sent per step (rank 0)", f"{t.comm_bytes_per_step / 2**20:.2f} MiB"))
    if (cache := t.features.get("step_cache")) is not None:
        steps = f"{cache.skipped_steps} of {len(cache.skipped)} steps skipped"
        rows.append(("step cache", f"{steps}, {cache.blocks_skipped} block evaluations skipped"))
    if (sparse := t.features.get("sparse_attention")) is not None:
        rows.append(("lossy", sparse.line()))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def asked_for(args: argparse.Namespace, command: str) -> Asked:
    """What ``command``'s flags ask for: the parallel degrees given (None: paradit chooses), the LoRA adapters."""
    parallel = from_args(ParallelConfig, args, command) if flags_given(args, command, ParallelConfig) else None
    lora = from_args(LoraFlags, args, command).lora_set() or LoraSet()
    options = from_args(ExecutionOptions, args, command, lora=lora)
    return from_args(Asked, args, command, parallel=parallel, options=options)


def request_for(args: argparse.Namespace, command: str) -> GenerationRequest:
    """The request ``command``'s flags make (``plan``'s: the size it is planned for)."""
    if command == PLAN:
        return from_args(GenerationRequest, args, command, prompt="a plan")
    return from_args(GenerationRequest, args, command, cache=cache_config(args))


def run_generate(args: argparse.Namespace) -> int:
    if args.server is not None:
        from paradit.serving.client import generate_remote

        return generate_remote(args)
    if args.devices is not None:  # before torch sees the GPUs; spawned workers inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HIP_VISIBLE_DEVICES"] = args.devices
    if args.no_progress:  # workers' transformers and diffusers read this when they are imported
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from paradit.pipelines.requests import check_text

    # What needs no model is checked before any heavy import or worker, so that a bad prompt is refused at once.
    check_text("prompt", args.prompt)
    check_text("negative_prompt", [args.negative_prompt or ""])
    request = request_for(args, GENERATE)
    asked = asked_for(args, GENERATE)
    if asked.gpus not in (None, 1) or asked.shard_weights or (asked.parallel and asked.parallel.world_size > 1):
        start_worker_server(args.device)  # its imports overlap this process's, below
    from paradit.engine import Engine
    from paradit.settings import settle

    if args.no_progress:  # this process imported them already
        import diffusers
        import transformers

        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()

    run = settle(asked, request)
    video = run.family.video
    out = args.out or ("out/paradit.mp4" if video else "out/paradit.png")
    paths = output_paths(out, len(args.prompt) * request.num_images_per_prompt, video)
    if args.json is not None:  # checked as --out is, before anything runs
        writable_folder("--json", args.json)
    if run.origin is not None:
        print(f"paradit: {run.origin}; parallel flags replace it")
    with Engine(settings=run) as engine:
        result = engine.generate(run.request, progress=not args.no_progress)
    if result is None:  # a non-zero rank under torchrun: rank 0 writes the images
        return 0
    resolved = result.request
    settings = {
        "prompt": resolved.prompts,
        "negative_prompt": resolved.negative_prompts,
        "model": run.spec.name,
        **request_record(resolved),
        "plan": result.timings.plan,
        "software": f"paradit {__version__}",
        **({"lora": lora_record(run.options.lora)} if run.options.lora else {}),
        **({"image": args.image} if args.image else {}),
        **({"mask": args.mask} if args.mask else {}),
        **({"cache": resolved.cache.record()} if resolved.cache is not None else {}),
        **({"sparse_attention": sparse} if (sparse := sparse_record(result.timings)) else {}),
    }
    made = file_records(resolved, result.seed)
    metadata = [
        {k: v if isinstance(v, str) else json.dumps(v) for k, v in {**settings, **each}.items()} for each in made
    ]
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
            serial = serial_engine.generate(result.request, progress=False)
        code, comparison = serial_comparison(result, serial, exact=run.parallel.exact)
        print(comparison)
    if args.json is not None:
        timings = {**dataclasses.asdict(result.timings), "median_step_ms": result.timings.median_step_ms}
        record = {
            **settings,
            "timings": timings,
            "files": [str(p) for p in paths],
            "outputs": [{"file": str(path), **each} for path, each in zip(paths, made)],
            "verify_serial": comparison,
        }
        with replaced(Path(args.json)) as temporary:
            temporary.write_text(json.dumps(record, indent=2) + "\n")
    return code


def request_record(resolved) -> dict:
    """The request fields a client can send (their flags name a ``remote``) as they ran, for metadata and ``--json``."""
    return {
        each.name: getattr(resolved, each.name)
        for each, flag in flagged_fields(GenerationRequest, GENERATE)
        if flag.remote is not None and getattr(resolved, each.name, None) is not None
    }


def file_records(resolved, seed: int) -> list[dict]:
    """Each output's prompts, and the batch's seed with its index: one generator draws the whole batch's noise."""
    per, negatives = resolved.images_per_prompt, resolved.negative_prompts
    return [
        {
            "prompt": resolved.prompts[index // per],
            "negative_prompt": None if negatives is None else negatives[index // per],
            "seed": seed,
            "batch_index": index,
            "batch_size": resolved.batch,
        }
        for index in range(resolved.batch)
    ]


def lora_record(lora) -> dict:
    def refs(adapters) -> list[dict]:
        return [{"source": ref.source, "scale": ref.scale, "weight_name": ref.weight_name} for ref in adapters]

    return {"transformer": refs(lora.transformer), "transformer_2": refs(lora.transformer_2), "mode": lora.mode}


def serial_comparison(parallel, serial, exact: bool) -> tuple[int, str]:
    """The exit code (3: an exact plan off by over one 8-bit level, a lossy one under ``LOSSY_PSNR_DB``) and a line."""
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
    api_key = args.api_key or os.environ.get("PARADIT_API_KEY")
    settings = from_args(ServeSettings, args, SERVE, asked=asked_for(args, SERVE), api_key=api_key)
    if args.ray is not None:  # the groups run in Ray's replicas, not here
        try:
            from paradit.serving.ray_app import serve_on_ray
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise InvalidRequest("--ray needs Ray Serve, which is not installed: pip install 'paradit[ray]'") from None

        return serve_on_ray(settings, from_args(RayFlags, args, SERVE))
    start_worker_server(args.device)  # every group runs in workers; the forkserver's imports overlap this process's
    from paradit.serving.launch import serve

    serve(settings)


def run_plan(args: argparse.Namespace) -> None:
    from paradit.planner.command import plan_text

    asked = asked_for(args, PLAN)
    if "--load-format" not in flags_given(args, PLAN, Asked):  # a plan reads the architecture, not the weights
        asked = dataclasses.replace(asked, load_format="dummy")
    sized = any(getattr(args, name) is not None for name in ("height", "width", "frames", "steps"))
    print(plan_text(asked, request_for(args, PLAN) if sized else None, args.profile, args.link))


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
        """Unwind, so that the engine stops its workers and removes its files; a second signal would cut that short."""
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
        print(f"paradit: internal error: {reportable(exc)}", file=sys.stderr)
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
