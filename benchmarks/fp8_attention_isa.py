"""What the FP8 attention kernel compiles to on GPUs this machine lacks: Triton's compiler runs on the CPU, so the
kernel is compiled here for Hopper (sm_90, TMA descriptors), MI300 (gfx942, e4m3fnuz) and RDNA 4 (gfx1201), as the
runtime would launch it there, and the matrix instructions each uses are listed, with AMD's register and spill counts.
It proves the ROCm path compiles and multiplies in 8 bits on the matrix cores; it does not run it (no AMD GPU here).

    python benchmarks/fp8_attention_isa.py --out-dir out/isa
    python benchmarks/fp8_attention_isa.py --targets mi300 rdna4 --configs 64,128,4,3 32,128,4,3 --masked
    python benchmarks/fp8_attention_isa.py --targets hopper --configs 64,128,4,3 --sparse
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_json  # noqa: E402
from paradit.layers import fp8_attention as kernel  # noqa: E402


@dataclass(frozen=True)
class Target:
    backend: str  # "cuda" or "hip"
    arch: int | str  # compute capability (90) or gfx name
    warp_size: int
    fp8: torch.dtype  # P and V's format there (``paradit.layers.fp8.fp8_dtype``)
    descriptors: bool  # TMA tensor descriptors (``uses_descriptors``)


TARGETS = {
    "hopper": Target("cuda", 90, 32, torch.float8_e4m3fn, True),
    "mi300": Target("hip", "gfx942", 64, torch.float8_e4m3fnuz, False),
    "rdna4": Target("hip", "gfx1201", 32, torch.float8_e4m3fn, False),
}
TRITON_TYPES = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8"}
# The matrix instructions by their mnemonic prefix: Hopper's warpgroup MMA, CDNA's MFMA, RDNA's WMMA.
MATRIX = re.compile(r"\b(wgmma\.mma_async[\w.]*|v_mfma\w*|v_wmma\w*|v_swmmac\w*)")


def compile_forward(
    target: Target,
    config: tuple[int, int, int, int],
    head_dim: int = 128,
    masked: bool = True,
    sparse: bool = False,
):
    """The attention kernel compiled for ``target`` with ``config`` (query tile, key tile, warps, stages), INT8 Q·Kᵀ,
    the constants ``fp8_attention_with_lse`` passes there; ``sparse``: with a block mask's kept tiles (dense: None,
    a constant, so the dense kernel compiles as it did before the block mask existed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_m, block_n, warps, stages = config
    fp8 = TRITON_TYPES[target.fp8]
    pointers = {
        "Q": "*bf16",
        "K8": "*i8",
        "K_SCALE": "*fp32",
        "V8": f"*{fp8}",
        "V_SCALE": "*fp32",
        "K_MEAN": "*fp32",
        "KEY_MASK": "*u8",
        "OUT": "*bf16",
        "LSE": "*fp32",
    }
    if sparse:
        pointers["KEPT_TILES"] = "*i32"
    if target.descriptors:
        pointers |= {
            "K_DESC": f"tensordesc<i8[{block_n}, {head_dim}]>",
            "V_DESC": f"tensordesc<{fp8}[{head_dim}, {block_n}]>",
        }
    else:
        pointers |= {"K_DESC": "*fp32", "V_DESC": "*fp32"}  # never read there
    constants = {
        "QMAX": kernel.INT8_MAX,
        "P_EXPONENT": kernel.p_exponent(target.fp8),
        "QK_INT8": True,
        "HAS_MASK": masked,
        "HEAD_DIM": head_dim,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "DESCRIPTORS": target.descriptors,
        **kernel.rounding(target.fp8),
    }
    if not sparse:
        constants["KEPT_TILES"] = None
    names = list(inspect.signature(kernel._fp8_attention_forward.fn).parameters)
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "fp32" if name == "sm_scale" else "i32")
        for name in names
    }
    source = ASTSource(
        kernel._fp8_attention_forward, signature, constexprs={(names.index(n),): v for n, v in constants.items()}
    )
    gpu = GPUTarget(target.backend, target.arch, target.warp_size)
    return triton.compile(
        source, target=gpu, options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True}
    )


def describe(name: str, target: Target, config: tuple[int, int, int, int], masked: bool, sparse: bool = False) -> dict:
    started = time.perf_counter()
    compiled = compile_forward(target, config, masked=masked, sparse=sparse)
    assembly = compiled.asm["ptx" if target.backend == "cuda" else "amdgcn"]
    row = {
        "target": name,
        "arch": str(target.arch),
        "config": ",".join(map(str, config)),
        "masked": masked,
        "sparse": sparse,
        "compile_s": time.perf_counter() - started,
        "shared_bytes": compiled.metadata.shared,
        "matrix": " ".join(sorted(set(MATRIX.findall(assembly)))),
    }
    if target.backend == "cuda":
        row["tma_loads"] = assembly.count("cp.async.bulk.tensor")
    else:  # the AMD assembler's own counts
        for key, label in (("vgprs", "NumVgprs"), ("scratch_bytes", "ScratchSize")):
            found = re.search(rf";\s*{label}:\s*(\d+)", assembly)
            row[key] = int(found.group(1)) if found else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    # Default: the configs the runtime times on a GPU (``_configs``), to see which of them fit each target.
    parser.add_argument("--configs", nargs="*", default=None, help="query tile,key tile,warps,stages")
    parser.add_argument("--masked", action="store_true", help="with a key mask (padded text), as joint attention runs")
    parser.add_argument("--sparse", action="store_true", help="the block-sparse path (--sparse-attention's kept tiles)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    if args.configs is None:
        configs = kernel._configs(torch.device("cuda"))
    else:
        configs = [tuple(int(part) for part in text.split(",")) for text in args.configs]
    import triton

    rows = [
        describe(name, TARGETS[name], config, args.masked, args.sparse) for name in args.targets for config in configs
    ]
    print_table(
        rows,
        [
            ("target", "target", "s"),
            ("arch", "arch", "s"),
            ("config", "config", "s"),
            ("masked", "mask", ""),
            ("sparse", "sparse", ""),
            ("compile_s", "compile s", ".1f"),
            ("shared_bytes", "shared B", "d"),
            ("vgprs", "VGPRs", "d"),
            ("scratch_bytes", "spill B", "d"),
            ("matrix", "matrix instructions", "s"),
        ],
    )
    write_json(args.out_dir, "fp8_attention_isa.json", {"triton": triton.__version__, "rows": rows})


if __name__ == "__main__":
    main()
