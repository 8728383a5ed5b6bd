"""Real agents for the connector's tests: ``pdpair-agent run`` processes on loopback (tcp or
shared memory), with their engine API sockets in a temporary directory. No GPU, no cluster: the
agents run with attestation off, as they do outside Kubernetes."""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
AGENT_BIN = pathlib.Path(os.environ.get("PDPAIR_AGENT_BIN", ROOT / "target" / "debug" / "pdpair-agent"))


def kv(block=16, kernel=None, heads=4, layers=2, head_dim=8, layout="HND", dtype="float16", mla=False):
    """A small geometry (the PDPair's camelCase ``kv``)."""
    g = {
        "engine": "vllm",
        "model": "tiny-llama",
        "dtype": dtype,
        "cacheDtype": "auto",
        "layers": layers,
        "kvHeads": heads,
        "headDim": head_dim,
        "attentionBackend": "FLASH_ATTN",
        "layout": layout,
        "blockSize": block,
        "mla": mla,
    }
    if kernel is not None:
        g["kernelBlockSize"] = kernel
    return g


class Agent:
    def __init__(self, directory: pathlib.Path, name: str, transport: str, *extra: str,
                 cgroup: Optional[pathlib.Path] = None):
        self.socket = str(directory / f"{name}.sock")
        self.name = name
        pools = directory / "pools"
        pools.mkdir(exist_ok=True)
        self.log = open(directory / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [str(AGENT_BIN), "run", "--name", name, "--listen-host", "127.0.0.1", "--transport", transport,
             "--socket", self.socket, "--pool-dir", str(pools), "--heartbeat-ms", "200", *extra],
            stdout=self.log, stderr=self.log,
            # In `cgroup` from its first instruction (its memory is charged there).
            preexec_fn=(lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"agent {name} did not open {self.socket}; see {self.log.name}")
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class World:
    """Agents started for one test, stopped after it; one pairing secret."""

    def __init__(self, directory: pathlib.Path):
        self.dir = directory
        self.key = secrets.token_bytes(32)
        self.key_file = directory / "pairing.key"
        self.key_file.write_bytes(self.key)
        self.agents = []

    def agent(self, name: str, transport: str = "tcp", *extra: str, cgroup: Optional[pathlib.Path] = None) -> Agent:
        a = Agent(self.dir, name, transport, *extra, cgroup=cgroup)
        self.agents.append(a)
        return a

    def manifest(self, mode: str, checksum: str, p_kv: dict, d_kv: dict, p_tp=1, d_tp=1, lease="30s") -> pathlib.Path:
        """A PDPair manifest (JSON is YAML) for the Rust synthetic engine."""
        pair = {
            "apiVersion": "pdpair.dev/v1alpha1",
            "kind": "PDPair",
            "metadata": {"name": "pair", "namespace": "default"},
            "spec": {
                "transfer": {"mode": mode, "checksum": checksum, "handshakeTimeout": "5s", "leaseDuration": lease},
                "prefill": {"replicas": 1, "parallelism": {"tensor": p_tp}, "kv": p_kv},
                "decode": {"replicas": 1, "parallelism": {"tensor": d_tp}, "kv": d_kv},
            },
        }
        path = self.dir / "pair.yaml"
        path.write_text(json.dumps(pair))
        return path

    def stop(self) -> None:
        for a in self.agents:
            a.stop()


@pytest.fixture
def memory_cgroup():
    """A function making a memory cgroup of a limit (cgroup v2's ``memory.max`` or v1's
    ``memory.limit_in_bytes``, whichever this machine has) for processes started in it; each is
    removed after the test, its processes moved back to the root first. Needs root, as the
    agent's attestation tests do."""
    made = []

    def make(limit: int) -> pathlib.Path:
        unified = pathlib.Path("/sys/fs/cgroup")
        controllers = unified / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            root, limit_file = unified, "memory.max"
        elif (unified / "memory" / "memory.limit_in_bytes").exists():
            root, limit_file = unified / "memory", "memory.limit_in_bytes"
        else:
            pytest.fail("no memory cgroup controller to make a limit with (cgroup v1 or v2 needed)")
        path = root / f"pdpair-test-{os.getpid()}-{len(made)}"
        path.mkdir()
        made.append((root, path))
        (path / limit_file).write_text(str(limit))
        return path

    yield make
    for root, path in made:
        deadline = time.monotonic() + 10
        while True:
            for pid in (path / "cgroup.procs").read_text().split():
                try:
                    (root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # gone
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@pytest.fixture
def world():
    if not AGENT_BIN.exists():
        pytest.fail(f"{AGENT_BIN} is missing: build it first (cargo build -p pdpair-agent)")
    # A short directory: socket paths hold 108 bytes, UCX's shared-memory directory 54.
    directory = pathlib.Path(tempfile.mkdtemp(prefix="pdpy-", dir="/tmp"))
    w = World(directory)
    yield w
    w.stop()
    shutil.rmtree(directory, ignore_errors=True)


def rust_engine(world: World, agent: Agent, manifest, role, *, request, blocks, num_tokens, seed,
                first_token=0, prefill=(), engine=None, num_blocks=None, rank=0, arrangement=None, regions=None):
    """The agent's own synthetic engine (``pdpair-agent synthetic-engine``) as a process: returns
    it and its address (the first line it prints). ``regions``: ``[(layers, arrangement or None)]``."""
    args = [str(AGENT_BIN), "synthetic-engine", "--socket", agent.socket, "--pair", str(manifest), "--role", role,
            "--engine", engine or f"rust-{role}-{rank}", "--pairing-key-file", str(world.key_file),
            "--tensor-rank", str(rank), "--num-blocks", str(num_blocks or max(blocks) + 1), "--request", request,
            "--blocks", ",".join(map(str, blocks)), "--num-tokens", str(num_tokens), "--first-token",
            str(first_token), "--seed", str(seed)]
    if arrangement:
        args += ["--kv-arrangement", arrangement]
    if regions:
        args += ["--regions", ",".join(f"{n}:{a}" if a else str(n) for n, a in regions)]
    for p in prefill:
        args += ["--prefill", p]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"synthetic engine failed: {proc.stderr.read()}")
    return proc, json.loads(line)["address"]


def rust_result(proc) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a GPU and CUDA torch; make python-test leaves these out, hack/gpu-check.sh runs them")
