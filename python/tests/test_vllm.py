"""Inside real vLLM: two vLLM 0.33 schedulers (prefill and decode), each with ``PdpairConnector``
loaded by module path and its worker half from ``KVConnectorFactory`` on CPU KV tensors, against
two real agents. The harness (vllm_harness.py) plays the model runner and the proxy; every
request state asserted here is vLLM's own."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="the vLLM venv (hack/vllm-venv.sh) runs these")  # noqa: E402

import pdpair_vllm  # noqa: E402
from vllm_harness import SAMPLED, Engine  # noqa: E402

P_SEED, D_SEED = 1, 2


def both(p: Engine, d: Engine, done, timeout=30.0, what="condition"):
    """Steps both engines (as their engine cores would) until ``done()``."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout} s")
        p.step()
        d.step()
        time.sleep(0.002)


def received(d: Engine, request: str) -> bool:
    return any(request in (o.finished_recving or ()) for o in d.transfer_events)


def prefill(p: Engine, request: str, prompt):
    """P runs the request with ``do_remote_decode``; returns the params the proxy hands to D."""
    p.add(request, prompt, {"do_remote_decode": True})
    p.run_until(lambda: request in p.outputs, what="prefill finished")
    params = p.outputs[request].kv_transfer_params
    assert params and params["do_remote_prefill"] is True, params
    return params


def decode_receives(p: Engine, d: Engine, request: str, prompt, params):
    """D takes the request with P's params; returns D's KV seeds per position when it arrived."""
    d.add(request, prompt, params, max_tokens=2)
    d.step()
    assert d.status(request) == "WAITING_FOR_REMOTE_KVS"
    seen = {}

    def arrived():
        if received(d, request) and "seeds" not in seen:
            seen["seeds"] = d.kv_seeds(request, 0, len(prompt), [P_SEED, D_SEED])
        return "seeds" in seen

    both(p, d, arrived, what="KV received on decode")
    return seen["seeds"]


@pytest.fixture
def pair(world):
    engines = []

    def make(mode="Push", checksum="FailClosed", p_extra=(), d_extra=(), **kw):
        pa = world.agent("p", "tcp", *p_extra)
        da = world.agent("d", "tcp", *d_extra)
        p = Engine(world, pa, "prefill", seed=P_SEED, mode=mode, checksum=checksum, **kw)
        d = Engine(world, da, "decode", seed=D_SEED, mode=mode, checksum=checksum, **kw)
        engines.extend([p, d])
        return p, d

    yield make
    for e in engines:
        e.close()


def test_the_connector_is_the_installed_wheel_not_the_source_tree():
    # make python-test installs the built wheel into the venv and runs these tests without the
    # source on sys.path: vLLM's factory imported what `pip install` put in site-packages.
    assert "site-packages" in pdpair_vllm.__file__, pdpair_vllm.__file__


@pytest.mark.parametrize("mode", ["Push", "Pull"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_request_moves_prefill_to_decode_through_vllm_byte_exact(pair, mode, layout):
    p, d = pair(mode=mode, layout=layout)
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks of 16 and a partial one
    params = prefill(p, "req", prompt)
    assert p.status("req") == "FINISHED_LENGTH_CAPPED", "P holds the blocks until the agent is done"
    seeds = decode_receives(p, d, "req", prompt, params)
    assert seeds == [P_SEED] * 50, seeds
    d.run_until(lambda: "req" in d.outputs, what="decode finished")
    assert d.outputs["req"].new_token_ids[-1] == SAMPLED
    both(p, d, lambda: p.status("req") is None, what="P freed the blocks")
    assert "req" not in p.scheduler.requests
