"""The direct path (``pdpair_vllm.direct``): vLLM-shaped KV tensors registered as the agent's GPU
pool. Here, without a GPU: which bytes a tensor's layout puts where (checked byte for byte against
the agent's layout on CPU tensors of the same shapes and strides), what is refused and why, and
that without a GPU every registration stages, saying why. The tests marked ``gpu`` move real CUDA
tensors between engines through real agents; ``make python-test`` leaves them out (``-m "not
gpu"``) and hack/gpu-check.sh runs them on a machine with a GPU and torch."""

from __future__ import annotations

import pytest
import torch

from pdpair_vllm import direct, synthetic
from pdpair_vllm.client import AgentClient, AgentError, registration
from pdpair_vllm.layout import PoolLayout
from pdpair_vllm.staging import TorchStager

from conftest import kv


def vllm_tensors(g: dict, num_blocks: int, shape: str, layers=None, device="cpu", dtype=torch.float16):
    """Per-layer KV tensors as vLLM allocates them: one flat byte allocation per layer, viewed in
    its physical order and permuted to the logical one (HND: heads before tokens in memory)."""
    bs, h, d = g.get("kernelBlockSize", g["blockSize"]), g["kvHeads"], g["headDim"]
    out = []
    for _ in range(layers or g["layers"]):
        if shape == "mla":
            physical, perm = (num_blocks, bs, d), (0, 1, 2)
        elif shape == "flash":  # [2, blocks, block, heads, dim]
            physical, perm = ((2, num_blocks, h, bs, d), (0, 1, 3, 2, 4)) if g["layout"] == "HND" else \
                ((2, num_blocks, bs, h, d), (0, 1, 2, 3, 4))
        else:  # flashinfer: [blocks, 2, block, heads, dim]
            physical, perm = ((num_blocks, 2, h, bs, d), (0, 1, 3, 2, 4)) if g["layout"] == "HND" else \
                ((num_blocks, 2, bs, h, d), (0, 1, 2, 3, 4))
        n = 1
        for x in physical:
            n *= x
        flat = torch.zeros(n * torch.tensor([], dtype=dtype).element_size(), dtype=torch.int8, device=device)
        out.append(flat.view(dtype).view(physical).permute(*perm))
    return out


def vllm033_tensors(g: dict, num_blocks: int, outer: str, device="cpu", dtype=torch.float16):
    """vLLM 0.33's per-layer ``[blocks, heads, tokens, K|V]`` views of one allocation, layers or
    blocks outermost, tokens inside heads in memory (HND) or outside (NHD)."""
    bs, h, d, n = g.get("kernelBlockSize", g["blockSize"]), g["kvHeads"], g["headDim"], g["layers"]
    inner = (h, bs, 2 * d) if g["layout"] == "HND" else (bs, h, 2 * d)
    physical = (n, num_blocks, *inner) if outer == "layers" else (num_blocks, n, *inner)
    alloc = torch.zeros(physical, dtype=dtype, device=device)
    views = [alloc[layer] if outer == "layers" else alloc[:, layer] for layer in range(n)]
    return [v if g["layout"] == "HND" else v.permute(0, 2, 1, 3) for v in views]


def raw(t: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` bytes of ``t``'s memory from its first element, in memory order."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))


def per_layer(g: dict, tensors, num_blocks: int) -> PoolLayout:
    host = PoolLayout.new(g, 1, num_blocks, 0)
    return PoolLayout.new(g, 1, num_blocks, 0, regions=direct.regions(tensors, host))


CASES = [
    ("flash", "NHD", False, "KvFirst"),
    ("flash", "HND", False, "KvFirst"),
    ("flashinfer", "NHD", False, "BlocksFirst"),
    ("flashinfer", "HND", False, "BlocksFirst"),
    ("mla", "NHD", True, "Latent"),
]


@pytest.mark.parametrize("shape,token_layout,mla,arrangement", CASES)
def test_each_layers_tensor_is_described_as_the_region_its_bytes_are(shape, token_layout, mla, arrangement):
    g = kv(block=4, heads=1 if mla else 3, layers=2, head_dim=8, layout=token_layout, mla=mla)
    tensors = vllm_tensors(g, 5, shape)
    for t in tensors:  # distinct bytes everywhere
        flat = raw(t, t.numel() * t.element_size())
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    layout = per_layer(g, tensors, 5)
    assert [r[2] for r in layout.regions] == [arrangement, arrangement]
    assert layout.region_lens == [t.numel() * t.element_size() for t in tensors]
    # Every token's K and V (or latent) where the agent's layout says, in the tensor's memory,
    # is what vLLM's logical indexing reads.
    regions = [raw(t, n) for t, n in zip(tensors, layout.region_lens)]
    half = layout.half_token
    checked = 0
    for (r, at), layer, head, token, v in layout.tokens(list(range(5)), 0, 5 * 4):
        block, j, t = token // 4, token % 4, tensors[layer]
        if shape == "mla":
            logical = t[block, j]
        elif shape == "flash":
            logical = t[int(v), block, j, head]
        else:
            logical = t[block, int(v), j, head]
        assert torch.equal(regions[r][at:at + half], logical.contiguous().view(torch.uint8)), (layer, head, token, v)
        checked += 1
    assert checked == 5 * 4 * 2 * (1 if mla else 3 * 2)


def test_tensors_whose_bytes_are_not_the_agents_layout_are_refused_naming_what_differs():
    g = kv(block=4, heads=2, layers=1, head_dim=8, layout="NHD")
    host = PoolLayout.new(g, 1, 6, 0)
    # Blocks with a gap between the K array and the V array (a slice of a larger cache).
    gapped = vllm_tensors(g, 7, "flash")[0][:, :6]
    with pytest.raises(direct.DirectRefused, match="back to back as KvFirst"):
        direct.arrangement_of(gapped, host)
    # HND memory declared NHD.
    with pytest.raises(direct.DirectRefused, match="not a dense NHD block"):
        direct.arrangement_of(vllm_tensors(dict(g, layout="HND"), 6, "flash")[0], host)
    # A cache of another size, another head count.
    with pytest.raises(direct.DirectRefused, match="neither"):
        direct.arrangement_of(vllm_tensors(g, 5, "flash")[0], host)
    with pytest.raises(direct.DirectRefused, match=r"\(4, 3, 8\); the geometry's is \(4, 2, 8\)"):
        direct.arrangement_of(vllm_tensors(dict(g, kvHeads=3), 6, "flash")[0], host)
    # One layer's tensor for a two-layer geometry.
    with pytest.raises(direct.DirectRefused, match="1 KV tensors for 2 layers"):
        direct.regions(vllm_tensors(g, 6, "flash"), PoolLayout.new(dict(g, layers=2), 1, 6, 0))
    # vLLM 0.33's [blocks, heads, tokens, K|V] of the wrong token layout, or another head count.
    with pytest.raises(direct.DirectRefused, match="not a dense NHD block of each head's token's K then V"):
        direct.arrangement_of(vllm033_tensors(dict(g, layout="HND"), 6, "layers")[0], host)
    with pytest.raises(direct.DirectRefused, match=r"\(tokens, heads, K\|V\) = \(4, 3, 16\); the geometry's is \(4, 2, 16\)"):
        direct.arrangement_of(vllm033_tensors(dict(g, kvHeads=3), 6, "layers")[0], host)
    # Layers that are not one allocation a stride apart.
    two = dict(g, layers=2)
    apart = [vllm033_tensors(g, 6, "layers")[0], vllm033_tensors(g, 6, "layers")[0]]
    with pytest.raises(direct.DirectRefused, match="one stride apart|views of 2 allocations"):
        direct.regions(apart, PoolLayout.new(two, 1, 6, 0))
    backwards = list(reversed(vllm033_tensors(two, 6, "blocks")))
    with pytest.raises(direct.DirectRefused, match="one stride apart in layer order"):
        direct.regions(backwards, PoolLayout.new(two, 1, 6, 0))
    # The layout that fits is taken.
    assert direct.arrangement_of(vllm_tensors(g, 6, "flash")[0], host) == "KvFirst"


@pytest.mark.parametrize("outer", ["layers", "blocks"])
@pytest.mark.parametrize("token_layout", ["HND", "NHD"])
def test_vllm_033s_one_allocation_is_one_region_of_k_and_v_side_by_side(outer, token_layout):
    g = kv(block=4, heads=3, layers=3, head_dim=8, layout=token_layout)
    tensors = vllm033_tensors(g, 5, outer)
    alloc = raw(tensors[0], tensors[0].untyped_storage().nbytes())
    alloc.copy_(torch.randint(0, 256, alloc.shape, dtype=torch.uint8))  # distinct bytes everywhere
    host = PoolLayout.new(g, 1, 5, 0)
    (region,) = direct.regions(tensors, host)
    chunk = 2 * host.block_len
    strides = (chunk, 3 * chunk) if outer == "blocks" else (5 * chunk, chunk)
    assert (region["kv_arrangement"], region["layer_stride"], region["block_stride"]) == ("Interleaved", *strides)
    layout = PoolLayout.new(g, 1, 5, 0, regions=[region])
    assert layout.region_lens == [tensors[0].untyped_storage().nbytes()], "the whole allocation"
    # Every token's K and V where the agent's layout says is what vLLM's logical indexing reads.
    memory, half, checked = raw(tensors[0], layout.region_lens[0]), layout.half_token, 0
    for (r, at), layer, head, token, v in layout.tokens(list(range(5)), 0, 5 * 4):
        block, j = token // 4, token % 4
        logical = tensors[layer][block, head, j, int(v) * 8:(int(v) + 1) * 8]
        assert torch.equal(memory[at:at + half], logical.contiguous().view(torch.uint8)), (layer, head, token, v)
        checked += 1
    assert checked == 5 * 4 * 3 * 3 * 2


def test_the_agents_capabilities_decide_whether_it_takes_a_gpu_pool():
    uuid = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
    none = {"pool_memory": ["host"], "gpus": [], "gpu_pools_refused": "this agent has no CUDA driver"}
    assert "this agent has no CUDA driver" in direct.refused_by_agent(none, uuid)
    other = {"pool_memory": ["host", "cuda"], "gpus": [{"uuid": "GPU-ffffffff-0000-1111-2222-333344445555"}],
             "gpu_between_agents": True}
    assert f"on GPU {uuid}, which the agent's CUDA driver does not show" in direct.refused_by_agent(other, uuid)
    # UUIDs compare whatever their spelling (torch prints them without GPU- and dashes).
    same = {"pool_memory": ["host", "cuda"], "gpus": [{"uuid": "0A1B2C3D000011112222333344445555"}],
            "gpu_between_agents": True}
    assert direct.refused_by_agent(same, uuid) is None
    # An agent on UCX (RDMA) takes GPU pools, but they would not reach other nodes: staged, unless
    # the engine asks for the direct path anyway (a pair on one node).
    rdma = dict(same, gpu_between_agents=False)
    assert "over UCX (RDMA), which carries host memory only" in direct.refused_by_agent(rdma, uuid)
    assert direct.refused_by_agent(rdma, uuid, across_nodes=False) is None
    # Tensors in host memory never take it.
    g = kv(block=4, layers=1)
    with pytest.raises(direct.DirectRefused, match="in cpu memory, not on a GPU"):
        direct.plan(vllm_tensors(g, 2, "flash"), PoolLayout.new(g, 1, 2, 0), same)


def test_tensors_in_vmm_memory_are_placed_in_their_allocations_laid_end_to_end():
    # The driver's answers (which mapped allocation holds an address) come from a table here, as
    # torch's expandable segments lay them out: 2 MiB allocations mapped back to back in one
    # segment at 0x1000_0000, and a second segment far above it.
    mb = 2 << 20
    table = [(0x1000_0000 + i * mb, mb) for i in range(6)] + [(0x9000_0000 + i * mb, mb) for i in range(3)]

    def address_range(p):
        for base, size in table:
            if base <= p < base + size:
                return base, size
        raise AssertionError(f"{p:#x} is not mapped")

    # Three tensors of 3 MiB: from 4 KiB into the first segment (allocations 0 and 1), from 1 MiB
    # into the second (its 0 and 1), and from 4 KiB into the first segment's allocation 1 (1 and 2,
    # sharing one with the first tensor).
    starts = [0x1000_1000, 0x9000_0000 + mb // 2, 0x1000_0000 + mb + 0x1000]
    chunks, offsets = direct.vmm_plan(starts, 3 << 20, address_range)
    assert chunks == [table[0], table[1], table[2], table[6], table[7]], "each allocation once, in address order"
    # Laid end to end: [s1 a0][s1 a1][s1 a2][s2 a0][s2 a1].
    assert offsets == [0x1000, 3 * mb + mb // 2, mb + 0x1000]
    # Each tensor's bytes are, in the end-to-end layout, the bytes it has in the engine.
    for start, off in zip(starts, offsets):
        i = 0
        while off >= chunks[i][1]:
            off -= chunks[i][1]
            i += 1
        assert chunks[i][0] + off == start
    # Answers that do not fit are refused, naming them.
    with pytest.raises(direct.DirectRefused, match="places address 0x10001000 in 0 bytes"):
        direct.vmm_plan([0x1000_1000], 10, lambda p: (0x1000_0000, 0))
    with pytest.raises(direct.DirectRefused, match="overlap"):
        direct.vmm_plan([0x1000, 0x2000], 16, lambda p: (p - 0x800, 0x1000) if p == 0x2000 else (0x1000, 0x1000))
    with pytest.raises(direct.DirectRefused, match="the agent maps at most 8192"):
        direct.vmm_plan([0], 8193 * 4096, lambda p: (p - p % 4096, 4096))


def test_vmm_allocations_not_exportable_as_descriptors_are_refused_naming_their_handle_types():
    # What cuMemGetAllocationPropertiesFromHandle reports decides it (read on a GPU; the values
    # here are cuda.h's CUmemAllocationHandleType bits): without the POSIX-descriptor bit the
    # export would fail with a bare CUDA error, so the connector stages, saying why.
    import ctypes

    prop = direct._AllocationProp
    assert ctypes.sizeof(prop) == 32, "CUmemAllocationProp is 32 bytes in cuda.h"
    assert (prop.requestedHandleTypes.offset, prop.location_type.offset, prop.win32HandleMetaData.offset,
            prop.usage.offset) == (4, 8, 16, 26), "its fields where cuda.h has them"
    for types in (0x1, 0x1 | 0x2, 0x1 | 0x8):  # POSIX fd alone, with Win32, with fabric
        direct.exportable_as_fd(types, 0x7F00_0000_0000)
    for types in (0x0, 0x8, 0x2):  # none (torch before 2.5), fabric only, Win32 only
        with pytest.raises(direct.DirectRefused, match=f"at 0x7f0000000000 .* handle types are {types:#x}"):
            direct.exportable_as_fd(types, 0x7F00_0000_0000)


def test_exporting_thousands_of_allocations_makes_room_for_their_descriptors_or_says_why_not():
    # Every VMM allocation is exported before any is sent: a large cache in 20 MiB allocations
    # holds thousands of descriptors at once, past the usual soft limit. In child processes,
    # whose limits can be lowered without touching this one's.
    import subprocess
    import sys

    probe = """
import os, resource, sys
from pdpair_vllm import direct
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
try:
    direct.room_for_fds(int(sys.argv[3]))
except direct.DirectRefused as e:
    print("refused:", e)
# Opening as many descriptors as were asked for works now.
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(int(sys.argv[3]))]
print("opened", len(fds), "soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
direct.restore_fds()  # still open: kept raised
print("while open", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
for fd in fds:
    os.close(fd)
direct.restore_fds()
print("after", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
    import resource

    run = lambda *a: subprocess.run([sys.executable, "-c", probe, *map(str, a)], capture_output=True, text=True,
                                    timeout=60)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 3600:
        pytest.skip(f"this machine's hard open-file limit is {hard}, below what the test opens")
    done = run(256, 3600, 3000)
    assert done.returncode == 0 and "opened 3000" in done.stdout and "refused" not in done.stdout, done
    # Put back once the descriptors are closed (code using select() breaks past 1024), not before.
    assert "while open 3" in done.stdout and "after 256" in done.stdout, done.stdout
    # A hard limit too low: refused before anything is exported, naming the limit.
    low = run(64, 512, 3000)
    assert "refused: sharing the KV cache takes 3000 file descriptors at once" in low.stdout, low
    assert "open-file limit is 512" in low.stdout, low


class _Driver:
    """The CUDA driver's answers about contexts, from a table (the driver itself needs a GPU)."""

    def __init__(self, current_ctx: int, current_device: int):
        self.current_ctx, self.current_device, self.set_to = current_ctx, current_device, None

    def cuCtxGetCurrent(self, out):
        out._obj.value = self.current_ctx
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0

    def cuCtxGetDevice(self, out):
        out._obj.value = self.current_device
        return 0

    def cuDevicePrimaryCtxRetain(self, out, dev):
        out._obj.value = 0x5000 + dev.value
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.set_to = ctx.value
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, dev):
        return 0


def test_driver_calls_run_in_a_context_of_the_kv_caches_device_or_are_refused():
    # No context current: the device's primary one is made current.
    d = _Driver(0, 0)
    direct._ensure_context(d, 1)
    assert d.set_to == 0x5001
    # The device's own context current: kept.
    d = _Driver(0x7000, 1)
    direct._ensure_context(d, 1)
    assert d.set_to is None
    # Another device's: refused (its answers would be about the wrong GPU's memory).
    with pytest.raises(direct.DirectRefused, match="context is device 0's, the KV cache is on 1"):
        direct._ensure_context(_Driver(0x7000, 0), 1)


def test_events_are_registered_only_with_an_agent_that_says_it_waits_for_them(world):
    # An agent from before gpu.events ignores them and the event an ExpectKv names: decode
    # skipping its synchronize for them would let the agent write blocks kernels still touch.
    g = kv(block=16, layers=2)
    c = AgentClient.register(world.agent("a").socket, reg(world, "decode", g, 4))
    caps = c.capabilities
    c.close()
    assert caps.get("gpu_events") is True and direct.takes_events(caps)
    older = {k: v for k, v in caps.items() if k != "gpu_events"}
    assert not direct.takes_events(older)
    assert not direct.takes_events(dict(caps, gpu_events="yes"))


def test_decode_waits_for_every_kernel_on_its_device_before_new_receives(monkeypatch):
    # Without events (an agent that cannot open them): the engine's thread synchronizes the
    # device. With them: the next one is recorded on the current stream and named, in turn, and
    # nothing waits here (the agent lets nothing write the blocks before it passed). The CUDA
    # half stands in (no GPU here): its events and stream are recorded, not run.
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))
    kv_ = direct.DirectKv.__new__(direct.DirectKv)
    kv_.device = torch.device("cuda", 3)
    kv_.events, kv_.last = [], None
    assert kv_.before_receive() is None
    assert synced == [torch.device("cuda", 3)]

    class Event:
        def __init__(self):
            self.on = []

        def record(self, stream):
            self.on.append(stream)

    kv_.events = [Event() for _ in range(3)]
    assert [kv_.before_receive() for _ in range(4)] == [0, 1, 2, 0]
    assert synced == [torch.device("cuda", 3)], "nothing more synchronized"
    assert [len(e.on) for e in kv_.events] == [2, 1, 1]
    assert kv_.events[0].on[0] == ("stream", torch.device("cuda", 3))


def test_prefill_in_place_records_one_event_for_a_steps_requests(monkeypatch):
    # The events are a ring of 16 and a query answers for an event's latest record: one record
    # per request went round the ring each step once 16 requests finished in one. One record
    # after the step's writes (and its one older event) names all of them; without events, one
    # synchronize. The CUDA half stands in (no GPU here).
    synced = []

    class Stream:
        def synchronize(self):
            synced.append("stream")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())

    class Event:
        def __init__(self):
            self.on = 0

        def record(self, stream):
            self.on += 1

    kv_ = direct.DirectKv.__new__(direct.DirectKv)
    kv_.device = torch.device("cuda", 0)
    kv_.event, kv_.events, kv_.last = Event(), [Event() for _ in range(16)], None
    assert kv_.save_all([[i] for i in range(20)]) == 0
    assert kv_.save_all([[i] for i in range(20)]) == 1
    assert [e.on for e in kv_.events[:3]] == [1, 1, 0] and kv_.event.on == 2
    kv_.event, kv_.events = None, []
    assert kv_.save_all([[i] for i in range(20)]) is None
    assert synced == ["stream"]


def test_gpu_memory_shared_as_descriptors_reaches_the_agent_before_the_registration(world):
    # The client's half of ShareGpuMemory against a real agent (no GPU here): descriptors go in
    # frames of at most 128 before the registration, the agent checks them all before it refuses
    # the GPU pool for want of a driver, and the client closes them once sent.
    import os

    g = kv(block=16, layers=2)
    agent = world.agent("a")
    fds = [os.memfd_create("vmm") for _ in range(130)]
    gpu = {"device_uuid": "GPU-0a1b2c3d-0000-1111-2222-333344445555", "regions": [{"offset": 0}, {"offset": 4096}]}
    r = reg(world, "prefill", g, 4, gpu=gpu, regions=[{"layers": 1, "kv_arrangement": "KvFirst"}] * 2)
    with pytest.raises(AgentError, match="gpu: GPU pools are not accepted"):
        AgentClient.register(agent.socket, lambda caps: (r, [(fd, 2 << 20) for fd in fds]))
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    # Shared memory and a registration that names none of it: refused naming both.
    all_ipc = dict(gpu, regions=[{"ipc_handle": "ab" * 64, "offset": 0}] * 2)
    r = reg(world, "prefill", g, 4, gpu=all_ipc, regions=[{"layers": 1, "kv_arrangement": "KvFirst"}] * 2)
    with pytest.raises(AgentError, match="every gpu.regions entry names an ipc_handle"):
        AgentClient.register(agent.socket, lambda caps: (r, [(os.memfd_create("vmm"), 2 << 20)]))


def reg(world, role: str, g: dict, num_blocks: int, **kw) -> dict:
    return registration(pdpair="default/pair", role=role, engine=f"direct-{role}", kv=g, num_blocks=num_blocks,
                        pairing_key=world.key, mode="Push", checksum="FailClosed", handshake_timeout_ms=5000,
                        lease_ms=30000, **kw)


def test_without_a_gpu_the_registration_stages_saying_why_and_a_gpu_pool_is_refused_by_the_agent(world):
    g = kv(block=16, layers=2)
    agent = world.agent("a")
    tensors = vllm_tensors(g, 4, "flash")
    client, pool, why = direct.register(agent.socket, reg(world, "prefill", g, 4), tensors)
    try:
        assert pool is None and "in cpu memory" in why
        assert client.pool is not None and client.layout.region_lens == [2 * 2 * 4 * client.layout.block_len]
        assert client.registration["staging"] == why, "the agent is told why (the PDEndpoint shows it)"
    finally:
        client.close()
    with pytest.raises(AgentError, match="direct is true, but the KV cache is in cpu memory"):
        direct.register(agent.socket, reg(world, "prefill", g, 4), tensors, want=True)
    client, pool, why = direct.register(agent.socket, reg(world, "prefill", g, 4), tensors, want=False)
    client.close()
    assert pool is None and "turned off" in why
    # A GPU pool sent anyway is refused by this agent (no CUDA driver here), naming why.
    gpu = {"device_uuid": "GPU-0a1b2c3d-0000-1111-2222-333344445555",
           "regions": [{"ipc_handle": "00" * 64, "offset": 0}] * 2}
    with pytest.raises(AgentError, match="gpu: GPU pools are not accepted"):
        AgentClient.register(agent.socket, reg(world, "prefill", g, 4, gpu=gpu,
                                               regions=[{"layers": 1, "kv_arrangement": "KvFirst"}] * 2))


def test_vllm_033_tensors_stage_side_by_side_and_into_k_and_v_arrays_for_an_agent_without_that(world, monkeypatch, caplog):
    # vLLM 0.33's tensors stage into an Interleaved host pool; an MLA cache's (one head, its
    # latent vector: 4-D too in vLLM 0.33) and an older vLLM's into Latent and KvFirst ones.
    from pdpair_vllm import staging

    g = kv(block=16, heads=8, layers=2, head_dim=128, layout="HND", dtype="bfloat16")
    tensors = vllm033_tensors(g, 4, "layers", dtype=torch.bfloat16)
    assert staging.staged_arrangement(tensors, g) == "Interleaved"
    assert staging.staged_arrangement([torch.zeros(4, 1, 16, 576)], dict(g, mla=True)) is None
    assert staging.staged_arrangement(vllm_tensors(g, 4, "flash"), g) is None
    # An agent from before Interleaved pools refuses one, naming the field: the connector stages
    # into K and V arrays instead of failing the engine's start.
    agent = world.agent("a")
    real = AgentClient.register

    def before_interleaved(socket_path, registration):
        def refuse(caps):
            r = registration(caps) if callable(registration) else registration
            body = r[0] if isinstance(r, tuple) else r
            said = [body.get("kv_arrangement")] + [x.get("kv_arrangement") for x in body.get("regions") or []]
            if "Interleaved" in said:
                raise AgentError("kv_arrangement: unknown variant `Interleaved`, expected one of `KvFirst`, "
                                 "`BlocksFirst`, `Latent`")
            return r
        return real(socket_path, refuse)

    client, pool, why = direct.register(agent.socket, reg(world, "decode", g, 4), tensors)
    assert (pool, client.layout.arrangement) == (None, "Interleaved") and "in cpu memory" in why
    client.close()
    monkeypatch.setattr(AgentClient, "register", staticmethod(before_interleaved))
    client, pool, why = direct.register(agent.socket, reg(world, "decode", g, 4), tensors)
    try:
        assert (pool, client.layout.arrangement) == (None, "KvFirst") and "in cpu memory" in why
        assert "takes no Interleaved host pool" in caplog.text
        stager = TorchStager(tensors, client.pool, client.layout)
        stager.save([1, 2])
    finally:
        client.close()
    # Any other refusal still fails the start.
    monkeypatch.setattr(AgentClient, "register", staticmethod(
        lambda path, registration: (_ for _ in ()).throw(AgentError("pairing_key: too short"))))
    with pytest.raises(AgentError, match="pairing_key"):
        direct.register(agent.socket, reg(world, "decode", g, 4), tensors)


# ---- on a GPU (hack/gpu-check.sh) ------------------------------------------------------------------


def gpu_engine(world, agent, role: str, g: dict, num_blocks: int, shape: str):
    if shape.startswith("v033-"):  # vLLM 0.33's one allocation, layers or blocks outermost
        tensors = vllm033_tensors(g, num_blocks, shape[5:], device="cuda", dtype=torch.bfloat16)
    else:
        tensors = vllm_tensors(g, num_blocks, shape, device="cuda", dtype=torch.bfloat16)
    client, pool, why = direct.register(agent.socket, reg(world, role, g, num_blocks), tensors, want=True)
    assert pool is not None and why is None
    assert client.pool is None  # nothing mapped: the tensors are the pool
    return client, pool


def fill_gpu(p, p_kv, seed: int, blocks, tokens: int) -> None:
    """Writes the synthetic pattern into prefill's CUDA tensors (on the current stream, as a
    forward pass would: the event recorded after it covers it)."""
    host = [bytearray(n) for n in p.layout.region_lens]
    synthetic.fill(host, p.layout, seed, blocks, 0, tokens)
    for t, h, n in zip(p_kv.tensors, host, p.layout.region_lens):
        raw(t, n).copy_(torch.frombuffer(h, dtype=torch.uint8))


def bad_tokens_on_gpu(d, d_kv, seed: int, blocks, tokens: int) -> int:
    """Decode's CUDA tensors read back to the host: the tokens whose bytes are not the pattern."""
    got = []
    for t, n in zip(d_kv.tensors, d.layout.region_lens):
        host = bytearray(n)  # without numpy, which a GPU machine's python may lack
        torch.frombuffer(host, dtype=torch.uint8).copy_(raw(t, n))
        got.append(host)
    return synthetic.verify(got, d.layout, seed, blocks, 0, tokens)


def direct_to_direct(p, p_kv, d, d_kv, request: str, seed: int) -> None:
    """One request from prefill's CUDA tensors into decode's, both direct: checksums Verified and
    every byte read back from decode's GPU; both engines then closed."""
    blocks, d_blocks, tokens = [3, 4, 5, 9, 10], [200, 2, 201, 202, 40], 75
    fill_gpu(p, p_kv, seed, blocks, tokens)
    # The event after the writes, named in the KvReady (or a synchronize without events).
    p.kv_ready(request, blocks, tokens, event=p_kv.save(blocks))
    d.expect_kv(request, [p.address], d_blocks, tokens)
    event = d.wait(request, timeout=60)
    assert event.type == "RequestDone" and event.raw.get("checksum") == "Verified", event.raw
    assert bad_tokens_on_gpu(d, d_kv, seed, d_blocks, tokens) == 0
    assert p.wait(request).type == "RequestDone"
    p.close()
    d.close()


@pytest.mark.gpu
@pytest.mark.parametrize("agents,p_shape,d_shape,token_layout", [
    (agents, p, d, layout) for agents in ("one", "two") for p, d, layout in (("flash", "flash", "HND"), ("flash", "flashinfer", "NHD"))
] + [
    # vLLM 0.33's K and V side by side, as one region: blocks outermost into the same through one
    # agent (CUDA IPC, a block's layers one copy), layers outermost into K and V arrays through
    # two (their KV streams).
    ("one", "v033-blocks", "v033-blocks", "HND"), ("two", "v033-layers", "flash", "NHD"),
])
def test_vllm_shaped_gpu_kv_moves_between_engines_without_host_staging(world, agents, p_shape, d_shape, token_layout):
    # One agent: both engines on its node, the agent copies GPU to GPU (CudaIpc). Two agents over
    # their KV streams (StagedStream). Every byte checked on the host after the move.
    g = kv(block=16, heads=8, layers=4, head_dim=128, layout=token_layout, dtype="bfloat16")
    pa = world.agent("p", "tcp")
    da = pa if agents == "one" else world.agent("d", "tcp")
    # 16 MiB per layer: each its own allocation in torch's caching allocator (as vLLM's, of GBs),
    # so the two engines in this one process share none (smaller ones would, split from one).
    p, p_kv = gpu_engine(world, pa, "prefill", g, 256, p_shape)
    d, d_kv = gpu_engine(world, da, "decode", g, 256, d_shape)
    direct_to_direct(p, p_kv, d, d_kv, "g1", 7)


def staged_v033_engine(world, agent, role: str, g: dict, num_blocks: int, outer: str, device: str):
    """A vLLM 0.33 engine whose connector stages (``direct: false``): its KV tensors, one
    allocation on ``device`` with layers or blocks outermost, copied to and from a host pool laid
    out as they lie (``Interleaved``)."""
    tensors = vllm033_tensors(g, num_blocks, outer, device=device, dtype=torch.bfloat16)
    client, pool, why = direct.register(agent.socket, reg(world, role, g, num_blocks), tensors, want=False)
    assert pool is None and "turned off" in why, why
    assert client.layout.arrangement == "Interleaved", client.layout.regions
    stager = TorchStager(tensors, client.pool, client.layout)
    assert device == "cuda" or not stager.pinned, "nothing to page-lock for on a CPU"
    return client, stager


def round_trip(client, stager, blocks) -> None:
    """The blocks from the host pool into the KV tensors, the pool's copy wiped, and back: what
    the pool holds after is what the tensors held."""
    stager.load(blocks)
    stager.pool.zero_()
    stager.save(blocks)


@pytest.mark.parametrize("device,agents,direct_side,outer,token_layout", [
    pytest.param("cuda", "one", "prefill", "layers", "HND", marks=pytest.mark.gpu),
    pytest.param("cuda", "two", "decode", "blocks", "NHD", marks=pytest.mark.gpu),
    ("cpu", "one", None, "layers", "HND"),
    ("cpu", "two", None, "blocks", "NHD"),
])
def test_a_staged_vllm_033_engine_moves_kv_byte_exact_with_a_direct_one_or_a_staged_one(
        world, device, agents, direct_side, outer, token_layout):
    # vLLM 0.33's KV tensors staged through a host pool laid out as they lie: on a GPU beside a
    # direct engine of vLLM 0.33 (one agent: CUDA IPC and the agent's stream; two: their KV
    # streams), here beside another staged one. Each staged side's tensors go through its
    # staging copies both ways; every byte checked.
    g = kv(block=16, heads=8, layers=4, head_dim=128, layout=token_layout, dtype="bfloat16")
    pa = world.agent("p", "tcp")
    da = pa if agents == "one" else world.agent("d", "tcp")
    blocks, d_blocks, tokens = [3, 4, 5, 9, 10], [200, 2, 201, 202, 40], 75
    if direct_side == "prefill":
        p, p_kv = gpu_engine(world, pa, "prefill", g, 256, f"v033-{outer}")
        fill_gpu(p, p_kv, 9, blocks, tokens)
        named = p_kv.save(blocks)
    else:
        p, p_kv = staged_v033_engine(world, pa, "prefill", g, 256, outer, device)
        synthetic.fill(p.pool, p.layout, 9, blocks, 0, tokens)
        round_trip(p, p_kv, blocks)
        named = None
    if direct_side == "decode":
        d, d_kv = gpu_engine(world, da, "decode", g, 256, f"v033-{outer}")
    else:
        d, d_kv = staged_v033_engine(world, da, "decode", g, 256, outer, device)
    p.kv_ready("s1", blocks, tokens, event=named)
    d.expect_kv("s1", [p.address], d_blocks, tokens)
    event = d.wait("s1", timeout=60)
    assert event.type == "RequestDone" and event.raw.get("checksum") == "Verified", event.raw
    if direct_side == "decode":
        assert bad_tokens_on_gpu(d, d_kv, 9, d_blocks, tokens) == 0
    else:
        round_trip(d, d_kv, d_blocks)
        assert synthetic.verify(d.pool, d.layout, 9, d_blocks, 0, tokens) == 0
    assert p.wait("s1").type == "RequestDone"
    p.close()
    d.close()


class StandInPlan:
    """A direct plan's GPU half, standing in (no GPU here): two regions of one layer, and a GPU
    pool of two IPC handles no agent here can open."""

    regions = [{"layers": 1, "kv_arrangement": "KvFirst"}] * 2

    def gpu_pool(self):
        return {"device_uuid": "GPU-0a1b2c3d-0000-1111-2222-333344445555",
                "regions": [{"ipc_handle": "11" * 64, "offset": 0}] * 2}, []


def test_a_gpu_pool_the_agent_cannot_open_falls_back_to_staging_on_a_new_connection(world, monkeypatch):
    # The GPU half stands in (no GPU here): a plan whose GPU pool this agent refuses, as an agent
    # refuses a CUDA IPC handle it cannot open (another PID namespace). The registration then
    # stages through a host pool, saying why, unless direct was required.
    monkeypatch.setattr(direct, "plan", lambda tensors, layout, caps, across_nodes=True, event=True: StandInPlan())
    g = kv(block=16, layers=2)
    agent = world.agent("a")
    tensors = vllm_tensors(g, 4, "flash")
    client, pool, why = direct.register(agent.socket, reg(world, "prefill", g, 4), tensors)
    try:
        assert pool is None and why.startswith("the agent refused the GPU pool: gpu: GPU pools are not accepted"), why
        assert client.pool is not None and "gpu" not in client.registration
        assert client.registration["staging"] == why
    finally:
        client.close()
    with pytest.raises(AgentError, match="gpu: GPU pools are not accepted"):
        direct.register(agent.socket, reg(world, "prefill", g, 4), tensors, want=True)


def test_cuda_refusing_the_direct_plan_stages_instead_of_failing_the_engines_start(world, monkeypatch):
    # torch raises RuntimeError where CUDA refuses an interprocess event or its handle (a
    # platform without CUDA IPC), before any memory is shared: it went up through the
    # registration and failed the engine's start instead of staging (from a review).
    class EventsRefused(StandInPlan):
        def gpu_pool(self):
            raise RuntimeError("CUDA error: operation not supported")

    monkeypatch.setattr(direct, "plan", lambda tensors, layout, caps, across_nodes=True, event=True: EventsRefused())
    g = kv(block=16, layers=2)
    agent = world.agent("a")
    tensors = vllm_tensors(g, 4, "flash")
    client, pool, why = direct.register(agent.socket, reg(world, "prefill", g, 4), tensors)
    try:
        assert pool is None and "CUDA refused it: CUDA error: operation not supported" in why, why
        assert client.pool is not None and "gpu" not in client.registration
    finally:
        client.close()
    with pytest.raises(AgentError, match="direct is true, but CUDA refused it"):
        direct.register(agent.socket, reg(world, "prefill", g, 4), tensors, want=True)


def test_an_agent_that_closes_during_a_direct_registration_is_tried_again_not_staged(world, monkeypatch, tmp_path):
    # An agent shutting down answers Capabilities, then closes the connection instead of
    # answering the GPU pool's registration: not a refusal of the GPU pool, so the engine does
    # not give up the direct path for good (staging through a host pool as large as its KV
    # cache); it is unreachable for now, and registers (direct) once the agent serves.
    import socket
    import threading

    from pdpair_vllm import wire
    from pdpair_vllm.client import AgentUnreachable

    monkeypatch.setattr(direct, "plan", lambda tensors, layout, caps, across_nodes=True, event=True: StandInPlan())
    path = str(tmp_path / "closing.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    connections = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(conn)
            with conn:
                wire.recv_with_fds(conn)  # Capabilities
                wire.send(conn, {"type": "Capabilities", "api_version": 5, "gpu_sharing": ["ipc_handle"]})
                wire.recv_with_fds(conn)  # the registration: closed unanswered

    threading.Thread(target=serve, daemon=True).start()
    g = kv(block=16, layers=2)
    try:
        with pytest.raises(AgentUnreachable, match="registering with the agent"):
            direct.register(path, reg(world, "prefill", g, 4), vllm_tensors(g, 4, "flash"))
        assert len(connections) == 1, "no second, staged registration"
    finally:
        listener.close()


def test_an_agent_whose_backlog_is_full_is_unreachable_for_now_not_refusing(world, tmp_path):
    # A Unix socket whose backlog is full refuses a connect with EAGAIN (an agent swamped or
    # stuck): that raised AgentError, which fails the engine's start, where an agent not
    # serving yet lets it start and register once it answers.
    import socket

    from pdpair_vllm.client import AgentUnreachable

    path = str(tmp_path / "full.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)  # never accepted
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        held.connect(path)  # fills the backlog
        g = kv(block=16, layers=2)
        with pytest.raises(AgentUnreachable, match="connecting to the agent"):
            AgentClient.register(path, reg(world, "prefill", g, 4))
    finally:
        held.close()
        listener.close()


def test_an_agent_holding_all_the_gpu_memory_it_takes_at_once_is_tried_again_not_staged(world, monkeypatch):
    # Other engines' registrations in progress hold every GPU memory descriptor the agent takes at
    # once (16384; torch's expandable segments export thousands per rank). The agent says it is
    # busy and the engine registers again later, direct where it may, rather than take it as the
    # agent refusing its GPU pool and stage through host memory for good (as it did).
    import os
    import socket
    import time

    from pdpair_vllm import wire
    from pdpair_vllm.client import AgentBusy, AgentUnreachable

    class SharingPlan(StandInPlan):
        def gpu_pool(self):
            gpu, _ = super().gpu_pool()
            return gpu, [(os.memfd_create("vmm"), 2 << 20)]

    monkeypatch.setattr(direct, "plan", lambda tensors, layout, caps, across_nodes=True, event=True: SharingPlan())
    g = kv(block=16, layers=2)
    agent = world.agent("a")
    tensors = vllm_tensors(g, 4, "flash")

    def register_until(busy: bool):
        deadline = time.monotonic() + 20
        while True:
            try:
                client, pool, why = direct.register(agent.socket, reg(world, "prefill", g, 4), tensors)
            except AgentBusy as e:
                if busy:
                    return e
                assert time.monotonic() < deadline, f"still busy: {e}"
            else:
                client.close()
                assert "registrations in progress" not in why, f"a busy agent taken as refusing the GPU pool: {why}"
                if not busy:
                    return why
                assert time.monotonic() < deadline, f"never busy: {why}"
            time.sleep(0.1)

    holders = []
    try:
        for _ in range(2):  # 8192 each, as many as one registration shares
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(agent.socket)
            holders.append(s)
            for _ in range(8192 // wire.MAX_FDS):
                fds = [os.memfd_create("held") for _ in range(wire.MAX_FDS)]
                try:
                    wire.send(s, {"type": "ShareGpuMemory", "sizes": [2 << 20] * len(fds)}, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        # Counted as the agent reads them: busy once it holds them all.
        e = register_until(busy=True)
        assert isinstance(e, AgentUnreachable) and "GPU memory descriptors of registrations in progress" in str(e)
    finally:
        for s in holders:
            s.close()
    # They went: the engine's GPU pool reaches the agent again (which, with no CUDA driver here,
    # refuses the stand-in's handles, so it stages saying that).
    why = register_until(busy=False)
    assert why.startswith("the agent refused the GPU pool: ") and "ipc_handle" in why, why


@pytest.mark.parametrize("field", ["event", "events"])
def test_an_engine_event_the_agent_cannot_open_is_dropped_before_the_direct_path_is(world, monkeypatch, field):
    # The GPU half stands in (no GPU here): a plan whose event the agent refuses ("gpu.event:",
    # or "gpu.events[1]:" for the ones a KvReady names, as an agent refuses an interprocess event
    # it cannot open from another PID namespace). The
    # connector registers its memory again without the event (synchronizing its stream before
    # KvReady instead) before it gives up the direct path; here the agent then refuses GPU pools
    # for want of a driver, so the engine stages, saying so.
    asked = []

    class NoEvent(StandInPlan):
        def __init__(self, event):
            self.event = event

        def gpu_pool(self):
            pool, _ = super().gpu_pool()
            if self.event and field == "event":
                pool["event"] = "00"  # not a handle: refused as "gpu.event: ..."
            if self.event and field == "events":
                # Sent with a good "event", as the connector sends them: refused as "gpu.events[1]: ...".
                pool["event"] = "33" * 64
                pool["events"] = ["22" * 64, "00"]
            return pool, []

    def plan(tensors, layout, caps, across_nodes=True, event=True):
        asked.append(event)
        return NoEvent(event)

    monkeypatch.setattr(direct, "plan", plan)
    g = kv(block=16, layers=2)
    agent = world.agent("a")
    tensors = vllm_tensors(g, 4, "flash")
    client, pool, why = direct.register(agent.socket, reg(world, "prefill", g, 4), tensors)
    client.close()
    assert asked == [True, False], "registered again without the event"
    assert pool is None and why.startswith("the agent refused the GPU pool: gpu: GPU pools are not accepted"), why
    asked.clear()
    with pytest.raises(AgentError, match="gpu: GPU pools are not accepted"):
        direct.register(agent.socket, reg(world, "prefill", g, 4), tensors, want=True)
    assert asked == [True, False]
    # Another refusal is not retried without the event.
    class BadUuid(NoEvent):
        def gpu_pool(self):
            pool, shared = super().gpu_pool()
            return dict(pool, device_uuid="GPU-0"), shared

    asked.clear()
    monkeypatch.setattr(direct, "plan", lambda tensors, layout, caps, across_nodes=True, event=True:
                        asked.append(event) or BadUuid(event))
    client, pool, why = direct.register(agent.socket, reg(world, "prefill", g, 4), tensors)
    client.close()
    assert asked == [True] and "gpu.device_uuid" in why, (asked, why)


@pytest.mark.gpu
@pytest.mark.parametrize("agents", ["one", "two"])
@pytest.mark.parametrize("direct_side", ["prefill", "decode"])
def test_a_direct_gpu_pool_and_a_staged_host_pool_meet_over_the_agents_streams(world, agents, direct_side):
    # One engine's connector took the direct path, the other's staged (direct: false, or its
    # agent refused the GPU pool): the agents move the KV between GPU memory and the host pool
    # over their KV streams. Every byte checked on the host after the move.
    g = kv(block=16, heads=8, layers=4, head_dim=128, layout="NHD", dtype="bfloat16")
    pa = world.agent("p", "tcp")
    da = pa if agents == "one" else world.agent("d", "tcp")
    blocks, d_blocks, tokens = [3, 4, 5, 9, 10], [200, 2, 201, 202, 40], 75
    if direct_side == "prefill":
        p, p_kv = gpu_engine(world, pa, "prefill", g, 256, "flash")
        fill_gpu(p, p_kv, 9, blocks, tokens)
        named = p_kv.save(blocks)
        d, _, why = direct.register(da.socket, reg(world, "decode", g, 256), [], want=False)
        assert why and d.pool is not None
    else:
        p, _, why = direct.register(pa.socket, reg(world, "prefill", g, 256), [], want=False)
        assert why and p.pool is not None
        synthetic.fill(p.pool, p.layout, 9, blocks, 0, tokens)
        named = None
        d, d_kv = gpu_engine(world, da, "decode", g, 256, "flashinfer")
    p.kv_ready("m1", blocks, tokens, event=named)
    d.expect_kv("m1", [p.address], d_blocks, tokens)
    event = d.wait("m1", timeout=60)
    assert event.type == "RequestDone" and event.raw.get("checksum") == "Verified", event.raw
    if direct_side == "prefill":
        assert synthetic.verify(d.pool, d.layout, 9, d_blocks, 0, tokens) == 0
    else:
        assert bad_tokens_on_gpu(d, d_kv, 9, d_blocks, tokens) == 0
    assert p.wait("m1").type == "RequestDone"
    p.close()
    d.close()


@pytest.mark.gpu
def test_across_pid_namespaces_the_direct_path_moves_kv_or_falls_back_to_staging(world, monkeypatch, capsys):
    # In a cluster the agent runs in the host's PID namespace and engines in their pods' own;
    # CUDA IPC handles are documented not to open across PID namespaces. Here the agent runs in a
    # new one (unshare): either the direct path works there, byte for byte, or the connector's
    # registration falls back to staging with the agent's reason. Which one is printed: the GPU
    # check records it.
    import shutil

    import conftest

    import subprocess

    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed to start the agent in another PID namespace"
    probe = subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        # Reported in the run's summary (-rs): this machine gives no new PID namespaces.
        pytest.skip(f"unshare --pid is refused here ({probe.stderr.strip()}): nothing recorded about PID namespaces")
    wrapper = world.dir / "agent-in-pidns"
    wrapper.write_text(f'#!/bin/sh\nexec {unshare} --pid --fork --kill-child {conftest.AGENT_BIN} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(conftest, "AGENT_BIN", wrapper)
    g = kv(block=16, heads=8, layers=4, head_dim=128, layout="NHD", dtype="bfloat16")
    agent = world.agent("ns", "tcp")
    p_tensors = vllm_tensors(g, 256, "flash", device="cuda", dtype=torch.bfloat16)
    p, p_kv, why = direct.register(agent.socket, reg(world, "prefill", g, 256), p_tensors)
    with capsys.disabled():
        print(f"\nCUDA IPC across PID namespaces: "
              f"{('direct path works, ' + ('with' if p_kv.event else 'without') + ' the engine event') if p_kv else 'fell back: ' + str(why)}")
    if p_kv is None:
        assert why.startswith("the agent refused the GPU pool: "), why
        assert p.pool is not None
        p.close()
        agent.kill()  # unshare outlasts a SIGTERM; its child dies with it
        return
    d, d_kv = gpu_engine(world, agent, "decode", g, 256, "flash")
    direct_to_direct(p, p_kv, d, d_kv, "ns1", 5)
    agent.kill()  # unshare outlasts a SIGTERM; its child dies with it


@pytest.mark.gpu
@pytest.mark.parametrize("agents", ["one", "two"])
def test_kv_in_torchs_expandable_segments_moves_direct_shared_as_vmm_descriptors(world, agents):
    # torch's expandable_segments maps its memory with the VMM API (cuMemCreate), which CUDA IPC
    # handles cannot share: the connector shares those allocations as descriptors
    # (ShareGpuMemory) and still takes the direct path. Every byte checked after the move.
    g = kv(block=16, heads=8, layers=4, head_dim=128, layout="HND", dtype="bfloat16")
    pa = world.agent("p", "tcp")
    da = pa if agents == "one" else world.agent("d", "tcp")
    # Blocks torch cached from earlier tests would be reused whatever the setting: drop them.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        p_tensors = vllm_tensors(g, 256, "flash", device="cuda", dtype=torch.bfloat16)
        # Past the rest of prefill's last allocation (torch maps 20 MiB at a time on large
        # segments), so the two engines share no allocation.
        spacer = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        d_tensors = vllm_tensors(g, 256, "flashinfer", device="cuda", dtype=torch.bfloat16)
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    assert not direct.ipc_capable(p_tensors[0]), "expandable segments are VMM memory"
    p, p_kv, why = direct.register(pa.socket, reg(world, "prefill", g, 256), p_tensors, want=True)
    d, d_kv, why_d = direct.register(da.socket, reg(world, "decode", g, 256), d_tensors, want=True)
    assert p_kv is not None and p_kv.vmm and d_kv is not None and d_kv.vmm, (why, why_d)
    direct_to_direct(p, p_kv, d, d_kv, "v1", 13)
    del p_kv, d_kv, p_tensors, d_tensors, spacer
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
