#!/usr/bin/env python3
"""NIXL's UCX backend moving the same bytes as pdpair's shm push, for docs/benchmarks.md: two
processes on this host, DRAM, a target pool of SIZE bytes, WRITEs in DESC-byte descriptors (the
agent's coalesced 8 MiB per layer and K/V), REQUESTS transfers of the whole pool, GB/s over the
transfers' time (post to DONE). Run by hack/bench.sh with NIXL's wheel (nixl-cu12, no GPU needed)
in a venv; `python3 nixl-bench.py [SIZE_MIB] [DESC_MIB] [REQUESTS]`.

NIXL's bundled UCX aborts in libnl at exit here unless its ib module is left out (UCX_MODULES=^ib);
its progress thread is off (faster here, DESIGN.md)."""

import base64
import os
import subprocess
import sys
import time

import numpy as np
from nixl_cu12 import nixl_agent, nixl_agent_config


def agent(name):
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def target(size):
    a = agent("target")
    buf = np.zeros(size, dtype=np.uint8)
    buf.fill(1)  # fault the pages in first, as the agent does with its pools
    a.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    print("META", base64.b64encode(a.get_agent_metadata()).decode(), buf.ctypes.data, flush=True)
    while True:  # progress until the initiator says it is done
        notifs = a.get_new_notifs()
        if any(b"done" in m for ms in notifs.values() for m in ms):
            break
        time.sleep(0.0005)
    # The last byte of each descriptor, for the initiator's check.
    print("LAST", int(buf[size - 1]), flush=True)
    os._exit(0)


def initiator(size, desc, requests):
    env = dict(os.environ, UCX_MODULES="^ib")
    t = subprocess.Popen([sys.executable, __file__, "--target", str(size)], stdout=subprocess.PIPE, env=env, text=True)
    def said(tag):  # NIXL logs on stdout too: find our line
        for line in t.stdout:
            if line.startswith(tag + " "):
                return line.split()[1:]
        raise SystemExit(f"the target process ended before saying {tag}")

    meta, remote_addr = said("META")
    a = agent("initiator")
    src = np.full(size, 7, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, size, 0, "")], "DRAM")
    peer = a.add_remote_agent(base64.b64decode(meta))
    n = size // desc
    local = a.get_xfer_descs([(src.ctypes.data + i * desc, desc, 0) for i in range(n)], "DRAM")
    remote = a.get_xfer_descs([(int(remote_addr) + i * desc, desc, 0) for i in range(n)], "DRAM")
    handle = a.initialize_xfer("WRITE", local, remote, peer)
    took = []
    # One transfer first, untimed (connection setup; the agent's handshake is not timed either).
    state = a.transfer(handle)
    while state == "PROC":
        state = a.check_xfer_state(handle)
    for _ in range(requests):
        start = time.perf_counter()
        state = a.transfer(handle)
        while state == "PROC":
            state = a.check_xfer_state(handle)
        if state != "DONE":
            raise SystemExit(f"transfer state {state}")
        took.append(time.perf_counter() - start)
    a.send_notif(peer, b"done")
    last = int(said("LAST")[0])
    t.wait()
    gbps = size * requests / sum(took) / 1e9
    print(f"nixl WRITE {size >> 20} MiB in {desc >> 20} MiB descriptors x {requests}: {gbps:.2f} GB/s "
          f"(best {size / min(took) / 1e9:.2f}), target's last byte {last}")
    os._exit(0 if last == 7 else 1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--target"]:
        target(int(sys.argv[2]))
    args = [int(x) for x in sys.argv[1:]] + [512, 8, 16][len(sys.argv) - 1:]
    initiator(args[0] << 20, args[1] << 20, args[2])
