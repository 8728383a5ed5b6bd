"""The agent's GPU checksum kernel (``agent/src/checksum/gpu.rs``, ``SOURCE``) compiles with NVRTC,
the one torch's CUDA wheels carry (compiling needs no GPU), for the architecture of the GPUs it
runs on (H100/H200, compute_90) and NVRTC's default: a kernel edit that does not compile fails
here, in every CI run, instead of on the GPU machine. Whether it sums right is the host model's
test (``agent/src/checksum/gpu/tests.rs``) and, on a GPU, ``make gpu-check``'s."""

from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path

import nvidia  # torch's CUDA wheels: nvidia-cuda-nvrtc among them

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "agent" / "src" / "checksum" / "gpu.rs"


def kernel_source() -> str:
    text = SOURCE.read_text()
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


@pytest.mark.parametrize("options", [[], [b"--gpu-architecture=compute_90"]])
def test_the_agents_checksum_kernel_compiles_with_nvrtc(options):
    lib = nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), kernel_source().encode(), b"pdpair_checksum.cu", 0, None, None) == 0
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
        for kernel in (b"kv_checksum", b"read_words"):
            assert kernel in ptx.value, kernel
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
