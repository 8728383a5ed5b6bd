"""Inside real vLLM: two vLLM 0.33 schedulers (prefill and decode), each with ``PdpairConnector``
loaded by module path and its worker half from ``KVConnectorFactory`` on CPU KV tensors, against
two real agents. The harness (vllm_harness.py) plays the model runner and the proxy; every
request state asserted here is vLLM's own."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM venv (hack/vllm-venv.sh) runs these")  # noqa: E402

import pdpair_vllm  # noqa: E402
from pdpair_vllm.client import AgentError  # noqa: E402
from pdpair_vllm.connector import PdpairConnector  # noqa: E402
from pdpair_vllm.transfer import PARAM_HOLD, PARAM_TOKENS  # noqa: E402
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


def receive_after_a_local_prefix(p: Engine, d: Engine, shared, tail):
    """D computes ``shared`` for a request of its own, then takes ``shared + tail`` from P; D's
    KV seeds per position when it arrived, after decode finished and P freed the blocks."""
    d.add("local", shared + [1, 2, 3], max_tokens=1)
    d.run_until(lambda: "local" in d.outputs, what="the local request")
    prompt = shared + tail
    seeds = decode_receives(p, d, "req", prompt, prefill(p, "req", prompt))
    d.run_until(lambda: "req" in d.outputs, what="decode finished")
    both(p, d, lambda: p.status("req") is None, what="P freed the blocks")
    assert p.outcome("req") == "RequestDone"
    return seeds


@pytest.fixture(autouse=True, params=["sync", "async"])
def scheduling(request, monkeypatch):
    """Every test here runs under vLLM's synchronous scheduler and under async scheduling
    (``AsyncScheduler`` with two batches in flight, vLLM 0.33's default on GPUs): the harness's
    ``Engine`` takes it from ``PDPAIR_HARNESS_ASYNC``."""
    monkeypatch.setenv("PDPAIR_HARNESS_ASYNC", "1" if request.param == "async" else "0")
    return request.param


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


def test_the_harness_runs_the_scheduler_it_is_asked_for(world, scheduling):
    e = Engine(world, world.agent("p"), "prefill", seed=P_SEED)
    try:
        assert type(e.scheduler).__name__ == ("AsyncScheduler" if scheduling == "async" else "Scheduler")
        assert e.config.max_concurrent_batches == (2 if scheduling == "async" else 1)
    finally:
        e.close()


def test_the_connector_is_the_installed_wheel_not_the_source_tree():
    # make python-test installs the built wheel into the venv and runs these tests without the
    # source on sys.path: vLLM's factory imported what `pip install` put in site-packages.
    assert "site-packages" in pdpair_vllm.__file__, pdpair_vllm.__file__


def test_a_prefill_that_ran_past_its_first_token_offers_its_prompts_kv_and_decode_takes_it(pair):
    # P offered the KV of every token it had computed: a request that ran a step past its first
    # token (max_tokens 2 here; async scheduling's step in flight, vLLM's default, counts one
    # too) offered more tokens than its prompt, decode asked for its prompt's, and the transfer
    # failed (TokenCountMismatch): decode computed every such prompt itself.
    p, d = pair()
    prompt = list(range(100, 150))
    p.add("req", prompt, {"do_remote_decode": True}, max_tokens=2)
    p.run_until(lambda: "req" in p.outputs, what="prefill finished")
    params = p.outputs["req"].kv_transfer_params
    assert params[PARAM_TOKENS] == 50, params
    # How long P holds the blocks, renewals included (its agent's Registered, through the
    # workers' handshake metadata): the harness's lease of 30 s, eleven times.
    assert params[PARAM_HOLD] == 330.0, params
    seeds = decode_receives(p, d, "req", prompt, params)
    assert seeds == [P_SEED] * 50, seeds
    both(p, d, lambda: p.status("req") is None, what="P freed the blocks")
    assert p.outcome("req") == "RequestDone"


def test_sleep_mode_is_refused_unless_the_kv_is_always_staged():
    # Sleep mode frees the KV cache and maps new memory at the same addresses on wake; on the
    # direct path the agent keeps the old allocation as the pool, so KV would land where vLLM
    # no longer reads it. vLLM asks the connector, and refuses enable_sleep_mode when it says no.
    from vllm.config import KVTransferConfig

    def config(**extra):
        return KVTransferConfig(kv_connector="PdpairConnector", kv_connector_module_path="pdpair_vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)

    assert not PdpairConnector.supports_sleep_mode(config())
    assert not PdpairConnector.supports_sleep_mode(config(direct="auto"))
    assert not PdpairConnector.supports_sleep_mode(config(direct=True))
    assert PdpairConnector.supports_sleep_mode(config(direct=False))
    assert PdpairConnector.supports_sleep_mode(config(direct="false"))


@pytest.mark.parametrize("mode", ["Push", "Pull"])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "LHBNC", "NHD", "HND", "MLA"])
def test_a_request_moves_prefill_to_decode_through_vllm_byte_exact(pair, mode, layout):
    """vLLM 0.33's own KV tensors in its layouts (``[blocks, heads, tokens, K|V]`` views of one
    allocation: tokens outside heads or inside, layers, blocks or heads outermost), and an older
    vLLM's shapes."""
    p, d = pair(mode=mode, layout=layout)
    for w in p.workers + d.workers:  # CPU tensors: staged through the agents' host pools, saying why
        assert w.kv_path == ("staged", "the KV cache is in cpu memory, not on a GPU"), w.kv_path
    if layout == "MLA":
        assert (p.layout.arrangement, p.layout.arrays) == ("Latent", (False,)), "registered as MLA latents"
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks of 16 and a partial one
    params = prefill(p, "req", prompt)
    assert p.status("req") == "FINISHED_LENGTH_CAPPED", "P holds the blocks until the agent is done"
    seeds = decode_receives(p, d, "req", prompt, params)
    assert seeds == [P_SEED] * 50, seeds
    d.run_until(lambda: "req" in d.outputs, what="decode finished")
    assert d.outputs["req"].new_token_ids[-1] == SAMPLED
    both(p, d, lambda: p.status("req") is None, what="P freed the blocks")
    assert "req" not in p.scheduler.requests


@pytest.mark.parametrize("mode", ["Push", "Pull"])
@pytest.mark.parametrize("p_layout,d_layout", [("LBNHC", "NHD"), ("HND", "LBHNC"), ("BLNHC", "NHD"),
                                               ("LHBNC", "HND")])
def test_vllms_own_kv_cache_and_an_older_vllms_shape_agree_on_every_byte(world, mode, p_layout, d_layout):
    """vLLM 0.33's [blocks, heads, tokens, K|V] staged side by side (``Interleaved``) and an older
    vLLM's K and V arrays (``KvFirst``), the agents moving each head's token between the two:
    each side's KV is written and read at its own tensors' logical places, so a view that put a
    head's bytes elsewhere, or V in K's place, would arrive elsewhere."""
    pa, da = world.agent("p", "tcp"), world.agent("d", "tcp")
    p = Engine(world, pa, "prefill", seed=P_SEED, mode=mode, layout=p_layout)
    d = Engine(world, da, "decode", seed=D_SEED, mode=mode, layout=d_layout)
    try:
        assert p.layout.layout == d.layout.layout
        assert {p.layout.arrangement, d.layout.arrangement} == {"Interleaved", "KvFirst"}
        prompt = list(range(300, 350))
        params = prefill(p, "req", prompt)
        assert decode_receives(p, d, "req", prompt, params) == [P_SEED] * 50
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "LHBNC"])
def test_vllms_own_kv_cache_is_one_region_for_the_direct_path_where_its_blocks_are_dense(pair, layout):
    """vLLM 0.33's allocator's tensors (``allocate_kv_cache``, placed as its planner places them)
    as the direct path registers them: one ``Interleaved`` region of the allocation, every
    token's K and V where the agent's layout says, byte for byte against vLLM's logical indexing
    of its views; its heads-outermost layout (``LHBNC``: a block's heads lie apart) staged, saying
    why. Here on CPU tensors (the direct path itself needs a GPU: ``make gpu-check``)."""
    import dataclasses

    from pdpair_vllm import direct

    p, _ = pair(layout=layout)
    tensors, host = p.kv[0], p.layouts[0]
    if layout == "LHBNC":
        with pytest.raises(direct.DirectRefused, match="is not a dense HND block of each head's token's K then V"):
            direct.regions(tensors, host)
        return
    (region,) = direct.regions(tensors, host)
    assert region["kv_arrangement"] == "Interleaved" and region["layers"] == len(tensors)
    layout_ = dataclasses.replace(host, regions=((0, host.layers, "Interleaved"),),
                                  strides=((region["layer_stride"], region["block_stride"]),))
    storage = tensors[0].untyped_storage()
    assert tensors[0].data_ptr() == storage.data_ptr(), "layer 0's block 0 starts the allocation"
    assert layout_.region_lens == [storage.nbytes()], "the region is the allocation"
    memory = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    memory.copy_(torch.randint(0, 256, memory.shape, dtype=torch.uint8))
    half, d = layout_.half_token, layout_.head_dim
    blocks = [0, 1, host.num_blocks - 1]
    for (r, at), layer, head, token, v in layout_.tokens(blocks, 0, len(blocks) * host.block_size):
        block, j = blocks[token // host.block_size], token % host.block_size
        logical = tensors[layer][block, head - host.head_offset, j, int(v) * d:(int(v) + 1) * d]
        assert torch.equal(memory[at:at + half], logical.contiguous().view(torch.uint8)), (layer, head, token, v)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "LHBNC", "NHD", "MLA"])
def test_a_staged_vllm_033_kv_cache_has_a_host_pool_laid_out_block_for_block_as_the_direct_path(pair, layout):
    """Staged, vLLM 0.33's KV tensors get an ``Interleaved`` host pool: every head's token's K and
    V at the offset in its block where the direct path's region has it, so a staged engine and a
    direct one (or two staged ones) move whole blocks, not a head's token at a time (2.3-3.1
    against 10-14 GB/s over shm: docs/benchmarks.md), and each block's staging copy is one run
    of bytes. An older vLLM's K and V arrays and an MLA cache stay ``KvFirst`` and ``Latent``."""
    import dataclasses

    from pdpair_vllm import direct

    p, d = pair(layout=layout)
    host = p.layout
    if layout in ("NHD", "MLA"):
        assert host.arrangement == ("KvFirst" if layout == "NHD" else "Latent")
        return
    assert (host.arrangement, host.region_lens) == ("Interleaved", [host.layers * host.num_blocks * 2 * host.block_len])
    assert d.layout.arrangement == "Interleaved"
    prompt = list(range(400, 450))
    prefill(p, "req", prompt)
    # Staged into P's pool as its KV is offered: each token read back from the pool below.
    p.run_until(lambda: "req" in p.worker._worker.staging_ms, what="P staged the request's KV")
    logical = p.blocks("req")
    blocks = sorted({p._kernel_at(logical, t)[0] for t in range(len(prompt))})
    pool = p.worker._worker.stager.pool.reshape(-1)
    for (r, at), layer, head, token, v in host.tokens(blocks, 0, len(prompt)):
        block, j = p._kernel_at(logical, token)
        cell = p.kv[0][layer].view(torch.uint8)[block, head - host.head_offset, j]
        assert torch.equal(pool[at:at + host.half_token], cell[int(v) * host.half_token:(int(v) + 1) * host.half_token])
    if layout == "LHBNC":
        return  # a block's heads lie apart: the direct path stages it (the test above)
    # Each block of each layer: the same bytes in the pool as in the KV cache's allocation, where
    # the direct path's region places that block (one run of 2 x block_len bytes in both).
    tensors = p.kv[0]
    (region,) = direct.regions(tensors, dataclasses.replace(host, regions=(), strides=()))
    direct_ = dataclasses.replace(host, strides=((region["layer_stride"], region["block_stride"]),))
    storage = tensors[0].untyped_storage()
    assert tensors[0].data_ptr() == storage.data_ptr(), "layer 0's block 0 starts the allocation"
    memory = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    for layer in range(host.layers):
        for b in blocks:
            ((_, at, n),) = host.block_extents(layer, b)
            ((_, there, m),) = direct_.block_extents(layer, b)
            assert n == m == 2 * host.block_len
            assert torch.equal(pool[at:at + n], memory[there:there + m]), (layer, b)


def test_a_kv_tensor_whose_heads_are_not_the_ranks_kv_heads_is_refused_naming_both(pair):
    # A backend packing K and V as two head slots ([blocks, 2, tokens, heads * dim]) passed the
    # cell-size check where heads * dim is 2 * head size, and staging filed one head's K and V
    # as K and the next one's as V.
    p, _ = pair(layout="LBNHC")
    w = p.workers[0]
    assert w._geometry(p.kv[0][0], 2)["kvHeads"] == 4
    packed = torch.zeros(64, 2, 16, 2 * 16, dtype=torch.float16)  # K, V as 2 head slots: a cell of K|V's size
    with pytest.raises(ValueError, match=r"holds 2 heads; this rank has 4 KV heads"):
        w._geometry(packed, 2)


def test_the_direct_setting_is_checked_and_direct_true_fails_where_the_kv_cache_cannot_be_the_pool(world):
    agent = world.agent("p", "tcp")
    with pytest.raises(ValueError, match="kv_connector_extra_config.direct is 'sometimes', not auto, true or false"):
        Engine(world, agent, "prefill", seed=P_SEED, connector={"direct": "sometimes"})
    with pytest.raises(AgentError, match="direct is true, but the KV cache is in cpu memory"):
        Engine(world, agent, "prefill", seed=P_SEED, connector={"direct": True})
    staged = Engine(world, agent, "prefill", seed=P_SEED, connector={"direct": False})
    try:
        assert staged.worker.kv_path == ("staged", "turned off (kv_connector_extra_config.direct: false)")
    finally:
        staged.close()


def test_the_registered_geometry_is_what_the_pool_declares_where_vllm_cannot_tell(world):
    # The operator compares each PDEndpoint's geometry with its pool's declaration: fields the
    # connector cannot read from vLLM are taken from the declaration (an unset hybrid or
    # hostBuffer read false, a mismatch wherever a pool declares true), the rest from vLLM.
    agent = world.agent("p", "tcp")
    declared = {"model": "tiny-llama", "attentionBackend": "FLASH_ATTN", "hybrid": True, "hostBuffer": True}
    e = Engine(world, agent, "prefill", seed=P_SEED, connector={"kv": declared})
    try:
        reg = e.worker.registration
        kv = reg["kv"]
        assert {k: kv[k] for k in declared} == declared, kv
        import vllm

        assert kv["engineVersion"] == vllm.__version__, kv
        assert (kv["blockSize"], kv["kernelBlockSize"], kv["layout"]) == (16, 16, "NHD"), kv
        assert reg["parallelism"] == {"tensor": 1, "pipeline": 1, "data": 1}, reg["parallelism"]
        assert "pod_engines" not in reg, reg  # one engine, no data parallelism to count
    finally:
        e.close()


def test_each_rank_says_how_many_engines_its_pod_runs(world):
    # vLLM's data-parallel ranks of one group (an MoE model's) are engines of their own: a Pod
    # running two of four says 2 (data_parallel_size_local), so the operator tells a Pod one of
    # them never registered from a whole one. The agent takes it (and publishes it: e2e agent).
    from vllm.config import ParallelConfig

    from pdpair_vllm.connector import pod_engines

    agent = world.agent("d", "tcp")
    dp = {"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_rank": 1}
    e = Engine(world, agent, "decode", seed=D_SEED, tp=2, parallel=dp)
    try:
        assert e.config.parallel_config.distributed_executor_backend == "mp"
        for w in e.workers:
            reg = w.registration
            assert (reg["pod_engines"], reg["parallelism"]["data"]) == (2, 4), reg
    finally:
        e.close()
    # A dense model's ranks: vLLM's engine core makes each an engine of data parallelism 1
    # before the connector is made (what it then sees): not said, as with none at all.
    dense = ParallelConfig(**dp)
    dense.reconfigure_for_independent_dp_rank()
    assert pod_engines(dense) is None
    assert pod_engines(ParallelConfig()) is None
    # External load balancing starts one engine a Pod.
    external = ParallelConfig(data_parallel_size=4, data_parallel_external_lb=True, data_parallel_rank=3)
    assert pod_engines(external) == 1
    # Not said where Ray places ranks or workers over the cluster, an external launcher runs
    # them, or an engine spans nodes.
    for field, value in [("data_parallel_backend", "ray"), ("distributed_executor_backend", "ray"),
                         ("distributed_executor_backend", "external_launcher"), ("nnodes", 4)]:
        config = ParallelConfig(**dp)
        config.distributed_executor_backend = "mp"
        assert pod_engines(config) == 2
        setattr(config, field, value)
        assert pod_engines(config) is None, (field, value)


@pytest.mark.parametrize("mode,p_block,d_block", [("Push", 16, 16), ("Pull", 16, 32)])
def test_a_prefix_hit_on_decode_receives_only_the_missing_tail(world, mode, p_block, d_block):
    pa, da = world.agent("p"), world.agent("d")
    p = Engine(world, pa, "prefill", seed=P_SEED, mode=mode, block_size=p_block)
    d = Engine(world, da, "decode", seed=D_SEED, mode=mode, block_size=d_block)
    try:
        # 32 tokens D computed itself for an earlier request, then 50 with them as a prefix:
        # vLLM's own prefix cache gave D the first 32; only 32.. came from P.
        seeds = receive_after_a_local_prefix(p, d, list(range(500, 532)), list(range(600, 618)))
        assert seeds == [D_SEED] * 32 + [P_SEED] * 18, seeds
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", ["Push", "Pull"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_caches_of_smaller_kernel_blocks_than_vllms_move_the_right_blocks(pair, mode, layout):
    # An attention backend may take a kernel block smaller than vLLM's block size (FlashInfer
    # on most GPUs with --block-size 128, say): each of vLLM's blocks is then several kernel
    # blocks in the KV tensors. Only the workers can tell (the scheduler never sees the
    # tensors); logical ids taken for kernel ones moved other blocks, half the tokens, checksums
    # and all, and wrote into other requests' KV on decode.
    p, d = pair(mode=mode, layout=layout, block_size=32, kernel_block_size=16)
    kv = d.workers[0].registration["kv"]
    assert (kv["blockSize"], kv["kernelBlockSize"]) == (32, 16), kv
    # One block D computed itself for an earlier request, then 82 tokens: 2 full blocks and a
    # partial one.
    seeds = receive_after_a_local_prefix(p, d, list(range(2000, 2032)), list(range(2100, 2150)))
    assert seeds == [D_SEED] * 32 + [P_SEED] * 50, seeds


def test_a_full_hit_on_decode_releases_prefill_without_a_failure(pair):
    p, d = pair(min_transfer_tokens=16)
    prompt = list(range(700, 749))  # 49 tokens: D will hold 48 of them
    d.add("local", prompt, max_tokens=1)
    d.run_until(lambda: "local" in d.outputs, what="the local request")
    params = prefill(p, "req", prompt)
    d.add("req", prompt, params, max_tokens=2)
    both(p, d, lambda: "req" in d.outputs and p.status("req") is None, what="D done, P freed")
    assert p.outcome("req") == "Released", p.outcome("req")
    assert not any(o.finished_recving for o in d.transfer_events), "nothing was received"


def test_a_decode_prompt_past_prefills_partial_last_block_keeps_no_stale_kv(pair):
    # A client handing D prompt X+Y with the params of P's prompt X, X not whole blocks: the
    # digests agree (D's covers X's length). A vLLM that took every received block as computed,
    # whole, would have kept whatever X's last block held before in its rest (Y's first tokens)
    # and cached it under X+Y (from a review). vLLM 0.33 counts the tokens said: D receives X's
    # 90 and computes the rest; no position holds anything else.
    p, d = pair()
    assert d.scheduler.connector._sched.whole_blocks is False, "vLLM 0.33 counts the tokens said"
    x = list(range(9600, 9690))  # 90 tokens: 5 blocks of 16 and 10
    params = prefill(p, "x", x)
    y = x + list(range(9700, 9720))
    req = d.add("xy", y, dict(params), max_tokens=3)
    both(p, d, lambda: len(req.output_token_ids) >= 1, what="D received X and computed the rest")
    assert d.kv_seeds("xy", 0, len(y), [P_SEED, D_SEED]) == [P_SEED] * len(x) + [D_SEED] * (len(y) - len(x))
    both(p, d, lambda: p.status("x") is None, what="P freed X's blocks")
    assert p.outcome("x") == "RequestDone"


def test_a_full_hit_releases_every_prefill_rank_for_every_decode_rank_it_serves(world):
    # Decode with more tensor-parallel ranks than prefill: each prefill rank serves two decode
    # ranks and waits for both; only decode's rank 0 released, so prefill held its blocks to
    # the lease (LeaseExpired) on every full prefix hit.
    pa, da = world.agent("p", "shm"), world.agent("d", "shm")
    p = Engine(world, pa, "prefill", seed=P_SEED, tp=2, layout="HND")
    d = Engine(world, da, "decode", seed=D_SEED, tp=4, layout="HND", min_transfer_tokens=16)
    try:
        # Each engine's ranks register under their own names and name their one engine (the
        # operator counts a Pod's engines' ranks each on its own).
        for e, tp in [(p, 2), (d, 4)]:
            regs = [w.registration for w in e.workers]
            assert len({r["engine"] for r in regs}) == tp and [r["tensor_rank"] for r in regs] == list(range(tp))
            assert len({r["instance"] for r in regs}) == 1, [r["instance"] for r in regs]
        assert p.workers[0].registration["instance"] != d.workers[0].registration["instance"]
        prompt = list(range(800, 849))  # 49 tokens: D will hold 48 of them
        d.add("local", prompt, max_tokens=1)
        d.run_until(lambda: "local" in d.outputs, what="the local request")
        params = prefill(p, "req", prompt)
        d.add("req", prompt, params, max_tokens=2)
        both(p, d, lambda: "req" in d.outputs and p.status("req") is None, timeout=20, what="D done, P freed")
        assert p.outcome("req") == "Released", p.outcome("req")
    finally:
        p.close()
        d.close()


def test_an_abort_before_decode_allocated_releases_prefill(pair):
    p, d = pair()
    prompt = list(range(800, 840))
    params = prefill(p, "req", prompt)
    d.add("req", prompt, params)
    d.abort("req")  # before any step: vLLM never allocated it
    both(p, d, lambda: p.status("req") is None, what="P freed the blocks")
    assert p.outcome("req") == "Released"


def test_an_abort_while_kv_is_on_its_way_holds_decodes_blocks_until_cancelled(pair):
    p, d = pair()
    prompt = list(range(900, 1000))
    params = prefill(p, "req", prompt)
    d.add("req", prompt, params)
    d.step()
    assert d.status("req") == "WAITING_FOR_REMOTE_KVS"
    blocks = d.blocks("req")
    d.abort("req")
    # vLLM keeps the request (and its blocks) until the connector says the cancel is answered.
    assert d.status("req") == "FINISHED_ABORTED", d.status("req")
    both(p, d, lambda: d.status("req") is None, what="D freed the blocks after Cancelled")
    assert d.outcome("req") == "Cancelled"
    assert blocks, "the request had blocks"
    both(p, d, lambda: p.status("req") is None, what="P freed the blocks")


def test_an_abort_in_the_step_its_kv_landed_frees_decodes_blocks_and_decode_goes_on(pair):
    # vLLM's engine core takes the aborts that came during a step before it reads the step's
    # output, so an abort can find the request still waiting for its KV while the workers have
    # just reported it received. The connector must then report the request once (received),
    # not also the cancel's end: vLLM's scheduler asserts on a request it no longer has.
    from pdpair_vllm.connector import vllm_holds_aborted_receives

    assert vllm_holds_aborted_receives(), "vLLM 0.33 holds them itself"
    p, d = pair()
    prompt = list(range(1100, 1200))
    params = prefill(p, "req", prompt)
    d.add("req", prompt, params)
    free = d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    landed = []

    def abort_as_it_lands(out):
        if not landed and out is not None and "req" in (out.finished_recving or ()):
            assert d.status("req") == "WAITING_FOR_REMOTE_KVS", d.status("req")
            d.abort("req")
            landed.append(True)

    deadline = time.monotonic() + 30
    while not landed:
        assert time.monotonic() < deadline, "the KV did not land in 30 s"
        p.step()
        d.step(aborts_during=abort_as_it_lands)
        time.sleep(0.002)
    assert d.status("req") is None, "vLLM freed the request as its KV was reported in"
    for _ in range(5):  # the cancel's answer, if any, comes in these steps
        p.step()
        d.step()
        time.sleep(0.01)
    assert d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    both(p, d, lambda: p.status("req") is None, what="P freed the blocks")
    # Decode still serves.
    prompt = list(range(1200, 1300))
    seeds = decode_receives(p, d, "next", prompt, prefill(p, "next", prompt))
    assert seeds == [P_SEED] * len(prompt)


def test_a_vllm_whose_scheduler_source_cannot_be_read_is_answered_as_measured_for_its_release(monkeypatch):
    # An image of .pyc files only: the connector cannot read what vLLM's scheduler does. On
    # 0.33, where the answers were read, guessing "vLLM does not hold an aborted request's
    # blocks" brings back the crash of the test above (an abort in the step its KV landed).
    import pdpair_vllm.connector as c

    questions = ("holds_aborted_receives", "counts_received_blocks_whole")

    def answers():
        return (c.vllm_holds_aborted_receives(), c.vllm_counts_received_blocks_whole())

    release = c._vllm_release()
    assert release == (0, 33), release
    # Releases only: a development or pre-release build may hold later scheduler changes.
    assert [c._release_of(v) for v in ("0.33.0", "0.33.1+cu129", "0.33.2.post1", "0.34.0+cpu", "0.33.0+rocm634")] == [
        (0, 33), (0, 33), (0, 33), (0, 34), (0, 33)]
    assert [c._release_of(v) for v in ("0.33.1.dev5+g1234abc", "0.34.0rc1", "0.33", "x")] == [None] * 4
    read = answers()
    # The table says what this vLLM's own source says.
    assert read == tuple(c.MEASURED_SCHEDULERS[release][q] for q in questions) == (True, False)

    def unreadable(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(c.inspect, "getsource", unreadable)
    assert answers() == read, "a measured release is answered as its source said"
    for other in [(0, 31), (0, 34), None]:
        monkeypatch.setattr(c, "_vllm_release", lambda other=other: other)
        assert answers() == (False, True), f"release {other}: the safe guesses"


def test_a_request_decodes_frontend_rejected_releases_prefill_at_once(pair):
    # vLLM's frontend that rejects a request before its engine takes it (a prompt longer than
    # decode's max_model_len, say) submits a stand-in of prompt [0] with the request's params,
    # aborted at once (AsyncLLM.notify_kv_transfer_request_rejected, EngineCore.add_request).
    # Its Release names the stand-in's prompt, which P's agent does not count: P held the
    # request's blocks to its lease (30 s). The release token in P's params makes it count.
    p, d = pair()
    prompt = list(range(900, 940))
    params = prefill(p, "req", prompt)
    assert len(params["pdpair_release_token"]) == 64, params
    d.add("req", [0], dict(params))
    d.abort("req")
    both(p, d, lambda: p.status("req") is None, timeout=10, what="P freed the blocks")
    assert p.outcome("req") == "Released", p.outcome("req")


def test_a_copy_of_a_requests_params_aborted_while_queued_does_not_end_its_transfer(pair):
    # A client (or a proxy retrying) sends D a second request with the same kv_transfer_params
    # and aborts it before D allocates it: its Release of P's id went to the agent, whose
    # refusal (that id is expected already) ended the first request's receive here; vLLM freed
    # its blocks while its KV was still being written into them.
    p, d = pair()
    prompt = list(range(1300, 1350))
    params = prefill(p, "req", prompt)
    copy = dict(params)
    d.add("req", prompt, params, max_tokens=2)
    d.step()
    assert d.status("req") == "WAITING_FOR_REMOTE_KVS"
    d.add("again", prompt, copy)
    d.abort("again")  # before D allocated it: a Release of P's id
    both(p, d, lambda: received(d, "req"), what="KV received on decode")
    assert d.outcome("req") == "RequestDone", d.outcome("req")
    assert d.kv_seeds("req", 0, len(prompt), [P_SEED, D_SEED]) == [P_SEED] * len(prompt)
    d.run_until(lambda: "req" in d.outputs, what="decode finished")
    both(p, d, lambda: p.status("req") is None, what="P freed the blocks")


def test_a_mismatched_prefill_is_refused_and_decode_recomputes_then_serves_a_good_one(world):
    pa, qa, da = world.agent("p"), world.agent("q"), world.agent("d")
    wrong = Engine(world, pa, "prefill", seed=P_SEED, layout="HND")
    good = Engine(world, qa, "prefill", seed=P_SEED)
    d = Engine(world, da, "decode", seed=D_SEED, policy="recompute")
    try:
        prompt = list(range(40))
        params = prefill(wrong, "bad", prompt)
        d.add("bad", prompt, params)
        both(wrong, d, lambda: "bad" in d.outputs, what="D finished the refused request")
        assert any("bad" in o.failed_recving for o in d.transfer_events)
        failures = d.worker._worker.outcomes
        assert failures["bad"] == "RequestFailed"
        # vLLM recomputed every token itself.
        assert d.outputs["bad"].new_token_ids[-1] == SAMPLED
        other = list(range(2000, 2040))  # not in D's prefix cache
        params = prefill(good, "ok", other)
        seeds = decode_receives(good, d, "ok", other, params)
        assert seeds == [P_SEED] * 40
    finally:
        for e in (wrong, good, d):
            e.close()


def test_a_client_that_pairs_another_prompts_params_gets_no_kv_and_decode_computes_its_own(world, caplog):
    # kv_transfer_params come from the client: one that hands D prompt Y with the params of P's
    # prompt X would have D take X's KV as Y's, and cache it under Y's blocks for every later
    # request of Y. The agents compare the engines' prompt digests first: D computes Y itself.
    pa, da = world.agent("p"), world.agent("d")
    p = Engine(world, pa, "prefill", seed=P_SEED)
    d = Engine(world, da, "decode", seed=D_SEED, policy="recompute")
    try:
        x, y = list(range(3000, 3040)), list(range(4000, 4040))  # same length: the token counts agree
        params = prefill(p, "x", x)
        req = d.add("y", y, dict(params), max_tokens=3)  # a copy: D marks the params it took
        both(p, d, lambda: len(req.output_token_ids) >= 1, what="D computed its prompt")
        assert any("y" in o.failed_recving for o in d.transfer_events), "the receive failed"
        assert d.outcome("y") == "RequestFailed" and "PromptMismatch" in caplog.text
        assert d.kv_seeds("y", 0, len(y), [P_SEED, D_SEED]) == [D_SEED] * len(y), "none of X's KV in Y's blocks"
        # X's own request, on the same decode engine, still gets X's KV: the wrong pairing did
        # not end it for P.
        assert decode_receives(p, d, "x", x, params) == [P_SEED] * len(x)
        both(p, d, lambda: p.status("x") is None, what="P freed X's blocks")
        assert p.outcome("x") == "RequestDone"
    finally:
        for e in (p, d):
            e.close()


def test_lost_agents_end_the_transfers_in_flight_and_both_engines_go_on(world):
    # Agents restarting (a DaemonSet rollout) or dying: D's request waiting for its KV and P's
    # blocks held for D waited forever, and the next message to the agent raised into the step.
    pa, da = world.agent("p"), world.agent("d")
    p = Engine(world, pa, "prefill", seed=P_SEED)
    d = Engine(world, da, "decode", seed=D_SEED, policy="recompute")
    try:
        held = prefill(p, "x", list(range(5000, 5040)))  # P holds x's blocks; no D asks for them
        waiting = dict(held, pdpair_request="nobody-computes-this")  # D waits for KV never ready
        y = list(range(6000, 6040))
        d.add("y", y, waiting, max_tokens=2)
        both(p, d, lambda: d.worker._worker._open, what="D asked its agent")
        pa.kill()
        da.kill()
        both(p, d, lambda: "y" in d.outputs and p.status("x") is None, what="both engines gave up the transfers")
        assert any("y" in o.failed_recving for o in d.transfer_events)
        assert d.outputs["y"].new_token_ids[-1] == SAMPLED, "D computed y itself"
        assert d.outcome("y") == p.outcome("x") == "RequestFailed"
        # Later requests do not reach the agents: computed locally, and the steps do not raise.
        z = list(range(7000, 7040))
        d.add("z", z, held)
        p.add("w", list(range(8000, 8040)), {"do_remote_decode": True})
        both(p, d, lambda: "z" in d.outputs and "w" in p.outputs and p.status("w") is None,
             what="requests after the loss")
        assert d.outputs["z"].new_token_ids[-1] == SAMPLED
    finally:
        for e in (p, d):
            e.close()


def test_an_engine_whose_agent_is_not_up_yet_starts_and_registers_once_it_answers(world, caplog):
    # An agent restarting in a rollout, or not ready yet on a new node, when an engine reaches
    # register_kv_caches (its model loaded): the engine raised there and crash-looped, loading
    # its model again each time. It starts, and registers once the agent answers.
    decode_starts_before_its_agent_serves(world, caplog, lambda: world.agent("d"), "cannot reach its agent")


def decode_starts_before_its_agent_serves(world, caplog, serve, logged: str):
    """A decode engine whose rank finds no agent serving at ``world.dir / "d.sock"`` (``serve``
    then starts one there) starts, saying ``logged``, and receives a request's KV once its
    agent serves."""
    import types

    p = Engine(world, world.agent("p"), "prefill", seed=P_SEED)
    later = types.SimpleNamespace(socket=str(world.dir / "d.sock"))
    with caplog.at_level("WARNING", logger="pdpair_vllm"):
        d = Engine(world, later, "decode", seed=D_SEED, start_agent=serve)
    try:
        assert logged in caplog.text, caplog.text
        prompt = list(range(9000, 9050))
        assert decode_receives(p, d, "req", prompt, prefill(p, "req", prompt)) == [P_SEED] * 50
    finally:
        p.close()
        d.close()


def test_an_engine_whose_agent_accepts_and_closes_starts_and_registers_once_it_serves(world, caplog):
    # An agent shutting down in a rollout accepts the engine's connection and closes it (one
    # not serving yet leaves it unanswered): the engine raised in register_kv_caches and
    # crash-looped, loading its model again each time, as with no agent at all.
    import socket
    import threading

    path = world.dir / "d.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    listener.settimeout(0.05)
    stop = threading.Event()

    def closing():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.close()

    server = threading.Thread(target=closing, daemon=True)
    server.start()

    def serve():
        stop.set()
        server.join()
        listener.close()
        path.unlink()
        world.agent("d")

    decode_starts_before_its_agent_serves(world, caplog, serve, "cannot reach its agent (asking the agent at")


def test_engines_register_again_with_restarted_agents_and_their_kv_moves_again(world):
    # A DaemonSet rollout restarts every agent under running engines: each rank registers again
    # once its transfers ended, with no step (idle engines take none); a prefill rank's agent
    # listens where it did where it can, and where its port was taken meanwhile, P's scheduler
    # hands D the new address. Before, no KV moved on either engine until both were restarted.
    import socket

    p = Engine(world, world.agent("p"), "prefill", seed=P_SEED, tp=2)
    d = Engine(world, world.agent("d"), "decode", seed=D_SEED, policy="recompute", tp=2)
    try:
        before = [w._client.address for w in p.workers]
        prompt = list(range(3000, 3040))
        assert decode_receives(p, d, "before", prompt, prefill(p, "before", prompt)) == [P_SEED] * 40
        for a in world.agents:
            a.kill()
        # Requests meanwhile are computed locally, and nothing raises into the steps.
        d.add("meanwhile", list(range(4000, 4040)), prefill(p, "meanwhile", list(range(4000, 4040))))
        both(p, d, lambda: "meanwhile" in d.outputs, what="a request while the agents are down")
        assert d.outcome("meanwhile") is None or d.outcome("meanwhile") == "RequestFailed"
        # Rank 1's port is someone else's by the time the agent is back.
        taken = socket.socket()
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", int(before[1].rsplit(":", 1)[1])))
        taken.listen()
        world.agent("p")
        world.agent("d")  # the same sockets
        workers = p.workers + d.workers
        deadline = time.monotonic() + 30
        while not all(w._worker.reconnections == 1 for w in workers):  # idle engines: no steps
            assert time.monotonic() < deadline, "every rank registered again"
            time.sleep(0.01)
        after = [w._client.address for w in p.workers]
        assert after[0] == before[0] and after[1] not in before, (before, after)
        # An idle engine takes no step: the first request's own output brings rank 1's new
        # address to P's scheduler, which vLLM reads after it ended the request (its
        # update_from_output frees finished requests first). That one is handed out under the
        # old address, not offered, and computed on decode.
        bridge = list(range(4500, 4540))
        params = prefill(p, "bridge", bridge)
        assert params["pdpair_prefill_ranks"] == before, "handed out before the new address was read"
        d.add("bridge", bridge, params)
        both(p, d, lambda: "bridge" in d.outputs, what="the request handed out under the old address")
        assert d.outcome("bridge") == "RequestFailed", d.outcome("bridge")
        params = prefill(p, "after", list(range(5000, 5040)))
        assert params["pdpair_prefill_ranks"] == after, "D is told the new address"
        assert params[PARAM_HOLD] == 330.0, "and each rank's hold, as its agent says again"
        taken.close()
        assert decode_receives(p, d, "after", list(range(5000, 5040)), params) == [P_SEED] * 40
        assert d.outcome("after") == "RequestDone"
    finally:
        for e in (p, d):
            e.close()


def test_the_connector_binds_what_vllms_prefix_cache_keys_and_refuses_what_it_cannot_bind():
    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    from pdpair_vllm.connector import _prompt

    tokens = list(range(40))

    def digest(**kw):
        req = Request("r", tokens, SamplingParams(max_tokens=1), None, **kw)
        prompt = _prompt(req)
        return prompt.unbound or prompt.digest(len(tokens))

    def image(identifier, offset=4):
        return [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                      mm_position=PlaceholderRange(offset=offset, length=8))]

    plain = digest()
    others = [digest(cache_salt="tenant-a"), digest(lora_request=LoRARequest("a", 1, "/adapters/a")),
              digest(mm_features=image("img-1")), digest(mm_features=image("img-2")),
              digest(mm_features=image("img-1", offset=5))]
    assert len({plain, *others}) == 6, "each changes the digest"
    assert digest(cache_salt="tenant-a") == others[0], "and the same request gives the same"
    assert "embeddings" in digest(prompt_embeds=torch.zeros(40, 8))

    class Older:  # a Request that does not say what else its KV depends on
        all_token_ids = tokens
        lora_request = cache_salt = None

    assert "mm_features, prompt_embeds" in _prompt(Older()).unbound


def test_fail_closed_reports_a_corrupted_byte_as_load_errors_and_vllm_fails_the_request(pair):
    p, d = pair(p_extra=("--corrupt-one-byte",))
    prompt = list(range(1000, 1040))
    params = prefill(p, "req", prompt)
    d.add("req", prompt, params)
    both(p, d, lambda: "req" in d.outputs, what="D gave up the request")
    errors = set().union(*(o.invalid_block_ids for o in d.transfer_events))
    assert errors and errors <= set(d.blocks("req") or errors), errors
    assert d.outputs["req"].finish_reason is not None
    assert str(d.outputs["req"].finish_reason).lower().endswith("error"), d.outputs["req"].finish_reason


def test_an_expired_lease_frees_prefill_and_decode_recomputes(world):
    pa, da = world.agent("p"), world.agent("d")
    p = Engine(world, pa, "prefill", seed=P_SEED, lease_ms=300, handshake_ms=1000)
    d = Engine(world, da, "decode", seed=D_SEED, lease_ms=300, handshake_ms=1000, policy="recompute")
    try:
        prompt = list(range(1100, 1140))
        params = prefill(p, "req", prompt)
        p.run_until(lambda: p.status("req") is None, what="P's lease ended")
        assert p.outcome("req") == "RequestFailed"
        d.add("req", prompt, params)
        both(p, d, lambda: "req" in d.outputs, what="D recomputed")
        assert any("req" in o.failed_recving for o in d.transfer_events)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("layout", ["HND", "LBHNC"])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_tensor_parallel_ranks_each_gather_their_heads_and_vllm_aggregates_them(world, p_tp, d_tp, layout):
    # HND on prefill (the rule table's requirement for unequal TP); 4 KV heads.
    pa, da = world.agent("p", "shm"), world.agent("d", "shm")
    p = Engine(world, pa, "prefill", seed=P_SEED, tp=p_tp, layout=layout)
    d = Engine(world, da, "decode", seed=D_SEED, tp=d_tp, layout=layout)
    try:
        prompt = list(range(3000, 3050))
        params = prefill(p, "req", prompt)
        assert len(params["pdpair_prefill_ranks"]) == p_tp, params
        seeds = decode_receives(p, d, "req", prompt, params)
        assert seeds == [P_SEED] * 50, seeds
        d.run_until(lambda: "req" in d.outputs, what="decode finished")
        both(p, d, lambda: p.status("req") is None, what="every P rank freed its blocks")
    finally:
        p.close()
        d.close()


def test_a_request_decode_queues_for_blocks_is_renewed_and_still_arrives(world):
    # D has 5 blocks; "hog" holds 4 of them waiting for KV that never comes, so "req" (3 blocks)
    # waits in vLLM's queue for longer than P's 0.5 s lease: D renews it, P keeps its blocks.
    pa, qa, da = world.agent("p"), world.agent("q"), world.agent("d")
    p = Engine(world, pa, "prefill", seed=P_SEED, lease_ms=500)
    q = Engine(world, qa, "prefill", seed=P_SEED)  # holds hog's registration for its 30 s lease
    d = Engine(world, da, "decode", seed=D_SEED, lease_ms=500, num_blocks=5)
    try:
        prompt = list(range(4000, 4040))
        params = prefill(p, "req", prompt)
        ghost = {"do_remote_prefill": True, "pdpair_request": "never-ready",
                 "pdpair_prefill_ranks": [q.worker._client.address], "pdpair_num_tokens": 64}
        d.add("hog", list(range(5000, 5064)), ghost)
        d.add("req", prompt, params)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            p.step()
            d.step()
            time.sleep(0.01)
        assert d.status("hog") == "WAITING_FOR_REMOTE_KVS"
        assert d.status("req") == "WAITING", "no blocks for it yet"
        assert p.status("req") is not None and p.outcome("req") is None, "P still holds it after 4 leases"
        d.abort("hog")  # Cancel: its blocks come back once the agent answers
        seeds = decode_receives_queued(p, d, "req", len(prompt))
        assert seeds == [P_SEED] * 40, seeds
        assert d.outcome("hog") == "Cancelled"
    finally:
        for e in (p, q, d):
            e.close()


def test_a_request_waiting_behind_full_run_slots_is_renewed_from_its_arrival(world):
    # D's two run slots are taken by requests decoding on, so vLLM never asks the connector
    # about "req" (it skips matching while every slot is taken) for longer than P's 0.5 s lease:
    # D renews it from its arrival, P keeps its blocks, and once a slot frees its KV arrives.
    pa, da = world.agent("p"), world.agent("d")
    p = Engine(world, pa, "prefill", seed=P_SEED, lease_ms=500)
    d = Engine(world, da, "decode", seed=D_SEED, lease_ms=500, max_num_seqs=2, num_blocks=256)
    try:
        prompt = list(range(4000, 4040))
        params = prefill(p, "req", prompt)
        for busy in ("busy-0", "busy-1"):
            d.add(busy, list(range(6000, 6016)), max_tokens=100_000)
        for _ in range(3):
            d.step()
        assert d.status("busy-0") == d.status("busy-1") == "RUNNING"
        d.add("req", prompt, params)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            p.step()
            d.step()
            time.sleep(0.01)
        assert d.status("req") == "WAITING", "no run slot for it yet"
        assert p.status("req") is not None and p.outcome("req") is None, "P still holds it after 4 leases"
        d.abort("busy-0")
        d.abort("busy-1")
        seeds = decode_receives_queued(p, d, "req", len(prompt))
        assert seeds == [P_SEED] * 40, seeds
    finally:
        p.close()
        d.close()


def decode_receives_queued(p: Engine, d: Engine, request: str, tokens: int):
    seen = {}

    def arrived():
        if received(d, request) and "seeds" not in seen:
            seen["seeds"] = d.kv_seeds(request, 0, tokens, [P_SEED, D_SEED])
        return "seeds" in seen

    both(p, d, arrived, what="the queued request's KV received")
    return seen["seeds"]


@pytest.mark.parametrize("setting", ["pipeline_parallel_size", "decode_context_parallel_size",
                                     "prefill_context_parallel_size"])
def test_parallelism_pdpair_does_not_move_kv_for_is_refused_at_startup_naming_it(setting):
    # Each stage (pipeline) or rank (context parallel) holds only part of a block's KV: paired
    # block for block with an engine that holds all of it, KV would move silently wrong.
    from vllm.config import ParallelConfig

    from pdpair_vllm.connector import check_parallelism

    check_parallelism(ParallelConfig(tensor_parallel_size=2))
    kw = {setting: 2, "tensor_parallel_size": 2}
    with pytest.raises(ValueError, match=f"pdpair: {setting} is 2; pdpair moves KV with tensor parallelism only"):
        check_parallelism(ParallelConfig(**kw))


def test_the_connector_refuses_unsupported_parallelism_when_vllm_builds_it(world):
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdpair_vllm.connector import PdpairConnector

    e = Engine(world, world.agent("p"), "prefill", seed=P_SEED)
    try:
        cfg = copy.copy(e.config)
        cfg.parallel_config = copy.copy(cfg.parallel_config)
        cfg.parallel_config.decode_context_parallel_size = 2
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match="decode_context_parallel_size is 2"):
                PdpairConnector(cfg, role, e.kv_cache_config)
    finally:
        e.close()


def test_a_decode_engine_hands_out_no_address_when_a_client_asks_it_for_remote_decode(pair, caplog):
    # Decode engines dial out: their agent gave them their host as an "address", which vLLM's
    # scheduler then handed to clients as a prefill rank no prefill listened at.
    p, d = pair()
    assert d.scheduler.connector._sched.prefill_ranks == {}, "a decode engine has no address"
    assert p.scheduler.connector._sched.prefill_ranks, "a prefill engine has"
    d.add("x", list(range(9000, 9040)), {"do_remote_decode": True})
    d.run_until(lambda: "x" in d.outputs and d.status("x") is None, what="x done and its blocks free")
    assert d.outputs["x"].kv_transfer_params is None
    assert "0 of this engine's 1 prefill ranks are registered" in caplog.text


def test_kv_transfer_params_that_are_not_an_object_are_ignored_not_fatal(pair, caplog):
    # A client may put anything in kv_transfer_params (vLLM passes vllm_xargs' strings, numbers
    # and lists through): their first use raised inside the scheduler's step and ended the engine.
    p, d = pair()
    for i, params in enumerate(["x", 1, [1], True]):
        for e in (p, d):
            e.add(f"odd{i}", list(range(9300 + 40 * i, 9340 + 40 * i)), params)
            e.run_until(lambda: f"odd{i}" in e.outputs and e.status(f"odd{i}") is None,
                        what=f"odd{i} computed locally and its blocks free")
            assert e.outputs[f"odd{i}"].kv_transfer_params is None
    assert caplog.text.count("not an object") >= 8, caplog.text
    # Both engines go on: KV still moves.
    prompt = list(range(9500, 9550))
    seeds = decode_receives(p, d, "next", prompt, prefill(p, "next", prompt))
    assert seeds == [P_SEED] * len(prompt)


def test_a_clients_ranks_cannot_make_decodes_frame_too_long_for_its_agent(pair):
    # kv_transfer_params come from a client. 1024 ranks of 250 bytes made an ExpectKvFromPool
    # over the agent's bound on a registered engine's frame (128 KiB and the pool's block ids):
    # the agent ended the rank's connection, every transfer of the rank with it, at will.
    # Ranks are ip:port now (the agent takes nothing else): 1024 of the longest fit.
    p, d = pair(policy="recompute")
    workers = [w._worker for w in d.workers]
    junk = [f"{i:04d}" + "x" * 246 for i in range(1024)]
    prompt = list(range(9100, 9150))
    d.add("junk", prompt, {"do_remote_prefill": True, "pdpair_request": "p-junk", "pdpair_prefill_ranks": junk,
                           "pdpair_num_tokens": 50})
    d.run_until(lambda: "junk" in d.outputs, what="junk computed locally")
    # The longest addresses the agent could take, all link-local (which it refuses): the frame
    # reaches it whole, and it answers the request alone.
    longest = [f"[fe80:1111:2222:3333:4444:5555:6666:{i:04x}]:65535" for i in range(1024)]
    assert {len(a) for a in longest} == {47}
    d.add("longest", prompt, {"do_remote_prefill": True, "pdpair_request": "p-longest",
                              "pdpair_prefill_ranks": longest, "pdpair_num_tokens": 50})
    d.run_until(lambda: "longest" in d.outputs, what="longest refused by the agent and computed locally")
    assert d.worker._worker.outcomes.get("longest") == "RequestFailed", d.worker._worker.outcomes
    assert all(w.lost is None and w.reconnections == 0 for w in workers), [(w.lost, w.reconnections) for w in workers]
    # The rank's connection stood: KV still moves on it.
    prompt = list(range(9200, 9250))
    seeds = decode_receives(p, d, "next", prompt, prefill(p, "next", prompt))
    assert seeds == [P_SEED] * len(prompt)
    assert all(w.lost is None and w.reconnections == 0 for w in workers)
