"""The connector's two paths on a GPU, measured (not asserted): a 4096-token prompt of an 8B-class
model (32 layers, 8 KV heads of 128, bfloat16, 16-token blocks: 512 MiB) from a prefill engine's
CUDA KV tensors into a decode engine's, through real agents, timed from prefill's ``KvReady`` (its
event recorded, or its staging copy started) to decode's ``RequestDone`` (and, staged, its copy
back into the KV tensors):

- direct, one agent: both engines' tensors are the agent's GPU pools (CUDA IPC, GPU to GPU);
- direct, two agents: each agent stages its GPU pool through its KV stream (``--transport tcp``);
- staged, two agents: host pools (pinned), the engines copying GPU <-> pool, the agents moving
  the pool over shared memory (on one host; RDMA between nodes);

beside, in the same run, torch's device-to-device copy of the same bytes and a device-to-host
copy into pinned memory. Run by hack/gpu-check.sh (needs a GPU and CUDA torch):

    cd python/tests && PYTHONPATH=../src PDPAIR_AGENT_BIN=... python3 bench_gpu.py [repeat] [json file]
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from conftest import World, kv
from pdpair_vllm import direct
from pdpair_vllm.client import registration
from pdpair_vllm.staging import TorchStager
from test_direct import vllm_tensors

G = kv(block=16, heads=8, layers=32, head_dim=128, layout="NHD", dtype="bfloat16")
TOKENS = 4096
BLOCKS = TOKENS // 16
NUM_BLOCKS = BLOCKS + 16
BYTES = TOKENS * 32 * 2 * 8 * 128 * 2


def engine(world, agent, role, checksum, path):
    tensors = vllm_tensors(G, NUM_BLOCKS, "flash", device="cuda", dtype=torch.bfloat16)
    for t in tensors:
        t.normal_()
    reg = registration(pdpair="default/pair", role=role, engine=f"bench-{role}", kv=G, num_blocks=NUM_BLOCKS,
                       pairing_key=world.key, mode="Push", checksum=checksum, handshake_timeout_ms=10000,
                       lease_ms=60000)
    client, pool, why = direct.register(agent.socket, reg, tensors, want=path == "direct")
    if path == "direct":
        return client, pool
    stager = TorchStager(tensors, client.pool, client.layout)
    if not stager.pinned:
        print(f"bench_gpu: {role}'s staging pool could not be page-locked: its copies are from pageable memory",
              flush=True)
    return client, stager


def run(world, name, agents, transport, path, checksum, repeat):
    tag = f"{len(world.agents)}"
    pa = world.agent(f"p{tag}", transport)
    da = pa if agents == 1 else world.agent(f"d{tag}", transport)
    p, ps = engine(world, pa, "prefill", checksum, path)
    d, ds = engine(world, da, "decode", checksum, path)
    blocks = list(range(BLOCKS))
    ms = []
    try:
        for i in range(repeat + 1):  # the first handshakes: not counted
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            p.kv_ready(f"r{i}", blocks, TOKENS, event=ps.save(blocks))
            d.expect_kv(f"r{i}", [p.address], blocks, TOKENS)
            event = d.wait(f"r{i}", timeout=120)
            assert event.type == "RequestDone", event.raw
            ds.load(blocks)
            torch.cuda.synchronize()
            if i:
                ms.append((time.perf_counter() - t0) * 1e3)
            assert p.wait(f"r{i}", timeout=60).type == "RequestDone"
    finally:
        p.close()
        d.close()
        del ps, ds
        drop_cache()
    return {"path": name, "checksum": checksum, "best_ms": min(ms), "p50_ms": statistics.median(ms),
            "gb_per_s_best": BYTES / min(ms) / 1e6}


def ceilings(repeat):
    src = torch.empty(BYTES, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    host = torch.empty(BYTES, dtype=torch.uint8, pin_memory=True)
    out = []
    for name, f in (("torch device-to-device copy", lambda: dst.copy_(src)),
                    ("torch device-to-host copy, pinned", lambda: host.copy_(src))):
        f()
        torch.cuda.synchronize()
        ms = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
        out.append({"path": name, "checksum": "-", "best_ms": min(ms), "p50_ms": statistics.median(ms),
                    "gb_per_s_best": BYTES / min(ms) / 1e6})
    return out


def drop_cache():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main():
    repeat = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    world = World(pathlib.Path(tempfile.mkdtemp(prefix="pdgb-", dir="/tmp")))
    rows = ceilings(repeat)
    # Its buffers, cached, would be split into the engines' tensors, so that prefill's and
    # decode's share one allocation, which the agent refuses to register twice.
    drop_cache()
    try:
        for checksum in ("Disabled", "FailClosed"):
            rows.append(run(world, "direct, one agent (CudaIpc)", 1, "tcp", "direct", checksum, repeat))
            rows.append(run(world, "direct, two agents (StagedStream)", 2, "tcp", "direct", checksum, repeat))
            rows.append(run(world, "staged, two agents over shm", 2, "shm", "staged", checksum, repeat))
    finally:
        world.stop()
    print(f"{TOKENS}-token prompt, {BYTES / 2**20:.0f} MiB, {torch.cuda.get_device_name()}, best / p50 of {repeat}")
    print(f"{'path':<40} {'checksums':<11} {'best ms':>9} {'p50 ms':>9} {'GB/s best':>10}")
    for r in rows:
        print(f"{r['path']:<40} {r['checksum']:<11} {r['best_ms']:>9.2f} {r['p50_ms']:>9.2f} {r['gb_per_s_best']:>10.2f}")
    if len(sys.argv) > 2:
        pathlib.Path(sys.argv[2]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
