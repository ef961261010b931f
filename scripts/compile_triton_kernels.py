"""Compile the triton algorithm's kernels (ampdoctor/stats/full_triton_kernels.py) and the block
statistics' kernel (ampdoctor/stats/block_triton.py) for an NVIDIA target
without a GPU, with the ptxas that Triton ships: catches what Triton's interpreter lets pass (a
plain global read in a kernel, an op the compiler refuses). Prints one line per kernel; exits 1
on the first that fails. Run it without TRITON_INTERPRET (the tests do, in a subprocess).

    python scripts/compile_triton_kernels.py [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_triton_kernels: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ampdoctor.stats import block_triton as bt  # noqa: E402
from ampdoctor.stats import full_triton as ft  # noqa: E402 - the launch parameters
from ampdoctor.stats import full_triton_kernels as kernels  # noqa: E402

TILE = {"tiles": "*i64", "addresses": "*i64", "single": "*fp32", "inv_scale": "*fp32", "hist_out": "*i32", "extra_out": "*i32", "amax_out": "*fp32",
        "amin_out": "*i32", "sumsq_out": "*fp64", "marks": "*u8", "threshold": "fp32"}
SLOT = {"first": "*i64", "hist_in": "*i32", "extra_in": "*i32", "amax_in": "*fp32", "amin_in": "*i32",
        "sumsq_in": "*fp64", "lines": "*i64", "marks": "*u8", "n_tensors": "i32", "results": "*u8", "amax_at": "i32",
        "amin_at": "i32", "sumsq_at": "i32", "line_zeros_at": "i32"}

BLOCK = {"data": "*fp32", "n_rows": "i32", "n_cols": "i32", "row_stride": "i64", "tensor_amax": "*fp32",
         "inv_scale": "*fp32", "rows_read": "i32", "rows_total": "i32", "hist_out": "*i32", "counts_out": "*i32",
         "sums_out": "*fp64"}


def variants():
    """(name, kernel, signature, constexprs, warps): each dtype's tile kernel, with and without a
    scale, 64-bit indices and an address table, and the slot kernel both ways, as
    triton_full_stats launches them."""
    for torch_name, element, size in (("float32", "float32", 4), ("float16", "float16", 2), ("bfloat16", "int16", 2),
                                      ("float64", "float64", 8)):
        for has_scale in (True, False):
            for wide in (False, True):
                for single in (False, True):
                    pointer = {**TILE, "single": f"*{'i16' if element == 'int16' else 'fp' + str(8 * size)}"}
                    yield (f"tile {torch_name} scale={has_scale} wide={wide} single={single}", kernels._tile_kernel,
                           pointer, {"DTYPE": getattr(tl, element), "ESIZE": size, "SINGLE": single,
                                     "HAS_SCALE": has_scale, "RB": ft.RB, "CB": ft.CB, "FIRST_E": 71, "LAST_BIN": 63,
                                     "NBINS": 64, "WIDE": wide, "FOR_LOOP": True, "BF16": torch_name == "bfloat16"},
                           ft.TILE_WARPS)
    for torch_name, element in (("float32", "fp32"), ("float16", "fp16"), ("bfloat16", "i16")):
        for has_inv in (True, False):
            for tc in (256, 32):  # (the widest and the narrowest tile)
                yield (f"block {torch_name} inv={has_inv} tile={bt.TILE // tc}x{tc}", bt._block_kernel,
                       BLOCK | {"data": f"*{element}"},
                       {"HAS_INV": has_inv, "BF16": torch_name == "bfloat16", "TR": bt.TILE // tc, "TC": tc}, bt.WARPS)
    for per_tensor in (True, False):
        yield (f"slot per_tensor={per_tensor}", kernels._slot_kernel, SLOT,
               {"STRIDE": 515, "ABOVE_AT": 512, "ROWS": ft._SLOT_ROWS, "FIRST_E": 71, "BINS": 64, "NBINS": 64,
                "PER_TENSOR": per_tensor, "LINE_BLOCK": ft._LINE_BLOCK, "FOR_LOOP": True}, 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100, H200)")
    parser.add_argument("--quick", action="store_true",
                        help="float32 and bfloat16 tile kernels with a scale only, the bfloat16 block kernels")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    for name, fn, signature, constexprs, warps in variants():
        if args.quick and name.startswith("block") and not (name.startswith("block bfloat16") and "x256" in name):
            continue
        if args.quick and name.startswith("tile") and ("wide=True" in name or "scale=False" in name
                                                       or name.split()[1] in ("float16", "float64")):
            continue
        sig = {**signature, **{k: "constexpr" for k in constexprs}}
        try:
            try:
                source = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
            except TypeError:  # Triton before 3.3 (torch 2.6's 3.2) names them constants
                source = ASTSource(fn=fn, signature=sig, constants=constexprs)
            options = {"num_warps": warps, **({"enable_fp_fusion": False} if name.startswith("block") else {})}
            kernel = triton.compile(source, target=target, options=options)
        except Exception as exc:  # noqa: BLE001
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            return 1
        ptx = kernel.asm["ptx"]
        # tl.histogram adds each warp's bins in shared memory; nothing may add into global memory
        global_atomics = "atom.global" in ptx or "red.global" in ptx
        print(f"ok   {name}: {len(ptx.splitlines())} PTX lines, {'GLOBAL ATOMICS' if global_atomics else 'no global atomics'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
