"""The direct path: vLLM's KV tensors, as they are in GPU memory, registered as the agent's GPU pool
(docs/engine-api.md, "GPU pools"), so no byte of KV is staged through host memory by the engine.

The connector takes it where the agent accepts GPU pools (its ``Capabilities`` list ``cuda`` and
the tensors' GPU) and every layer's tensor is, byte for byte, a region the agent's layout
describes: one region per layer, ``KvFirst`` (FlashAttention's ``[2, blocks, ...]``),
``BlocksFirst`` (FlashInfer's ``[blocks, 2, ...]``) or ``Latent`` (MLA), blocks dense in the
geometry's token layout. Each region is shared by the CUDA IPC handle of the ``cudaMalloc``
allocation that holds it and its offset there (torch's caching allocator), or, for memory that
cannot be shared that way (torch's ``expandable_segments``, other VMM allocators), as the file
descriptors of the VMM allocations it lies in (``ShareGpuMemory``, where the agent's
``gpu_sharing`` lists ``vmm_fd``); and prefill records an interprocess CUDA event after each
forward pass, which the agent waits for before it reads.

Torch and the CUDA driver (through ``ctypes``, ``libcuda.so.1``) only: no vLLM, so the GPU check
(hack/gpu-check.sh) runs this against real agents on a machine with torch and a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import bisect
import os
import resource
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from . import client as agent_client
from . import staging
from .layout import MAX_REGIONS, PoolLayout
from .transfer import Stager

log = logging.getLogger("pdpair_vllm")


class DirectRefused(Exception):
    """Why the direct path cannot take these tensors (the connector stages instead)."""


# ---- which bytes a tensor holds ------------------------------------------------------------------


def arrangement_of(t: torch.Tensor, layout: PoolLayout) -> str:
    """The region arrangement whose bytes ``t`` (one layer's KV tensor) holds from its first
    byte, exactly as the agent's layout places them (the same block ids, dense blocks in the
    geometry's token layout); raises :class:`DirectRefused` naming what differs."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    elems = layout.block_len // t.element_size() if layout.block_len % t.element_size() == 0 else -1
    nb = layout.num_blocks
    if t.dim() == 4:
        _side_by_side(t, layout)
        return "Interleaved"  # at the strides `regions` reads from all layers' tensors
    if t.dim() == 3:  # MLA: [blocks, block, dim]
        if not layout.latent:
            raise DirectRefused(f"a KV tensor of shape {shape} is MLA's [blocks, block, dim], the geometry's is not MLA")
        arrangement, kv_dim, block_dim = "Latent", None, 0
    elif t.dim() == 5 and shape[0] == 2 and shape[1] == nb:
        arrangement, kv_dim, block_dim = "KvFirst", 0, 1
    elif t.dim() == 5 and shape[0] == nb and shape[1] == 2:
        arrangement, kv_dim, block_dim = "BlocksFirst", 1, 0
    else:
        raise DirectRefused(f"a KV tensor of shape {shape} is neither [2, {nb}, ...], [{nb}, 2, ...] nor [{nb}, block, dim]")
    if shape[block_dim] != nb:
        raise DirectRefused(f"a KV tensor of shape {shape} has {shape[block_dim]} blocks; the pool has {nb}")
    # Inside a block: (token, head, dim) in the geometry's order, densely.
    if t.dim() == 3:
        dims = [(shape[1], stride[1]), (1, 0), (shape[2], stride[2])]
    else:
        dims = [(shape[2], stride[2]), (shape[3], stride[3]), (shape[4], stride[4])]
    (tokens, s_token), (heads, s_head), (dim, s_dim) = dims
    if (tokens, heads, dim) != (layout.block_size, layout.local_heads, layout.head_dim):
        raise DirectRefused(
            f"a KV block of tensor {shape} holds (tokens, heads, dim) = ({tokens}, {heads}, {dim}); the geometry's is "
            f"({layout.block_size}, {layout.local_heads}, {layout.head_dim})"
        )
    want_token, want_head = ((dim, tokens * dim) if layout.layout == "HND" else (heads * dim, dim))
    dense = s_dim == 1 and (tokens == 1 or s_token == want_token) and (heads == 1 or s_head == want_head)
    if not dense or tokens * heads * dim != elems:
        raise DirectRefused(
            f"a KV block of tensor {shape} / strides {stride} is not a dense {layout.layout} block of "
            f"{layout.block_len} bytes"
        )
    want_block, want_kv = {"KvFirst": (elems, nb * elems), "BlocksFirst": (2 * elems, elems),
                           "Latent": (elems, 0)}[arrangement]
    if stride[block_dim] != want_block or (kv_dim is not None and stride[kv_dim] != want_kv):
        raise DirectRefused(
            f"KV tensor {shape} / strides {stride} does not hold its blocks back to back as {arrangement} "
            f"(blocks {want_block} elements apart{'' if kv_dim is None else f', K to V {want_kv}'})"
        )
    return arrangement


def _side_by_side(t: torch.Tensor, layout: PoolLayout) -> int:
    """Checks one layer's vLLM 0.33 ``[blocks, heads, tokens, K|V]`` tensor (each head's each
    token's K then its V) against the geometry: its blocks dense in the geometry's token layout.
    The bytes from one block to the next; raises :class:`DirectRefused` naming what differs."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    if t.dim() != 4:
        raise DirectRefused(f"a KV tensor of shape {shape} beside vLLM 0.33's [blocks, heads, tokens, K|V] ones")
    if layout.latent:
        raise DirectRefused(
            f"a KV tensor of shape {shape} is vLLM 0.33's MLA [blocks, 1, tokens, latent]; the direct path takes an "
            "MLA cache as [blocks, block, dim] tensors only, so it is staged"
        )
    nb, heads, tokens, cell = shape
    if nb != layout.num_blocks:
        raise DirectRefused(f"a KV tensor of shape {shape} has {nb} blocks; the pool has {layout.num_blocks}")
    if (tokens, heads, cell) != (layout.block_size, layout.local_heads, 2 * layout.head_dim):
        raise DirectRefused(
            f"a KV block of tensor {shape} holds (tokens, heads, K|V) = ({tokens}, {heads}, {cell}); the geometry's is "
            f"({layout.block_size}, {layout.local_heads}, {2 * layout.head_dim})"
        )
    want_token, want_head = (cell, tokens * cell) if layout.layout == "HND" else (heads * cell, cell)
    if stride[3] != 1 or (tokens > 1 and stride[2] != want_token) or (heads > 1 and stride[1] != want_head):
        raise DirectRefused(
            f"a KV block of tensor {shape} / strides {stride} is not a dense {layout.layout} block of each head's "
            "token's K then V"
        )
    return stride[0] * t.element_size()


def _one_allocation(tensors: Sequence[torch.Tensor], layout: PoolLayout) -> List[dict]:
    """vLLM 0.33's layers, views of one allocation: one ``Interleaved`` region of all of them, at
    the layer and block strides their addresses show (layers or blocks outermost)."""
    block = {_side_by_side(t, layout) for t in tensors}
    if len(block) != 1:
        raise DirectRefused(f"the layers' KV tensors keep their blocks {sorted(block)} bytes apart, not one stride")
    starts = [t.data_ptr() for t in tensors]
    steps = {b - a for a, b in zip(starts, starts[1:])}
    if len(tensors) > 1 and (len(steps) != 1 or min(steps) <= 0):
        raise DirectRefused(
            "the layers' KV tensors do not lie one stride apart in layer order (the agent takes them as one region of "
            f"layers a stride apart): steps {sorted(steps)[:4]} bytes"
        )
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(storages) != 1:
        raise DirectRefused(f"the layers' KV tensors are views of {len(storages)} allocations, not one")
    (block_stride,) = block
    if layout.num_blocks == 1:
        block_stride = 2 * layout.block_len  # one block: its stride is unused (torch may say anything)
    layer_stride = steps.pop() if len(tensors) > 1 else block_stride * layout.num_blocks
    return [{"layers": len(tensors), "kv_arrangement": "Interleaved", "layer_stride": layer_stride,
             "block_stride": block_stride}]


def regions(tensors: Sequence[torch.Tensor], layout: PoolLayout) -> List[dict]:
    """The registration's ``regions``: one per layer, each its tensor's arrangement, or (vLLM
    0.33, every layer a view of one allocation) one ``Interleaved`` region of all layers."""
    if len(tensors) != layout.layers:
        raise DirectRefused(f"{len(tensors)} KV tensors for {layout.layers} layers")
    if any(t.dim() == 4 for t in tensors):
        return _one_allocation(tensors, layout)
    if len(tensors) > MAX_REGIONS:
        raise DirectRefused(f"{len(tensors)} layers, each its own tensor; a pool has at most {MAX_REGIONS} regions")
    return [{"layers": 1, "kv_arrangement": arrangement_of(t, layout)} for t in tensors]


def refused_by_agent(capabilities: Mapping, device_uuid: str, across_nodes: bool = True) -> Optional[str]:
    """Why the agent would not take a GPU pool on ``device_uuid``, from its ``Capabilities``;
    ``across_nodes``: also why its GPU pools would not reach engines on other nodes."""
    if "cuda" not in (capabilities.get("pool_memory") or ()):
        return f"the agent accepts no GPU pools ({capabilities.get('gpu_pools_refused') or 'it lists no cuda pool memory'})"
    uuids = {normalize_uuid(g.get("uuid", "")) for g in capabilities.get("gpus") or () if isinstance(g, Mapping)}
    if normalize_uuid(device_uuid) not in uuids:
        return f"the KV cache is on GPU {device_uuid}, which the agent's CUDA driver does not show it (it shows {sorted(uuids)})"
    if across_nodes and not capabilities.get("gpu_between_agents"):
        return ("the agent moves KV to other nodes over UCX (RDMA), which carries host memory only in this version, so "
                "KV is staged to reach them (direct: true takes the direct path for pairs on one node)")
    return None


def normalize_uuid(uuid: str) -> str:
    u = str(uuid).lower()
    if u.startswith("gpu-"):
        u = u[4:]
    return u.replace("-", "")


# ---- the CUDA driver ------------------------------------------------------------------------------

_POINTER_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
#: The most VMM allocations an agent maps for one engine (``memory::cuda::MAX_VMM_CHUNKS``).
MAX_VMM_CHUNKS = 8192
_lock = threading.Lock()
_driver: Optional[ctypes.CDLL] = None


def _cuda() -> ctypes.CDLL:
    global _driver
    with _lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise DirectRefused(f"no CUDA driver in the engine ({e})") from None
            _check(lib.cuInit(0), "cuInit")
            _driver = lib
        return _driver


def _check(code: int, what: str) -> None:
    if code != 0:
        raise DirectRefused(f"{what} failed with CUDA error {code}{_error_name(code)}")


def _error_name(code: int) -> str:
    """`` (CUDA_ERROR_...)`` for ``code`` where the loaded driver names it, else nothing."""
    lib = _driver
    if lib is None:
        return ""
    name = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(ctypes.c_int(code), ctypes.byref(name)) != 0 or not name.value:
            return ""
    except AttributeError:
        return ""
    return f" ({name.value.decode(errors='replace')})"


class _Bytes64(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def _ensure_context(lib: ctypes.CDLL, ordinal: int) -> None:
    """Driver calls need a current context of the tensors' device: torch's (the device's primary
    one) where it made one current on this thread, else that primary context. A current context
    of another device is refused (its answers would be about the wrong GPU's memory): callers
    enter ``torch.cuda.device`` first."""
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    if ctx.value:
        current = ctypes.c_int()
        _check(lib.cuCtxGetDevice(ctypes.byref(current)), "cuCtxGetDevice")
        if current.value != dev.value:
            raise DirectRefused(f"this thread's CUDA context is device {current.value}'s, the KV cache is on {ordinal}")
        return
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    finally:
        # The v2 entry point (cuda.h maps the name to it); the context stays alive, as torch's
        # runtime holds its own reference to the primary context.
        release = getattr(lib, "cuDevicePrimaryCtxRelease_v2", None) or lib.cuDevicePrimaryCtxRelease
        release(dev)


def device_uuid(t: torch.Tensor) -> str:
    """The UUID of the GPU holding ``t``, as ``nvidia-smi -L`` prints it (``GPU-...``): device
    numbers differ between the engine's container and the agent's."""
    lib = _cuda()
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), t.device.index), "cuDeviceGet")
    raw = (ctypes.c_ubyte * 16)()
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    if get_uuid is None:
        raise DirectRefused("the engine's CUDA driver has no cuDeviceGetUuid")
    _check(get_uuid(raw, dev), "cuDeviceGetUuid")
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _address_range(lib: ctypes.CDLL, ptr: int) -> Tuple[int, int]:
    """(base, bytes) of the allocation (for VMM memory: the mapped allocation) holding ``ptr``."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
           "cuMemGetAddressRange")
    return base.value, size.value


def ipc_capable(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory can be shared by CUDA IPC handle (``cudaMalloc``'s, not VMM's)."""
    lib = _cuda()
    _ensure_context(lib, t.device.index)
    capable = ctypes.c_int()
    _check(lib.cuPointerGetAttribute(ctypes.byref(capable), _POINTER_IS_LEGACY_CUDA_IPC_CAPABLE,
                                     ctypes.c_uint64(t.data_ptr())),
           "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)")
    return bool(capable.value)


def vmm_plan(starts: Sequence[int], length: int, address_range: Callable[[int], Tuple[int, int]]
             ) -> Tuple[List[Tuple[int, int]], List[int]]:
    """The VMM allocations holding ``length`` bytes from each of ``starts``, as ``(base, bytes)`` in
    address order (each once), and each start's offset into them laid end to end, as the agent
    maps them (``ShareGpuMemory``). ``address_range(ptr)`` is the mapped allocation holding
    ``ptr``. A tensor is contiguous in the engine's addresses, so the allocations it spans are
    neighbours in that order; raises :class:`DirectRefused` when the driver's answers do not fit."""
    chunks: dict = {}
    for start in starts:
        at, end = start, start + length
        while at < end:
            base, size = address_range(at)
            if size <= 0 or not base <= at < base + size:
                raise DirectRefused(f"the driver places address {at:#x} in {size} bytes at {base:#x}")
            if chunks.setdefault(base, size) != size:
                raise DirectRefused(f"the allocation at {base:#x} is {size} and {chunks[base]} bytes long")
            at = base + size
    order = sorted(chunks)
    for a, b in zip(order, order[1:]):
        if a + chunks[a] > b:
            raise DirectRefused(f"allocations at {a:#x} and {b:#x} overlap")
    if len(order) > MAX_VMM_CHUNKS:
        raise DirectRefused(f"the KV cache lies in {len(order)} VMM allocations; the agent maps at most {MAX_VMM_CHUNKS}")
    offset_of, total = {}, 0
    for base in order:
        offset_of[base] = total
        total += chunks[base]
    offsets = []
    for start in starts:
        base = order[bisect.bisect_right(order, start) - 1]
        offsets.append(offset_of[base] + start - base)
    return [(b, chunks[b]) for b in order], offsets


class _AllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` (cuda.h): 32 bytes."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location_type", ctypes.c_int),
        ("location_id", ctypes.c_int),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


def exportable_as_fd(requested_handle_types: int, base: int) -> None:
    """Refuses, saying why, an allocation made without POSIX-descriptor export (torch before 2.5
    requests none for its expandable segments; fabric handles; allocators such as vLLM's sleep
    mode): the export would fail with a bare CUDA error."""
    if not requested_handle_types & _HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
        raise DirectRefused(
            f"the VMM allocation at {base:#x} was not made exportable as a POSIX file descriptor (its requested "
            f"handle types are {requested_handle_types:#x}; torch before 2.5, fabric-only handles or another "
            "allocator): it cannot be shared with the agent"
        )


def _export_vmm(lib: ctypes.CDLL, base: int) -> int:
    """A POSIX file descriptor of the VMM allocation mapped at ``base`` (the caller closes it)."""
    handle = ctypes.c_uint64()
    _check(lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(base)), "cuMemRetainAllocationHandle")
    try:
        prop = _AllocationProp()
        _check(lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), handle),
               "cuMemGetAllocationPropertiesFromHandle")
        exportable_as_fd(prop.requestedHandleTypes, base)
        fd = ctypes.c_int(-1)
        _check(lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, ctypes.c_int(_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                                                ctypes.c_ulonglong(0)),
               "cuMemExportToShareableHandle(POSIX file descriptor)")
    finally:
        lib.cuMemRelease(handle)
    return fd.value


def share_vmm(tensors: Sequence[torch.Tensor], length: int) -> Tuple[List[dict], List[Tuple[int, int]]]:
    """The registration's ``gpu.regions`` for tensors in VMM memory (each ``{"offset"}``, no
    handle) and the allocations to share before it, ``(descriptor, bytes)`` in order; the caller
    closes the descriptors once sent."""
    lib = _cuda()
    _ensure_context(lib, tensors[0].device.index)
    chunks, offsets = vmm_plan([t.data_ptr() for t in tensors], length, lambda p: _address_range(lib, p))
    room_for_fds(len(chunks))
    shared: List[Tuple[int, int]] = []
    try:
        for base, size in chunks:
            shared.append((_export_vmm(lib, base), size))
    except BaseException:
        for fd, _ in shared:
            os.close(fd)
        raise
    return [{"offset": o} for o in offsets], shared


#: The open-file soft limit before :func:`room_for_fds` raised it, until :func:`restore_fds`.
_soft_before: Optional[int] = None


def room_for_fds(count: int, margin: int = 256) -> None:
    """Makes room for ``count`` more open descriptors (every VMM allocation is exported before
    any is sent: thousands for a large cache, past the usual soft limit of 1024), raising the soft
    limit up to the hard one until :func:`restore_fds`; refuses, saying so, where even the hard
    limit is too low."""
    global _soft_before
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 0
    need = open_now + count + margin
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise DirectRefused(
                f"sharing the KV cache takes {count} file descriptors at once, and the engine's open-file limit is "
                f"{hard} with {open_now} open (raise its RLIMIT_NOFILE)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        if _soft_before is None:
            _soft_before = soft


def restore_fds(margin: int = 64) -> None:
    """Puts back the soft limit :func:`room_for_fds` raised, once the exported descriptors are
    closed (code that still uses ``select`` breaks past 1024); kept raised where the engine
    holds nearly that many open by then."""
    global _soft_before
    if _soft_before is None:
        return
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        return
    if open_now + margin <= _soft_before:
        resource.setrlimit(resource.RLIMIT_NOFILE, (_soft_before, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        _soft_before = None


def share(t: torch.Tensor, length: int, handles: Optional[dict] = None) -> dict:
    """``{"ipc_handle", "offset"}`` of the allocation holding ``t``'s first ``length`` bytes
    (``handles``: allocation base -> handle, so tensors in one allocation name it alike)."""
    lib = _cuda()
    if not ipc_capable(t):
        raise DirectRefused(
            "the KV cache's memory cannot be shared by CUDA IPC handle (torch's expandable_segments, or another "
            "allocator than cudaMalloc), and the agent takes no VMM descriptors (its gpu_sharing lacks vmm_fd)"
        )
    base_value, size_value = _address_range(lib, t.data_ptr())
    offset = t.data_ptr() - base_value
    if offset + length > size_value:
        raise DirectRefused(
            f"a KV tensor's {length} bytes at offset {offset} run past its allocation of {size_value} bytes"
        )
    handles = {} if handles is None else handles
    if base_value not in handles:
        handle = _Bytes64()
        _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base_value)), "cuIpcGetMemHandle")
        handles[base_value] = bytes(handle.reserved).hex()
    return {"ipc_handle": handles[base_value], "offset": offset}


# ---- the pool --------------------------------------------------------------------------------------


#: Interprocess events a prefill pool records in turn, one after each request's writes, named in
#: its ``KvReady`` (``gpu.events``): the agent waits for that one, not for the latest record of one
#: event, which follows every later forward pass too.
EVENTS = 16


class DirectKv(Stager):
    """The engine's own KV tensors are the agent's pool: nothing to copy. Prefill records one of
    its interprocess events on the stream that wrote the KV before each ``KvReady``, naming it
    there (the agent's copies wait for it), and its one ``event`` too (what an agent from before
    the named ones waits for); or, without events (``event=False``: an agent that cannot open
    them), synchronizes that stream. Decode's blocks have landed when the agent says
    ``RequestDone``."""

    in_place = True

    def __init__(self, tensors: Sequence[torch.Tensor], layout: PoolLayout, device: torch.device, uuid: str,
                 by_ipc: Optional[Sequence[bool]] = None, event: bool = True, events: bool = True):
        self.tensors = list(tensors)
        self.layout = layout
        self.device = device
        #: The GPU's UUID (``GPU-...``).
        self.uuid = uuid
        #: Per tensor, whether its memory is shared by IPC handle (else as VMM descriptors).
        self.by_ipc = list(by_ipc) if by_ipc is not None else [True] * len(self.tensors)
        #: Whether any tensor's memory is shared as VMM descriptors.
        self.vmm = not all(self.by_ipc)
        #: The interprocess event the agent waits for (``None``: the stream is synchronized).
        self.event = torch.cuda.Event(enable_timing=False, interprocess=True) if event else None
        #: The events a ``KvReady`` names (``gpu.events``), and the one recorded last.
        self.events = [torch.cuda.Event(enable_timing=False, interprocess=True) for _ in range(EVENTS)] \
            if event and events else []
        self.last: Optional[int] = None
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(device))
        self.regions = regions(self.tensors, layout)
        # The memory of each region: its first layer's tensor, and the region's bytes from there.
        if len(self.regions) == 1 and self.regions[0]["kv_arrangement"] == "Interleaved":
            r = self.regions[0]
            length = (r["layers"] - 1) * r["layer_stride"] + (layout.num_blocks - 1) * r["block_stride"] \
                + 2 * layout.block_len
            self.shares = [(self.tensors[0], length, self.by_ipc[0])]
        else:
            self.shares = [(t, layout.layer_len, ipc) for t, ipc in zip(self.tensors, self.by_ipc)]

    def gpu_pool(self) -> Tuple[dict, List[Tuple[int, int]]]:
        """The registration's ``gpu`` field, and the VMM allocations to share before it
        (``(descriptor, bytes)``, empty for IPC handles; the caller closes them once sent). Each
        tensor goes by IPC handle where its memory allows, the others as VMM allocations."""
        pool = {"device_uuid": self.uuid}
        if self.event is not None:
            pool["event"] = bytes(self.event.ipc_handle()).hex()
        if self.events:
            pool["events"] = [bytes(e.ipc_handle()).hex() for e in self.events]
        handles: dict = {}
        with torch.cuda.device(self.device):
            gpu_regions: List[Optional[dict]] = [share(t, length, handles) if ipc else None
                                                 for t, length, ipc in self.shares]
            shared: List[Tuple[int, int]] = []
            rest = [t for t, _, ipc in self.shares if not ipc]
            if rest:
                vmm_regions, shared = share_vmm(rest, self.shares[0][1])
                it = iter(vmm_regions)
                gpu_regions = [r if r is not None else next(it) for r in gpu_regions]
        pool["regions"] = gpu_regions
        return pool, shared

    def save_all(self, requests: List[List[int]]) -> Optional[int]:
        return self.save([])  # in place: one record after the step's writes

    def save(self, blocks: List[int]) -> Optional[int]:
        stream = torch.cuda.current_stream(self.device)
        if self.event is None:
            stream.synchronize()
            return None
        self.event.record(stream)
        return self._record_next(stream) if self.events else None

    def _record_next(self, stream) -> int:
        """Records the next of ``events`` (in turn) on ``stream``; its index, for the agent."""
        self.last = 0 if self.last is None else (self.last + 1) % len(self.events)
        self.events[self.last].record(stream)
        return self.last

    def before_receive(self) -> Optional[int]:
        # The agent writes into the blocks of new receives on its own stream: kernels this
        # engine queued before (reading or writing blocks a finished request left, now given to
        # the receive) must be done first. With events, the next one recorded on the current
        # stream, which vLLM's forward passes run on, and named in the ExpectKv: the agent lets
        # nothing write the blocks before it passed, and this thread does not wait. Without
        # them, every stream of the device synchronized.
        if not self.events:
            torch.cuda.synchronize(self.device)
            return None
        return self._record_next(torch.cuda.current_stream(self.device))

    def load(self, blocks: List[int]) -> None:
        return  # the agent wrote them in place


def takes_events(capabilities: Mapping) -> bool:
    """Whether the agent takes ``gpu.events`` and waits for the one a ``KvReady`` or an
    ``ExpectKv`` names (its ``Capabilities`` say ``gpu_events``); one from before them ignores
    them, and decode must then synchronize before new receives."""
    return capabilities.get("gpu_events") is True


def plan(tensors: Sequence[torch.Tensor], layout: PoolLayout, capabilities: Mapping,
         across_nodes: bool = True, event: bool = True) -> DirectKv:
    """The direct pool for these tensors, or :class:`DirectRefused` saying why not
    (``across_nodes``: also where its KV could not reach engines on other nodes)."""
    first = tensors[0]
    if not first.is_cuda:
        raise DirectRefused(f"the KV cache is in {first.device.type} memory, not on a GPU")
    if any(t.device != first.device for t in tensors):
        raise DirectRefused(f"the KV tensors are on several devices ({sorted({str(t.device) for t in tensors})})")
    uuid = device_uuid(first)
    why = refused_by_agent(capabilities, uuid, across_nodes)
    if why:
        raise DirectRefused(why)
    with torch.cuda.device(first.device):
        by_ipc = [ipc_capable(t) for t in tensors]
    if not all(by_ipc) and "vmm_fd" not in (capabilities.get("gpu_sharing") or ()):
        raise DirectRefused(
            "the KV cache's memory cannot be shared by CUDA IPC handle (torch's expandable_segments, or another "
            "allocator than cudaMalloc), and the agent takes no VMM descriptors (its gpu_sharing lacks vmm_fd)"
        )
    # Events a KvReady or ExpectKv names only where the agent says it waits for them (one from
    # before them ignores them: decode then synchronizes before new receives).
    return DirectKv(tensors, layout, first.device, uuid, by_ipc=by_ipc, event=event,
                    events=event and takes_events(capabilities))


def _short(text: str) -> str:
    """``text`` cut to the 1024 bytes a registration's ``staging`` may hold."""
    return text.encode()[:1024].decode(errors="ignore")


def register(socket_path: str, reg: dict, tensors: Sequence[torch.Tensor], want: Optional[bool] = None
             ) -> Tuple[agent_client.AgentClient, Optional[DirectKv], Optional[str]]:
    """Registers one rank's KV with its agent: as a GPU pool of ``tensors`` themselves where the
    agent takes one (``want`` ``None``: where it can, its KV reaching other nodes too; ``True``:
    wherever the agent takes it, or fail saying why; ``False``: never), else ``reg`` (a host
    pool, which the engine stages through, told why). Returns the client, the direct pool
    (``None`` when staged) and why not direct (``None`` when direct)."""
    chosen: dict = {}
    options = {"event": True}
    # A host pool laid out as vLLM 0.33's KV cache where it is one (TorchStager).
    arranged = staging.staged_arrangement(tensors, reg["kv"])
    host = {"reg": dict(reg, kv_arrangement=arranged) if arranged else reg}

    def staged(why: str) -> dict:
        # The agent publishes why in the PDEndpoint (spec.staging); it keeps 300 characters.
        chosen["why"] = why
        return dict(host["reg"], staging=_short(why))

    def pick(caps: dict):
        if want is False:
            return staged("turned off (kv_connector_extra_config.direct: false)")
        try:
            host = PoolLayout.new(reg["kv"], reg["parallelism"].get("tensor", 1), reg["num_blocks"],
                                  reg.get("tensor_rank", 0))
            try:
                d = plan(tensors, host, caps, across_nodes=want is not True, event=options["event"])
                gpu, shared = d.gpu_pool()
            except (RuntimeError, OSError) as e:
                # CUDA itself refusing what the plan asks (torch's interprocess events or their
                # handles on a platform without CUDA IPC, a driver call): as a plan refused, not
                # the engine's start failed.
                raise DirectRefused(f"CUDA refused it: {e}") from None
            gpu_reg = dict(reg, regions=d.regions, gpu=gpu)
        except DirectRefused as e:
            if want is True:
                raise agent_client.AgentError(f"direct is true, but {e}") from None
            return staged(str(e))
        chosen["direct"] = d
        return (gpu_reg, shared) if shared else gpu_reg

    try:
        try:
            return _register(socket_path, host["reg"], pick, chosen, options, want)
        except agent_client.AgentUnreachable:
            raise
        except agent_client.AgentError as e:
            # An agent from before Interleaved pools (2026-12-06) refuses one, naming the field:
            # stage into K and V arrays instead, as the connector did then (slower against a
            # direct vLLM 0.33 engine; docs/install.md says to upgrade agents with connectors).
            if host["reg"] is reg or "kv_arrangement" not in str(e) or "Interleaved" not in str(e):
                raise
            log.warning("pdpair: the agent takes no Interleaved host pool (%s): staging into K and V arrays", e)
            host["reg"] = reg
            chosen.clear()
            return _register(socket_path, reg, pick, chosen, options, want)
    finally:
        restore_fds()  # the shared descriptors are closed by now


def _register(socket_path: str, reg: dict, pick: Callable, chosen: dict, options: dict, want: Optional[bool]
              ) -> Tuple[agent_client.AgentClient, Optional[DirectKv], Optional[str]]:
    """:func:`register`'s tries: direct, direct without the event, staged."""
    try:
        try:
            client = agent_client.AgentClient.register(socket_path, pick)
        except agent_client.AgentError as e:
            if "direct" not in chosen or not str(e).startswith(("gpu.event:", "gpu.events[")):
                raise
            # The agent took the KV memory but cannot open the engine's interprocess event (from
            # another PID namespace, say): direct without it, the engine synchronizing its stream
            # before each KvReady instead, on a new connection.
            log.warning("pdpair: the agent cannot open the engine's CUDA event (%s); synchronizing before KvReady", e)
            options["event"] = False
            chosen.clear()
            client = agent_client.AgentClient.register(socket_path, pick)
    except agent_client.AgentUnreachable:
        raise  # not serving (yet, or any more): tried again as it is, direct where it may be
    except agent_client.AgentError as e:
        if "direct" not in chosen or want is True:
            raise
        # The agent could not open the GPU pool (a CUDA IPC handle from another PID namespace,
        # say): stage instead, on a new connection.
        log.warning("pdpair: the agent refused the KV cache as a GPU pool (%s); staging through host memory", e)
        why = f"the agent refused the GPU pool: {e}"
        return agent_client.AgentClient.register(socket_path, dict(reg, staging=_short(why))), None, why
    return client, chosen.get("direct"), chosen.get("why")
