"""Compile the Triton kernels of ``vq_attention(impl="triton")`` for CUDA targets on a
machine without a GPU (Triton's compiler and its bundled ptxas need none) and print each
kernel's shared memory; exit 1 where one does not compile or needs more shared memory per
block than the target has:

    python tools/compile_vq_kernels.py [--targets 80 86 90] [--dtypes float32 bfloat16 float16]
                                       [--dims 64 128] [--block-size 128] [--codebook-size 512]

The tiles are those the launchers choose for these sizes (``triton_kernels.compile_options``),
with every switch on. ``--front-end`` instead stops after the first stage (Triton IR) and
covers every combination of the switches, in seconds: tests/test_vq_triton.py runs it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import torch  # noqa: E402
from triton import compile as triton_compile  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402

from linattn.ops.vq import triton_kernels as kernels  # noqa: E402

KERNELS = (kernels.forward_kernel, kernels.query_grads_kernel, kernels.window_key_grads_kernel,
           kernels.cache_grads_kernel)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
INPUT_POINTERS = ("Q", "K", "V", "C", "OUT", "DO")  # in the input dtype; every other pointer is float32
SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # per block, opt-in maximum
SWITCHES = ("HAS_PREV", "HAS_REL", "REL_GRAD", "PREV_GRAD", "MEANS_GRAD")


def source(kernel, dtype: torch.dtype, constants: dict) -> ASTSource:
    """The kernel with ``constants`` bound; pointers, ints and the scale as a launch passes them."""
    constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in INPUT_POINTERS:
            signature[name] = POINTER_TYPES[dtype]
        elif name.isupper() and len(name) > 1:
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    return ASTSource(kernel, signature, constants)


def front_end(dtypes) -> int:
    """Triton IR of every kernel for every switch combination; returns how many were built."""
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    built = 0
    for kernel, name in itertools.product(KERNELS, dtypes):
        own = [switch for switch in SWITCHES if switch in kernel.arg_names]
        for switches in itertools.product((False, True), repeat=len(own)):
            constants = dict(zip(own, switches), **kernels.compile_options(DTYPES[name], 128, 512, 64, 64, False))
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            source(kernel, DTYPES[name], constants).make_ir(
                target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
            built += 1
    return built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", type=int, default=[80, 86, 90],
                        help="compute capabilities (80: A100, 86: RTX 30xx / A10, 90: H100 / H200)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--dims", nargs="+", type=int, default=[64, 128], help="head dims (Dk = Dv)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--codebook-size", type=int, default=512)
    parser.add_argument("--front-end", action="store_true", help="Triton IR only, every switch combination")
    args = parser.parse_args(argv)
    if args.front_end:
        start = time.perf_counter()
        print(f"built the Triton IR of {front_end(args.dtypes)} kernel variants in {time.perf_counter() - start:.1f}s")
        return 0
    failed = 0
    for capability, name, dim, kernel in itertools.product(args.targets, args.dtypes, args.dims, KERNELS):
        options = kernels.compile_options(DTYPES[name], args.block_size, args.codebook_size, dim, dim, False,
                                          SHARED_BYTES.get(capability))
        constants = dict(dict.fromkeys(SWITCHES, True), **options)
        start = time.perf_counter()
        try:
            compiled = triton_compile(source(kernel, DTYPES[name], constants), target=GPUTarget("cuda", capability, 32))
        except Exception as error:  # a compile error is the finding; report it and go on
            print(f"sm_{capability} {name} D={dim} {kernel.__name__}: FAILED {type(error).__name__}: {error}")
            failed += 1
            continue
        shared = compiled.metadata.shared
        limit = SHARED_BYTES.get(capability)
        over = limit is not None and shared > limit
        failed += over
        print(f"sm_{capability} {name} D={dim} {kernel.__name__}: {shared / 1024:.0f} KiB shared"
              f"{' > the target maximum' if over else ''} (tiles BM={constants['BM']} BN={constants['BN']} "
              f"BS={constants['BS']}), {time.perf_counter() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
