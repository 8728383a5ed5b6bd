"""The agent's CUDA kernels (``SOURCE`` in ``agent/src/checksum/gpu.rs``, the checksum, and in
``agent/src/memory/batch_copy.rs``, the batch copy) compile with NVRTC, the one torch's CUDA
wheels carry (compiling needs no GPU), for the architecture of the GPUs it runs on (H100/H200,
compute_90) and NVRTC's default: a kernel edit that does not compile fails here, in every CI run,
instead of on the GPU machine. Whether they compute right is the host model's test
(``agent/src/checksum/gpu/tests.rs``, ``batch_copy``'s split) and, on a GPU, ``make gpu-check``'s."""

from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path

import nvidia  # torch's CUDA wheels: nvidia-cuda-nvrtc among them

import pytest

AGENT = Path(__file__).resolve().parents[2] / "agent" / "src"
KERNELS = {
    "checksum": (AGENT / "checksum" / "gpu.rs", (b"kv_checksum", b"read_words")),
    "batch_copy": (AGENT / "memory" / "batch_copy.rs", (b"copy_pieces",)),
}


def kernel_source(path: Path) -> str:
    text = path.read_text()
    start = text.index('pub const SOURCE: &str = r#"') + len('pub const SOURCE: &str = r#"')
    return text[start:text.index('"#;', start)]


def nvrtc() -> ctypes.CDLL:
    libs = sorted(p for base in nvidia.__path__ for p in glob.glob(os.path.join(base, "**", "libnvrtc*.so*"), recursive=True))
    builtins = [p for p in libs if os.path.basename(p).startswith("libnvrtc-builtins.so")]
    main = [p for p in libs if os.path.basename(p).startswith("libnvrtc.so")]
    assert main and builtins, f"no NVRTC in torch's CUDA wheels: {libs}"
    # NVRTC opens its builtins by name: loaded first, it finds them without LD_LIBRARY_PATH.
    ctypes.CDLL(builtins[0], mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(main[0])


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("options", [[], [b"--gpu-architecture=compute_90"]])
def test_the_agents_kernels_compile_with_nvrtc(kernel, options):
    path, entries = KERNELS[kernel]
    lib = nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), kernel_source(path).encode(), f"pdpair_{kernel}.cu".encode(), 0, None, None) == 0
    try:
        argv = (ctypes.c_char_p * len(options))(*options)
        code = lib.nvrtcCompileProgram(prog, len(options), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert code == 0, log.value.decode(errors="replace")
        ptx_size = ctypes.c_size_t()
        assert lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)) == 0
        ptx = ctypes.create_string_buffer(ptx_size.value)
        assert lib.nvrtcGetPTX(prog, ptx) == 0
        for entry in entries:
            assert entry in ptx.value, entry
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# The batch copy kernel's own source, run on the host: CUDA's built-ins become plain globals and
# every (block, thread) of the grid runs in turn (its threads share nothing and never wait for
# each other, so any order is one the GPU may take). What it proves is the kernel's arithmetic:
# which bytes each piece moves, in which word size, at every alignment; not the GPU's memory
# system, which `make gpu-check` measures.
HOST_HARNESS = r"""
#include <cstdint>
#include <cstddef>
struct pdpair_dim3 { unsigned x, y, z; };
static pdpair_dim3 blockIdx, threadIdx, gridDim, blockDim;
struct ulonglong2 { unsigned long long x, y; };
#define __global__
#define __restrict__ __restrict
%s
extern "C" void run_grid(const u64* table, u64 pieces, unsigned grid, unsigned threads) {
    gridDim.x = grid; blockDim.x = threads;
    for (unsigned b = 0; b < grid; b++)
        for (unsigned t = 0; t < threads; t++) {
            blockIdx.x = b; threadIdx.x = t;
            copy_pieces(table, pieces);
        }
}
"""


def rust_const(path: Path, name: str) -> int:
    import re

    m = re.search(rf"const {name}: \w+ = ([0-9_]+)(?: << ([0-9]+))?;", path.read_text())
    assert m, f"{name} in {path}"
    return int(m.group(1).replace("_", "")) << int(m.group(2) or 0)


@pytest.fixture(scope="module")
def host_copy_pieces(tmp_path_factory):
    import subprocess

    d = tmp_path_factory.mktemp("batch_copy")
    (d / "harness.cpp").write_text(HOST_HARNESS % kernel_source(KERNELS["batch_copy"][0]))
    subprocess.run(["c++", "-O2", "-shared", "-fPIC", "-o", str(d / "harness.so"), str(d / "harness.cpp")], check=True)
    lib = ctypes.CDLL(str(d / "harness.so"))
    lib.run_grid.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64, ctypes.c_uint, ctypes.c_uint]
    return lib.run_grid


@pytest.mark.parametrize("grid", [1, 7, 64])
def test_the_batch_copy_kernel_moves_exactly_its_pieces_at_every_alignment(host_copy_pieces, grid):
    import random

    path = KERNELS["batch_copy"][0]
    threads, piece = rust_const(path, "THREADS"), rust_const(path, "PIECE")
    rng = random.Random(grid)
    size = 1 << 20
    src = ctypes.create_string_buffer(bytes(rng.getrandbits(8) for _ in range(size)), size)
    dst = ctypes.create_string_buffer(size)
    s0, d0 = ctypes.addressof(src), ctypes.addressof(dst)
    # Destinations apart (a piece per 16 KiB slot, or a whole PIECE at the end); sources anywhere.
    # 16-byte, 8-byte and byte alignment, lengths below and above a grid's worth of words.
    pieces = []
    for i in range(40):
        align = (16, 8, 1)[i % 3]
        n = rng.choice([1, 7, 8, 16, 24, 256, 4096, threads * 16 + 8, 12000]) // align * align or align
        at = i * 16384 + rng.randrange(0, 1024 // align) * align
        pieces.append((at, rng.randrange(0, (size - n) // align) * align, n))
    pieces.append((size - piece, 0, piece))
    table = (ctypes.c_uint64 * (3 * len(pieces)))(*[v for at, frm, n in pieces for v in (d0 + at, s0 + frm, n)])
    host_copy_pieces(table, len(pieces), grid, threads)
    want = bytearray(size)
    for at, frm, n in pieces:
        want[at:at + n] = src.raw[frm:frm + n]
    assert dst.raw == bytes(want)
