"""Per-request cost of the whole connector path, measured (not asserted): two vLLM schedulers with
PdpairConnector (as in test_vllm.py) on an 8B-like geometry (32 layers, 8 KV heads of 128, fp16,
16-token blocks), real agents over shared memory; from D's ``add_request`` with P's params to the
step in which vLLM sees the KV received (P's staging copy into its pool, the engine API, the
transfer, checksums per policy, D's staging copy into its KV tensors, engine steps). Beside it, a
plain copy of the same bytes in the same run (``torch`` clone, one core).

    hack/python-test.sh is not needed: run with the vLLM venv's python from python/tests:
    PDPAIR_AGENT_BIN=../../target/release/pdpair-agent python bench_connector.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from conftest import World, AGENT_BIN  # noqa: F401  (the same agents as the tests)
from pdpair_vllm import staging
from vllm_harness import Engine

SHAPE = (32, 8, 128)
BYTES_PER_TOKEN = 2 * SHAPE[0] * SHAPE[1] * SHAPE[2] * 2


def run(world, checksum: str, tokens: int, requests: int, layout: str = "NHD", host_pools=(None, None)):
    """``layout``: the engines' KV tensors (the harness's: an older vLLM's ``NHD``, or vLLM 0.33's
    own, ``LBNHC``...); ``host_pools``: each side's staged pool arrangement, ``None`` as the
    connector picks it, or forced (``KvFirst``: vLLM 0.33's tensors staged into K and V arrays, as
    before the connector kept them side by side)."""
    name = f"{checksum}-{tokens}-{layout}-{host_pools[0]}-{host_pools[1]}"
    pa, da = world.agent(f"p-{name}", "shm"), world.agent(f"d-{name}", "shm")
    blocks = tokens // 16 + 8
    engines = []
    for role, seed, agent, arrangement in (("prefill", 1, pa, host_pools[0]), ("decode", 2, da, host_pools[1])):
        picks = staging.staged_arrangement
        if arrangement is not None:
            staging.staged_arrangement = lambda tensors, kv, a=arrangement: None if a == "KvFirst" else a
        try:
            engines.append(Engine(world, agent, role, seed=seed, checksum=checksum, shape=SHAPE, num_blocks=blocks,
                                  compute=False, layout=layout))
        finally:
            staging.staged_arrangement = picks
    p, d = engines
    ms, save, load = [], [], []
    try:
        for i in range(requests):
            prompt = [10_000 * (i + 1) + t for t in range(tokens)]
            rid = f"r{i}"
            p.add(rid, prompt, {"do_remote_decode": True})
            p.run_until(lambda: rid in p.outputs, timeout=120)
            params = p.outputs[rid].kv_transfer_params
            start = time.perf_counter()
            d.add(rid, prompt, params)
            while not any(rid in (o.finished_recving or ()) for o in d.transfer_events):
                p.step()
                d.step()
                # Idle engine cores poll; do not take the 2 cores the agents need from them.
                time.sleep(0.0005)
            ms.append((time.perf_counter() - start) * 1e3)
            assert rid not in set().union(*(o.failed_recving for o in d.transfer_events)), "the transfer failed"
            save.append(p.worker._worker.staging_ms[rid]["save"])
            load.append(d.worker._worker.staging_ms[rid]["load"])
            d.run_until(lambda: rid in d.outputs, timeout=120)
            p.run_until(lambda: p.status(rid) is None, timeout=120)
    finally:
        p.close()
        d.close()
    return ms, save, load


def copy_ms(nbytes: int, rounds: int = 5) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def main():
    import pathlib
    import shutil
    import tempfile

    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    directory = pathlib.Path(tempfile.mkdtemp(prefix="pdpb-", dir="/tmp"))
    world = World(directory)
    rows = []
    try:
        if len(sys.argv) > 2 and sys.argv[2] == "host-pools":
            return host_pools(world, requests, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
        for tokens in (512, 4096):
            raw = copy_ms(tokens * BYTES_PER_TOKEN)
            for checksum in ("Disabled", "FailClosed"):
                ms, save, load = run(world, checksum, tokens, requests)
                ms = sorted(ms)
                rows.append({
                    "tokens": tokens, "mib": tokens * BYTES_PER_TOKEN >> 20, "checksum": checksum,
                    "p50_ms": round(statistics.median(ms), 1), "max_ms": round(ms[-1], 1),
                    "min_ms": round(ms[0], 1), "p_staging_p50_ms": round(statistics.median(save), 1),
                    "d_staging_p50_ms": round(statistics.median(load), 1), "raw_copy_ms": round(raw, 1),
                })
                print(json.dumps(rows[-1]), flush=True)
    finally:
        world.stop()
        shutil.rmtree(directory, ignore_errors=True)


def host_pools(world, requests: int, rounds: int):
    """vLLM 0.33's KV tensors (``LBNHC``) staged both sides, 4096 tokens, checksums Disabled: host
    pools side by side as the tensors (the connector's pick), in K and V arrays (forced: as
    before), and one of each (a connector of each kind, as a staged engine meets a direct one),
    interleaved in each of ``rounds`` rounds."""
    cases = [("both side by side", (None, None)), ("both K and V arrays", ("KvFirst", "KvFirst")),
             ("prefill side by side, decode arrays", (None, "KvFirst"))]
    for r in range(rounds):
        for what, pools in cases:
            ms, save, load = run(world, "Disabled", 4096, requests, "LBNHC", pools)
            print(json.dumps({"round": r + 1, "host pools": what, "p50_ms": round(statistics.median(ms), 1),
                              "min_ms": round(min(ms), 1), "p_staging_p50_ms": round(statistics.median(save), 1),
                              "d_staging_p50_ms": round(statistics.median(load), 1)}), flush=True)


if __name__ == "__main__":
    main()
