"""The package's engine-API client, layout and pattern against real agents: transfers between
Python engines, and between a Python engine and the agent's own Rust synthetic engine both ways
(so the Python layout and framing are checked against the agent's on the same inputs)."""

from __future__ import annotations

import subprocess
import time

import pytest

from pdpair_vllm import synthetic
from pdpair_vllm.client import AgentBusy, AgentClient, AgentError, registration
from pdpair_vllm.layout import LayoutError, PoolLayout

from conftest import kv, rust_engine, rust_result

SETTINGS = {"handshake_timeout_ms": 5000, "lease_ms": 30000}


def py_engine(world, agent, role, geometry, *, mode="Push", checksum="FailClosed", tp=1, rank=0,
              num_blocks=16, lease_ms=30000, engine=None, key=None, arrangement=None, regions=None,
              handshake_timeout_ms=5000) -> AgentClient:
    reg = registration(
        pdpair="default/pair", role=role, engine=engine or f"py-{role}-{rank}", kv=geometry,
        num_blocks=num_blocks, pairing_key=key or world.key, tensor=tp, tensor_rank=rank, mode=mode,
        checksum=checksum, handshake_timeout_ms=handshake_timeout_ms, lease_ms=lease_ms, kv_arrangement=arrangement,
        regions=[r if isinstance(r, dict) else {"layers": r[0], "kv_arrangement": r[1]} if r[1] else {"layers": r[0]}
                 for r in regions] if regions else None,
    )
    return AgentClient.register(agent.socket, reg)


def decode_takes(dd: AgentClient, rp, addr: str, request: str, blocks, num_tokens: int, seed: int) -> None:
    """The Python decode ``dd`` takes ``request`` from the Rust prefill ``rp`` (at ``addr``) into
    ``blocks``, cleared first: checksums Verified, every byte of the pattern ``seed`` checked with
    Python's layout, and the Rust engine saw it done."""
    synthetic.clear(dd.pools, dd.layout, blocks)
    dd.expect_kv(request, [addr], blocks, num_tokens)
    event = dd.wait(request)
    assert event.type == "RequestDone" and event.raw["checksum"] == "Verified", event.raw
    assert synthetic.verify(dd.pools, dd.layout, seed, blocks, 0, num_tokens) == 0
    assert rust_result(rp)["type"] == "RequestDone"


@pytest.mark.parametrize("mode", ["Push", "Pull"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_python_prefill_to_rust_decode_and_back_byte_exact(world, mode, transport):
    g = kv(block=16)
    manifest = world.manifest(mode, "FailClosed", g, g)
    pa, da = world.agent("p", transport), world.agent("d", transport)
    # Python prefill -> Rust decode (the agent's engine checks every byte with its own layout).
    p = py_engine(world, pa, "prefill", g, mode=mode)
    synthetic.fill(p.pool, p.layout, 11, [3, 1, 4], 0, 40)
    p.kv_ready("r1", [3, 1, 4], 40)
    d, _ = rust_engine(world, da, manifest, "decode", request="r1", blocks=[5, 9, 2], num_tokens=40, seed=11,
                       prefill=[p.address])
    got = rust_result(d)
    assert got["type"] == "RequestDone" and got["checksum"] == "Verified", got
    assert got["bad_tokens"] == 0
    assert p.wait("r1").type == "RequestDone"
    # Rust prefill -> Python decode (Python checks every byte with its layout and pattern).
    rp, addr = rust_engine(world, pa, manifest, "prefill", request="r2", blocks=[0, 2, 7], num_tokens=37, seed=12)
    dd = py_engine(world, da, "decode", g, mode=mode)
    decode_takes(dd, rp, addr, "r2", [6, 4, 1], 37, 12)
    # The pattern check itself sees a wrong byte.
    dd.pool[dd.layout.block_offset(1, True, 4)[1] + 3] ^= 0xFF
    assert synthetic.verify(dd.pool, dd.layout, 12, [6, 4, 1], 0, 37) == 1


@pytest.mark.parametrize("mode", ["Push", "Pull"])
def test_k_and_v_interleaved_per_block_flashinfer_style_moves_byte_exact_both_ways(world, mode):
    # FlashInfer keeps each block's K then V ([num_blocks, 2, ...]); the agent reads and writes
    # such a pool through the same description, against a K-then-V pool on the other side.
    g = kv(block=16)
    manifest = world.manifest(mode, "FailClosed", g, g)
    pa, da = world.agent("p"), world.agent("d")
    p = py_engine(world, pa, "prefill", g, mode=mode, arrangement="BlocksFirst")
    assert p.layout.block_offset(0, True, 3)[1] == p.layout.block_offset(0, False, 3)[1] + p.layout.block_len
    synthetic.fill(p.pool, p.layout, 61, [2, 3, 4, 9], 0, 60)
    p.kv_ready("fi", [2, 3, 4, 9], 60)
    d, _ = rust_engine(world, da, manifest, "decode", request="fi", blocks=[0, 1, 2, 3], num_tokens=60, seed=61,
                       prefill=[p.address])
    got = rust_result(d)
    assert got["type"] == "RequestDone" and got["bad_tokens"] == 0, got
    # The Rust engine interleaved, a Python K-then-V decode.
    rp, addr = rust_engine(world, pa, manifest, "prefill", request="fi2", blocks=[5, 6], num_tokens=30, seed=62,
                           arrangement="BlocksFirst")
    dd = py_engine(world, da, "decode", g, mode=mode)
    decode_takes(dd, rp, addr, "fi2", [7, 8], 30, 62)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_tensor_parallel_ranks_gather_their_heads(world, p_tp, d_tp):
    g = kv(block=16, heads=4)
    pa, da = world.agent("p", "shm"), world.agent("d", "shm")
    prefills = [py_engine(world, pa, "prefill", g, tp=p_tp, rank=r) for r in range(p_tp)]
    decodes = [py_engine(world, da, "decode", g, tp=d_tp, rank=r) for r in range(d_tp)]
    for p in prefills:
        synthetic.fill(p.pool, p.layout, 21, [0, 1], 0, 20)
        p.kv_ready("tp", [0, 1], 20)
    addresses = [p.address for p in reversed(prefills)]  # any order
    for d in decodes:
        d.expect_kv("tp", addresses, [2, 3], 20)
    for d in decodes:
        event = d.wait("tp")
        assert event.type == "RequestDone", event.raw
        assert synthetic.verify(d.pool, d.layout, 21, [2, 3], 0, 20) == 0
    for p in prefills:
        assert p.wait("tp").type == "RequestDone"


@pytest.mark.parametrize(
    "mode,p_kv,d_kv,hit",
    [
        # Pull, P blocks of 16 under D's 32: D holds its first 32 tokens (two P blocks).
        ("Pull", kv(block=16), kv(block=32), 32),
        # Push, kernel blocks of 16 in logical blocks of 64: D holds 16 tokens, mid P logical block.
        ("Push", kv(block=64, kernel=16), kv(block=64, kernel=16), 16),
    ],
)
def test_prefix_hit_on_decode_moves_only_the_tail(world, mode, p_kv, d_kv, hit):
    pa, da = world.agent("p"), world.agent("d")
    p = py_engine(world, pa, "prefill", p_kv, mode=mode)
    d = py_engine(world, da, "decode", d_kv, mode=mode)
    tokens = 70
    p_blocks = list(range(p.layout.blocks_for(tokens)))
    synthetic.fill(p.pool, p.layout, 31, p_blocks, 0, tokens)
    p.kv_ready("hit", p_blocks, tokens)
    # D's cached prefix: blocks it already holds, with bytes that must not be touched.
    d_blocks = [d.layout.num_blocks - 1 - i for i in range(d.layout.blocks_for(tokens, hit))]
    held = 0
    synthetic.fill(d.pool, d.layout, 99, [held], 0, hit)
    before = bytes(d.pool[: d.layout.block_len])
    d.expect_kv("hit", [p.address], d_blocks, tokens, first_token=hit)
    event = d.wait("hit")
    assert event.type == "RequestDone", event.raw
    # Only P's blocks from the hit on move (whole blocks, the last one partly live).
    assert event.raw["bytes"] == p.layout.blocks_for(tokens, hit) * 2 * p.layout.layers * p.layout.block_len
    assert synthetic.verify(d.pool, d.layout, 31, d_blocks, hit, tokens) == 0
    assert bytes(d.pool[: d.layout.block_len]) == before, "the held prefix block was not written"


def test_release_frees_prefill_without_a_failure(world):
    g = kv()
    pa, da = world.agent("p"), world.agent("d")
    p, d = py_engine(world, pa, "prefill", g), py_engine(world, da, "decode", g)
    p.kv_ready("full-hit", [0], 10)
    d.release("full-hit", p.address)
    assert d.wait("full-hit").type == "Released"
    assert p.wait("full-hit").type == "Released"
    # Asking for it after the release is refused at once, not after a lease.
    d.expect_kv("full-hit", [p.address], [1], 10)
    late = d.wait("full-hit", timeout=5)
    assert late.type == "RequestFailed" and "InvalidRequest" in late.reasons, late.raw


def test_a_renewal_names_every_rank_in_one_frame_and_holds_the_request_past_its_lease(world):
    # A frame per rank had a client's params naming 1024 ranks cost decode's engine 1024 frames
    # per queued request and renewal, sent inside its step. An agent that says renew_prefills
    # takes them all in one; one that does not gets a frame per rank, as before.
    import socket as socket_

    g = kv()
    pa, da = world.agent("p"), world.agent("d")
    p, d = py_engine(world, pa, "prefill", g, lease_ms=1500), py_engine(world, da, "decode", g)
    assert d.capabilities.get("renew_prefills") is True
    p.kv_ready("queued", [0], 10)
    nobody = socket_.socket()
    nobody.bind(("127.0.0.1", 0))
    unreachable = "127.0.0.1:%d" % nobody.getsockname()[1]
    nobody.close()
    sent = []
    send = d.send
    d.send = lambda message, *a, **kw: (sent.append(message), send(message, *a, **kw))[1]
    started = time.monotonic()
    while time.monotonic() - started < 3.5:  # past two leases: held only by the renewals
        d.renew("queued", [unreachable, p.address])
        time.sleep(0.3)
    assert all(m["prefill"] == unreachable and m["prefills"] == [p.address] for m in sent), sent[:2]
    d.expect_kv("queued", [p.address], [1], 10)
    assert d.wait("queued").type == "RequestDone"
    # An agent that does not say it: one frame per rank.
    sent.clear()
    d.capabilities = {}
    d.renew("other", [unreachable, p.address])
    assert [(m["prefill"], "prefills" in m) for m in sent] == [(unreachable, False), (p.address, False)]


def test_fail_closed_reports_a_corrupted_byte_as_a_failed_request(world):
    g = kv()
    pa, da = world.agent("p", "tcp", "--corrupt-one-byte"), world.agent("d")
    p, d = py_engine(world, pa, "prefill", g), py_engine(world, da, "decode", g)
    synthetic.fill(p.pool, p.layout, 41, [0, 1], 0, 30)
    p.kv_ready("bad", [0, 1], 30)
    d.expect_kv("bad", [p.address], [0, 1], 30)
    event = d.wait("bad")
    assert event.type == "RequestFailed" and "ChecksumMismatch" in event.reasons, event.raw


def test_mismatched_prefill_is_refused_at_the_handshake_and_decode_keeps_serving(world):
    good, other = kv(layout="HND"), kv(layout="NHD")
    pa, pb, da = world.agent("p"), world.agent("q"), world.agent("d")
    bad = py_engine(world, pa, "prefill", other, engine="wrong")
    p = py_engine(world, pb, "prefill", good)
    d = py_engine(world, da, "decode", good)
    bad.kv_ready("x", [0], 10)
    d.expect_kv("x", [bad.address], [0], 10)
    refused = d.wait("x", timeout=10)
    assert refused.type == "RequestFailed" and "LayoutMismatch" in refused.reasons, refused.raw
    synthetic.fill(p.pool, p.layout, 51, [0], 0, 10)
    p.kv_ready("y", [0], 10)
    d.expect_kv("y", [p.address], [1], 10)
    assert d.wait("y").type == "RequestDone"
    assert synthetic.verify(d.pool, d.layout, 51, [1], 0, 10) == 0


def test_lease_expiry_fails_the_request_on_prefill(world):
    g = kv()
    pa = world.agent("p")
    p = py_engine(world, pa, "prefill", g, lease_ms=300)
    p.kv_ready("late", [0], 10)
    event = p.wait("late", timeout=10)
    assert event.type == "RequestFailed" and "LeaseExpired" in event.reasons, event.raw


def test_a_kv_ready_or_expect_kv_naming_an_event_of_a_pool_that_registered_none_is_refused_naming_it(world):
    # The client puts the event a GPU pool recorded after the writes in KvReady; the agent
    # takes one only from a pool that registered such events (gpu.events), so from a host pool
    # it is refused, naming the field and value (and the request's blocks stay the engine's).
    g = kv()
    pa = world.agent("p")
    p = py_engine(world, pa, "prefill", g)
    p.kv_ready("named", [0], 10, event=3)
    event = p.wait("named", timeout=10)
    assert event.type == "RequestFailed" and event.reasons == ["InvalidRequest"], event.raw
    assert "KvReady.event 3: this pool registered no gpu.events" in event.raw["message"], event.raw
    # And so is decode's, in an ExpectKv (to one prefill or to a pool of ranks).
    d = py_engine(world, world.agent("d"), "decode", g)
    for ranks in ([p.address], [p.address, "127.0.0.1:9"]):
        d.expect_kv(f"named-{len(ranks)}", ranks, [0], 10, event=1)
        event = d.wait(f"named-{len(ranks)}", timeout=10)
        assert event.type == "RequestFailed" and event.reasons == ["InvalidRequest"], event.raw
        assert "event 1: this pool registered no gpu.events" in event.raw["message"], event.raw


def test_a_killed_prefill_agent_fails_decodes_request_with_peer_lost(world):
    g = kv()
    pa, da = world.agent("p"), world.agent("d")
    p, d = py_engine(world, pa, "prefill", g), py_engine(world, da, "decode", g)
    d.expect_kv("warm", [p.address], [0], 10)
    p.kv_ready("warm", [0], 10)
    assert d.wait("warm").type == "RequestDone"
    d.expect_kv("lost", [p.address], [1], 10)  # prefill never says it is ready
    # Let decode's agent take the request to prefill before the kill (the engine API does not
    # acknowledge ExpectKv). Should the kill still come first, decode's dial is refused: it fails
    # as HandshakeFailed, naming the refused connection (seen once in 12 runs without the wait).
    time.sleep(0.5)
    pa.kill()
    event = d.wait("lost", timeout=20)
    assert event.type == "RequestFailed", event.raw
    assert "PeerLost" in event.reasons or (
        event.reasons == ["HandshakeFailed"] and "Connection refused" in event.raw["message"]
    ), event.raw


def test_a_receive_a_stopped_agent_never_answers_ends_the_connection_after_twice_its_bound(world, monkeypatch):
    # An agent whose task for a request died without answering, or a stopped process, keeps the
    # connection up: nothing ended the receive, and vLLM held its request and blocks for good
    # (and prefill its, while decode's queue renewed them). Here the agent is stopped (SIGSTOP).
    import signal

    from pdpair_vllm import transfer
    from pdpair_vllm.transfer import Plan, Recv, Stager, WorkerState

    monkeypatch.setattr(transfer, "UNANSWERED_SLACK_S", 0.5)
    g = kv()
    pa, da = world.agent("p"), world.agent("d")
    p = py_engine(world, pa, "prefill", g)
    d = py_engine(world, da, "decode", g, handshake_timeout_ms=200, lease_ms=300)
    assert d.transfer_bound_s == 0.5, "the agent's handshake timeout and lease, as it said them"
    w = WorkerState(d, Stager())
    da.proc.send_signal(signal.SIGSTOP)
    try:
        asked = time.monotonic()
        w.start(Plan(recvs=[Recv(request="r", agent_request="never", prefill_ranks=[p.address],
                                 logical_blocks=[1, 2], first_token=0, num_tokens=20)]))
        got = w.poll()
        assert not got.finished_recving and w.lost is None, "not before twice the bound"
        while not got.finished_recving:
            assert time.monotonic() - asked < 10, "the receive is still open"
            time.sleep(0.05)
            got = w.poll()
        assert time.monotonic() - asked >= 1.5, "twice the bound and the slack"
        assert got.failed_recving == {"r"} and got.error_blocks == {1, 2}
        assert "did not answer the recv 'never'" in w.lost, w.lost
        assert w.outcomes == {"r": "RequestFailed"}
    finally:
        da.proc.send_signal(signal.SIGCONT)
    w.close()


def test_an_offer_a_stopped_agent_holds_ends_the_connection_once_it_leaves_a_ping_unanswered(world, monkeypatch):
    # Prefill's offered KV waits on decode for as long as decode renews it, so no bound ends it:
    # a stopped prefill agent held the engine's blocks for good. A silent agent is asked its
    # Capabilities while an offer is open; a live one answers, a stopped one does not.
    import signal

    from pdpair_vllm import transfer
    from pdpair_vllm.transfer import Plan, Send, Stager, WorkerState

    class Saves(Stager):
        def save(self, blocks):
            pass

    monkeypatch.setattr(transfer, "PING_AFTER_S", 0.2)
    monkeypatch.setattr(transfer, "UNANSWERED_SLACK_S", 0.5)
    g = kv()
    pa = world.agent("p")
    p = py_engine(world, pa, "prefill", g, handshake_timeout_ms=100, lease_ms=2000)
    assert p.transfer_bound_s == 2.1
    w = WorkerState(p, Saves())
    w.save(Plan(sends=[Send("s", [3], 16, addresses={0: p.address})]))
    # Live: asked after each PING_AFTER_S of silence, and answering.
    heard, until = p.heard_at, time.monotonic() + 1.2
    while time.monotonic() < until:
        assert w.poll() == transfer.Results() and w.lost is None, w.lost
        time.sleep(0.05)
    assert p.heard_at > heard, "the agent was asked and answered"
    pa.proc.send_signal(signal.SIGSTOP)
    try:
        stopped, last_heard = time.monotonic(), p.heard_at
        got = w.poll()
        while not got.finished_sending:
            assert time.monotonic() - stopped < 15, "the offer is still open"
            time.sleep(0.05)
            got = w.poll()
        # Asked no sooner than PING_AFTER_S after it was last heard (an answer on its way at the
        # stop moves that later), then twice the bound and the slack.
        assert time.monotonic() - last_heard >= 0.2 + 2 * 2.1 + 0.5, "not before twice the bound and the slack"
        assert got.finished_sending == {"s"}
        assert "did not answer a Capabilities" in w.lost, w.lost
    finally:
        pa.proc.send_signal(signal.SIGCONT)
    w.close()


@pytest.mark.parametrize("mode", ["Push", "Pull"])
def test_pools_in_several_regions_move_byte_exact_between_python_and_rust(world, mode):
    # vLLM's KV tensors are one per layer: each side describes its pool as it has it, and the two
    # sides' splits (and arrangements) differ; the agent plans every copy from the descriptions.
    g = kv(block=16, layers=4)
    manifest = world.manifest(mode, "FailClosed", g, g)
    pa, da = world.agent("p"), world.agent("d")
    per_layer = [(1, None), (1, "BlocksFirst"), (1, None), (1, "KvFirst")]
    p = py_engine(world, pa, "prefill", g, mode=mode, regions=per_layer)
    assert len(p.pools) == 4 and [len(m) for m in p.pools] == p.layout.region_lens
    synthetic.fill(p.pools, p.layout, 71, [2, 3, 5], 0, 45)
    p.kv_ready("rg", [2, 3, 5], 45)
    d, _ = rust_engine(world, da, manifest, "decode", request="rg", blocks=[1, 0, 4], num_tokens=45, seed=71,
                       prefill=[p.address], regions=[(3, "BlocksFirst"), (1, None)])
    got = rust_result(d)
    assert got["type"] == "RequestDone" and got["checksum"] == "Verified" and got["bad_tokens"] == 0, got
    rp, addr = rust_engine(world, pa, manifest, "prefill", request="rg2", blocks=[6, 7], num_tokens=30, seed=72,
                           regions=[(2, None), (2, "BlocksFirst")])
    dd = py_engine(world, da, "decode", g, mode=mode, regions=[(1, None)] * 4)
    decode_takes(dd, rp, addr, "rg2", [8, 9], 30, 72)
    # The last region's bytes are checked too: a wrong byte there is seen.
    r, at = dd.layout.block_offset(3, True, 9)
    dd.pools[r][at] ^= 0xFF
    assert r == 3 and synthetic.verify(dd.pools, dd.layout, 72, [8, 9], 0, 30) == 1


@pytest.mark.parametrize("mode", ["Push", "Pull"])
def test_k_and_v_side_by_side_move_byte_exact_between_python_and_rust(world, mode):
    # vLLM 0.33's layout (each head's token's K and V side by side, one region of all layers at
    # the strides the engine names) as Python lays it out and as the agent's Rust engine does:
    # Python's blocks outermost into Rust's per-layer arrays, Rust's layers outermost (with gaps)
    # into Python's blocks outermost.
    g = kv(block=16, layers=4)
    manifest = world.manifest(mode, "FailClosed", g, g)
    pa, da = world.agent("p"), world.agent("d")
    chunk = 2 * PoolLayout.new(g, 1, 16, 0).block_len
    blocks_outer = [{"layers": 4, "kv_arrangement": "Interleaved", "layer_stride": chunk, "block_stride": 4 * chunk + 64}]
    p = py_engine(world, pa, "prefill", g, mode=mode, regions=blocks_outer)
    assert p.layout.region_lens == [3 * chunk + 15 * (4 * chunk + 64) + chunk] == [len(m) for m in p.pools]
    synthetic.fill(p.pools, p.layout, 91, [2, 3, 5], 0, 45)
    p.kv_ready("ri", [2, 3, 5], 45)
    d, _ = rust_engine(world, da, manifest, "decode", request="ri", blocks=[1, 0, 4], num_tokens=45, seed=91,
                       prefill=[p.address], regions=[(1, None), (1, "BlocksFirst"), (2, None)])
    got = rust_result(d)
    assert got["type"] == "RequestDone" and got["checksum"] == "Verified" and got["bad_tokens"] == 0, got
    layers_outer = f"Interleaved:{16 * (chunk + 32)}:{chunk + 32}"
    rp, addr = rust_engine(world, pa, manifest, "prefill", request="ri2", blocks=[6, 7], num_tokens=30, seed=92,
                           regions=[(4, layers_outer)])
    dd = py_engine(world, da, "decode", g, mode=mode, regions=blocks_outer)
    decode_takes(dd, rp, addr, "ri2", [8, 9], 30, 92)
    # A V byte of the last layer, where Python's layout puts it, is seen.
    r, at = dd.layout.block_offset(3, True, 9)
    dd.pools[r][at + dd.layout.token_offset(1, 2, 3)] ^= 0xFF
    assert synthetic.verify(dd.pools, dd.layout, 92, [8, 9], 0, 30) == 1


@pytest.mark.parametrize("mode", ["Push", "Pull"])
def test_mla_latent_arrays_move_byte_exact_between_python_and_rust(world, mode):
    # MLA keeps one latent vector per token (no V), not sharded by head.
    g = kv(block=16, heads=1, head_dim=64, layers=3, mla=True)
    manifest = world.manifest(mode, "FailClosed", g, g)
    pa, da = world.agent("p"), world.agent("d")
    p = py_engine(world, pa, "prefill", g, mode=mode)
    assert p.layout.arrangement == "Latent" and p.layout.pool_len == 3 * 16 * 16 * 64 * 2
    synthetic.fill(p.pools, p.layout, 81, [1, 2], 0, 20)
    p.kv_ready("mla", [1, 2], 20)
    d, _ = rust_engine(world, da, manifest, "decode", request="mla", blocks=[3, 4], num_tokens=20, seed=81,
                       prefill=[p.address], regions=[(1, None), (2, "Latent")])
    got = rust_result(d)
    assert got["type"] == "RequestDone" and got["checksum"] == "Verified" and got["bad_tokens"] == 0, got
    rp, addr = rust_engine(world, pa, manifest, "prefill", request="mla2", blocks=[0], num_tokens=9, seed=82)
    dd = py_engine(world, da, "decode", g, mode=mode, regions=[(1, None)] * 3)
    decode_takes(dd, rp, addr, "mla2", [5], 9, 82)


def test_the_client_asks_capabilities_before_registering(world):
    a = world.agent("p")
    c = py_engine(world, a, "prefill", kv(), lease_ms=1234)
    # Registered says the settings the engine runs under: how long the agent's transfers run.
    assert c.transfer_bound_s == (5000 + 1234) / 1000
    # And how long an offered request's blocks are held, renewals included: the lease, eleven
    # times (renewals taken for ten leases after the KvReady, each holding one more).
    assert c.hold_s == 11 * 1234 / 1000
    caps = c.capabilities
    assert caps["type"] == "Capabilities" and caps["agent"] == "p"
    assert "host" in caps["ucx_memory_types"] and caps["ucx_version"]
    assert caps["pool_memory"] == ["host"]
    # This agent version refuses GPU pools and says why.
    assert caps["gpu_pools_refused"]
    # On the KV stream (tcp) a GPU pool would reach other agents; on UCX (shm, RDMA) not.
    assert caps["gpu_between_agents"] is True
    c.close()
    u = py_engine(world, world.agent("u", "shm"), "prefill", kv())
    assert u.capabilities["gpu_between_agents"] is False
    u.close()


def test_registration_refusals_name_the_field(world):
    a = world.agent("p")
    # Version 2 lacked Cancel and kv_arrangement, version 3 regions and MLA's latent arrays,
    # version 4 prompt digests (an agent of 4 would drop them unchecked): a client of any is
    # refused, naming both versions.
    for old in (1, 2, 3, 4):
        with pytest.raises(AgentError, match=f"api_version {old} .*version 5"):
            reg = registration(pdpair="default/pair", role="decode", engine="e", kv=kv(), num_blocks=4,
                               pairing_key=world.key, mode="Push", checksum="Disabled", **SETTINGS)
            reg["api_version"] = old
            AgentClient.register(a.socket, reg)
    with pytest.raises(AgentError, match="pairing"):
        AgentClient.register(a.socket, registration(pdpair="default/pair", role="decode", engine="e", kv=kv(),
                                                    num_blocks=4, pairing_key=b"", mode="Push",
                                                    checksum="Disabled", **SETTINGS))
    # What the client can check itself it refuses before sending, naming the field.
    with pytest.raises(LayoutError, match="num_blocks is 0"):
        AgentClient.register(a.socket, registration(pdpair="default/pair", role="decode", engine="e", kv=kv(),
                                                    num_blocks=0, pairing_key=world.key, mode="Push",
                                                    checksum="Disabled", **SETTINGS))


def test_layout_matches_the_documented_formula():
    # docs/engine-api.md: block_len = kernelBlockSize * local_heads * headDim * element bytes.
    lay = PoolLayout.new(kv(block=16, heads=8, head_dim=128, layers=32, dtype="bfloat16"), 4, 100, 3)
    assert (lay.local_heads, lay.head_offset, lay.block_len) == (2, 6, 16 * 2 * 128 * 2)
    assert lay.pool_len == lay.region_lens[0] == 2 * 32 * 100 * lay.block_len
    assert lay.block_offset(1, True, 5) == (0, 3 * 100 * lay.block_len + 5 * lay.block_len)
    # One region per layer (vLLM's per-layer tensors): layer 1 is region 1's only layer.
    per_layer = PoolLayout.new(kv(block=16, heads=8, head_dim=128, layers=32, dtype="bfloat16"), 4, 100, 3,
                               regions=[{"layers": 1}] * 32)
    assert per_layer.region_lens == [2 * 100 * lay.block_len] * 32
    assert per_layer.block_offset(1, True, 5) == (1, 100 * lay.block_len + 5 * lay.block_len)
    # MLA: one latent array per layer, no V; not sharded by head.
    mla = PoolLayout.new(kv(block=16, heads=1, head_dim=576, layers=4, dtype="bfloat16", mla=True), 4, 10, 3)
    assert (mla.arrangement, mla.arrays, mla.local_heads) == ("Latent", (False,), 1)
    assert mla.pool_len == 4 * 10 * 16 * 576 * 2
    assert mla.block_offset(2, False, 3) == (0, 2 * 10 * mla.block_len + 3 * mla.block_len)
    for bad, message in [
        (dict(regions=[{"layers": 1}]), "regions hold 1 layers in all; the geometry has kv.layers 32"),
        (dict(regions=[{"layers": 32, "kv_arrangement": "Latent"}]), r"regions\[0\].kv_arrangement is Latent"),
        (dict(arrangement="BlocksFirst", regions=[{"layers": 32}]), "both set"),
        (dict(regions=[{"layers": 0}, {"layers": 32}]), r"regions\[0\].layers is 0"),
    ]:
        with pytest.raises(LayoutError, match=message):
            PoolLayout.new(kv(layers=32), 1, 10, 0, **bad)
    assert lay.token_offset(1, 3, 0) == (16 + 3) * 256
    nhd = PoolLayout.new(kv(layout="NHD", heads=8, head_dim=128, dtype="bfloat16"), 4, 100, 3)
    assert nhd.token_offset(1, 3, 0) == (3 * 2 + 1) * 256
    more_ranks = PoolLayout.new(kv(heads=2), 4, 10, 3)
    assert (more_ranks.local_heads, more_ranks.head_offset) == (1, 1)


def test_a_pairing_key_of_an_earlier_pdpair_of_the_name_is_waited_out_and_then_refused(tmp_path, caplog):
    # A PDPair deleted and made again at once: its pods can mount the predecessor's Secret,
    # which the garbage collector is about to delete. An engine that paired with that key was
    # refused by every peer holding the new one for as long as it ran; now it waits for the
    # kubelet to bring its own PDPair's Secret (the operator writes its uid beside the key).
    import threading

    from pdpair_vllm.client import read_pairing_key

    key, uid = tmp_path / "key", tmp_path / "pdpair-uid"
    key.write_bytes(b"old-key")
    uid.write_text("uid-old")

    def kubelet():
        time.sleep(0.5)
        key.write_bytes(b"new-key")
        uid.write_text("uid-new")

    t = threading.Thread(target=kubelet)
    t.start()
    assert read_pairing_key(str(key), "uid-new", wait_s=20) == b"new-key"
    t.join()
    assert "earlier PDPair of this name" in caplog.text
    # Never brought: refused, naming both.
    uid.write_text("uid-old")
    with pytest.raises(AgentError, match="uid 'uid-old'.*uid-new"):
        read_pairing_key(str(key), "uid-new", wait_s=0.3)
    # A Secret without the uid (made before it was written, or the user's), or an engine not told
    # its PDPair's uid: the key as it is.
    assert read_pairing_key(str(key), None, wait_s=0) == b"new-key"
    uid.unlink()
    assert read_pairing_key(str(key), "uid-new", wait_s=0) == b"new-key"


@pytest.mark.parametrize("frame", [b'{"type":"RequestDone","request":"r","x":' + b"[" * 100000 + b"]" * 100000 + b"}",
                                   b"\xff\xfe not JSON"])
def test_an_agent_frame_the_connector_cannot_read_ends_the_connection_not_its_reader_alone(frame):
    # A frame nested past Python's recursion limit raised RecursionError in the event reader,
    # which caught only OSError and FrameError: the reader died with the connection never
    # marked closed, and every transfer waiting on it (and its blocks) waited for good.
    import socket
    import struct

    ours, theirs = socket.socketpair()
    client = AgentClient(ours, {}, None, "", [])
    lost = []
    client.on_close = lambda: lost.append(True)
    theirs.sendall(struct.pack(">I", len(frame)) + frame)
    deadline = time.monotonic() + 10
    while client.closed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.closed is not None, "the connection is given up as lost"
    assert lost == [True], "and the engine told"
    # And ended, so the agent frees the registration the rank makes again under its name.
    theirs.settimeout(5)
    assert theirs.recv(1) == b"", "the agent's end sees the connection close"
    client.close()
    theirs.close()


def test_a_send_to_an_agent_that_stops_reading_fails_instead_of_hanging(monkeypatch):
    # An agent (here the other end of a socket pair, standing in for a stuck or hostile one) that
    # reads nothing: the engine's sends fill the socket and then fail within the send timeout,
    # rather than blocking vLLM's step forever.
    import socket

    monkeypatch.setattr(AgentClient, "SEND_TIMEOUT_S", 0.5)
    ours, theirs = socket.socketpair()
    client = AgentClient(ours, {}, None, "", [])
    started = time.monotonic()
    with pytest.raises(AgentError, match="sending KvReady"):
        for i in range(100000):
            client.kv_ready(f"r{i}", list(range(512)), 8192)
    assert time.monotonic() - started < 30, "failed at the send timeout, not at the end of the loop"
    client.close()
    theirs.close()


def test_a_restarted_agent_listens_again_where_a_prefill_engine_was(world):
    # Decode engines were handed this prefill rank's address; after its agent restarts (a
    # rollout) the engine registers again naming it, and the agent listens there again where it
    # can: its own host, an ephemeral port, free. Elsewhere it listens at a new port.
    import socket

    names = iter(range(100))

    def register(agent, role="prefill", **extra):
        # A name each: the agent lets a closed connection's engine go a moment later.
        reg = registration(pdpair="default/pair", role=role, engine=f"p-{next(names)}", kv=kv(), num_blocks=4,
                           pairing_key=world.key, mode="Push", checksum="Disabled", handshake_timeout_ms=5000,
                           lease_ms=30000)
        return AgentClient.register(agent.socket, dict(reg, **extra))

    a = world.agent("p")
    first = register(a)  # p-0
    before = first.address
    a.kill()  # its engine lives on
    first.close()
    a = world.agent("p")  # the same socket
    # For a while after the restart the address is that engine's alone: another gets a new port.
    other = register(a, address=before)
    assert other.address != before, before
    other.close()
    again = register(a, address=before, engine="p-0")
    assert again.address == before, (before, again.address)
    again.close()
    # The port is someone else's now: a new one.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with taken:
        port = taken.getsockname()[1]
        moved = register(a, address=f"127.0.0.1:{port}")
        assert moved.address != f"127.0.0.1:{port}" and moved.address.startswith("127.0.0.1:")
        moved.close()
    # Not this agent's host, or not an ephemeral port (a service's): never bound there.
    for elsewhere in ("10.9.9.9:40000", "127.0.0.1:22", "127.0.0.1:80"):
        c = register(a, address=elsewhere)
        assert c.address != elsewhere
        c.close()
    with pytest.raises(AgentError, match="address"):
        register(a, address="somewhere")
    with pytest.raises(AgentError, match="address is 127.0.0.1:40000, but a decode engine has no side-channel address"):
        register(a, role="decode", address="127.0.0.1:40000")


def registered_once_it_fits(world, agent, geometry, num_blocks: int, engine: str, why: str) -> AgentClient:
    """A prefill engine of ``num_blocks`` registered at ``agent``, tried again while the agent is
    busy, for 10 s at most (failing with ``why``)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return py_engine(world, agent, "prefill", geometry, num_blocks=num_blocks, engine=engine)
        except AgentBusy:
            assert time.monotonic() < deadline, why
            time.sleep(0.1)


def test_a_pool_past_the_pool_directorys_room_is_busy_while_the_agents_own_pools_fill_it(world):
    # Under shm the agent's pools are UCX's segment files in its pool directory (the chart's
    # emptyDir): one past its room is refused, naming it; busy while the pools the agent holds
    # for other engines, which go with them, would leave room. A real small file system: a
    # tmpfs of 160 MiB (needs root, as the memory cgroup test does).
    pools = world.dir / "pools"
    pools.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m,mode=0700", "tmpfs", str(pools)], check=True)
    try:
        agent = world.agent("a", "shm")
        g = kv(heads=8, head_dim=128)  # 128 KiB a block (2 layers, K and V)
        held = [py_engine(world, agent, "prefill", g, num_blocks=512, engine=f"held-{i}") for i in range(2)]
        pool_files = [f for f in pools.iterdir() if f.stat().st_size >= 64 << 20]
        assert len(pool_files) == 2, f"each pool is a file of the pool directory: {list(pools.iterdir())}"
        with pytest.raises(AgentBusy, match=r"the pool directory .* has \d+ free; the agent holds 134217728 bytes of pools for other Pods' engines of this PDPair and role"):
            py_engine(world, agent, "prefill", g, num_blocks=512, engine="third")
        # Not busy where they would not leave room: 256 MiB on 160.
        with pytest.raises(AgentError, match=r"the pool directory .* has \d+ free") as past_all:
            py_engine(world, agent, "prefill", g, num_blocks=2048, engine="past-all")
        assert not isinstance(past_all.value, AgentBusy), "the pools held would not make room"
        # One goes: the third fits.
        held[0].close()
        for pool in held[0].pools:
            pool.close()
        third = registered_once_it_fits(world, agent, g, 512, "third", "the pool that went left no room")
        third.close()
        held[1].close()
    finally:
        world.stop()
        subprocess.run(["umount", "-l", str(pools)], check=False)


def test_a_pool_past_the_agents_memory_limit_is_refused_naming_it_and_the_agent_lives_on(world, memory_cgroup):
    # The agent allocates a host pool and faults it in, so its memory cgroup is charged for it:
    # one past its limit got the agent killed (and every engine on the node lost it). Now it is
    # refused, naming the limit, and the agent serves on. A real kernel limit: the agent runs in
    # a memory cgroup of 512 MiB.
    agent = world.agent("a", "tcp", cgroup=memory_cgroup(512 << 20))
    g = kv(heads=8, head_dim=128)  # 128 KiB a block (2 layers, K and V)
    with pytest.raises(AgentError, match=r"its memory limit leaves \d+ \(limit 536870912, in use \d+, 268435456 kept") as past:
        py_engine(world, agent, "prefill", g, num_blocks=8192)  # 1 GiB
    assert not isinstance(past.value, AgentBusy), "a refusal of the pool: tried again, it is refused again"
    assert agent.proc.poll() is None, "the agent lives"
    # What fits is registered, and its memory is there to use.
    small = py_engine(world, agent, "prefill", g, num_blocks=512)  # 64 MiB
    synthetic.fill(small.pool, small.layout, 3, [0, 511], 0, 32)
    assert synthetic.verify(small.pool, small.layout, 3, [0, 511], 0, 32) == 0
    # The room shrinks with what the agent holds: 3 more of 64 MiB leave under 256 MiB. The
    # pools it holds for other engines of the same pair and role, which go with them (a
    # rollout's old Pod beside the new one), would leave room: busy, tried again, not refused
    # for good (the engine crash-looped). A decode engine's pool does not count for a prefill.
    more = [py_engine(world, agent, role, g, num_blocks=512, engine=f"more-{i}")
            for i, role in enumerate(["prefill", "decode"])]
    held = "the agent holds 134217728 bytes of pools for other Pods' engines of this PDPair and role"
    with pytest.raises(AgentBusy, match=f"its memory limit leaves .*{held}, and released 0 in the last 10 s"):
        py_engine(world, agent, "prefill", g, num_blocks=768, engine="over")
    # 205 MiB: room for it with the decode's pool gone too, not with the prefills' alone.
    with pytest.raises(AgentError, match="its memory limit leaves") as other_role:
        py_engine(world, agent, "prefill", g, num_blocks=1640, engine="other-role")
    assert not isinstance(other_role.value, AgentBusy), "a decode engine's pool does not go for a prefill"
    assert agent.proc.poll() is None
    # Their engines gone but their memory still mapped (an engine's process still ending): still
    # busy a while, not refused for good.
    for e in [small, *more]:
        e.close()
    deadline = time.monotonic() + 5
    while True:
        with pytest.raises(AgentBusy) as gone:
            py_engine(world, agent, "prefill", g, num_blocks=768, engine="over")
        if "holds 0 bytes of pools" in str(gone.value):
            assert "and released 134217728 in the last 10 s" in str(gone.value), gone.value
            break
        assert time.monotonic() < deadline, f"the closed engines are still held: {gone.value}"
        time.sleep(0.05)
    # Once it is unmapped too, it fits.
    for e in [small, *more]:
        for pool in e.pools:
            pool.close()
    over = registered_once_it_fits(world, agent, g, 768, "over", "the pools that went left no room")
    # Not busy where the pools it holds would not make room: the engine's own 96 MiB and 1 GiB
    # more leave past the limit with it gone.
    with pytest.raises(AgentError, match="its memory limit leaves") as past_all:
        py_engine(world, agent, "prefill", g, num_blocks=8192, engine="past-all")
    assert not isinstance(past_all.value, AgentBusy), "the pools held would not make room"
    assert agent.proc.poll() is None
    over.close()
