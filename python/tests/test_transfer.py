"""The engine-agnostic state machines without vLLM: what the scheduler side plans from
``kv_transfer_params`` (untrusted: they come from a client through the proxy)."""

from __future__ import annotations

import time

import pytest

from pdpair_vllm.transfer import (PARAM_HOLD, PARAM_RANKS, PARAM_RELEASE, PARAM_REQUEST, PARAM_TOKENS, Plan, Prompt, Recv,
                                  Results, SchedulerState, Stager, WorkerState, check_params, kernel_ids)


def params(**over):
    p = {"do_remote_prefill": True, PARAM_REQUEST: "p-1", PARAM_RANKS: ["10.0.0.1:7000"], PARAM_TOKENS: 50}
    p.update(over)
    return p


@pytest.mark.parametrize(
    "field,value",
    [(PARAM_REQUEST, ""), (PARAM_REQUEST, 7), (PARAM_RANKS, []), (PARAM_RANKS, "10.0.0.1:7000"),
     (PARAM_RANKS, [None]), (PARAM_TOKENS, -1), (PARAM_TOKENS, True), (PARAM_TOKENS, "50")],
)
def test_malformed_params_are_named_and_the_request_is_computed_locally(field, value, caplog):
    with pytest.raises(ValueError, match=field):
        check_params(params(**{field: value}))
    s = SchedulerState(16)
    bad = params(**{field: value})
    assert s.matched_tokens("r", bad, 50, 0) == (0, False)
    assert field in caplog.text
    s.after_alloc("r", bad, [1, 2, 3, 4], 50, 0)
    assert s.plan().empty(), "nothing is asked of any agent"


def test_decode_asks_for_the_tail_after_its_prefix_hit_and_the_worker_in_its_kernel_blocks():
    s = SchedulerState(block_size=32)
    p = params()
    assert s.matched_tokens("r", p, 50, 32) == (18, True)
    s.after_alloc("r", p, [7, 3], 50, 18)
    plan = s.plan()
    (recv,) = plan.recvs
    assert (recv.agent_request, recv.first_token, recv.num_tokens) == ("p-1", 32, 50)
    assert recv.logical_blocks == [3]
    assert p["do_remote_prefill"] is False, "one transfer per request"
    assert s.plan().empty(), "handed to the workers once"
    # The worker's KV cache has kernel blocks of 16 tokens (two a block): it asks for those.
    asked = []

    class Client:
        closed = None

        def expect_kv(self, request, prefills, blocks, *args, **kw):
            asked.append(blocks)

    WorkerState(Client(), Stager(), per_logical=2).start(plan)
    assert asked == [[6, 7]]


def test_a_short_tail_is_recomputed_and_prefill_released():
    s = SchedulerState(16, min_transfer_tokens=16)
    p = params(**{PARAM_TOKENS: 49})
    assert s.matched_tokens("r", p, 49, 48) == (0, False)
    s.after_alloc("r", p, [1, 2, 3, 4], 49, 0)
    plan = s.plan()
    assert not plan.recvs and [r.agent_request for r in plan.releases] == ["p-1"]


def test_a_local_prefix_of_a_partial_block_fails_the_receive_at_once_and_releases_prefill(caplog):
    # vLLM said the KV would come (the request waits for remote KV); with a local prefix that is
    # not whole blocks (vLLM trims the count itself for sliding-window replay) the connector
    # only released P: no rank ever answered, and the request waited for good with its blocks.
    s = SchedulerState(16)
    p = params()
    assert s.matched_tokens("r", p, 50, 0) == (50, True)
    s.after_alloc("r", p, [1, 2, 3, 4], 50, 41)  # a local prefix of 9 tokens
    plan = s.plan()
    assert [r.agent_request for r in plan.releases] == ["p-1"], "P is released"
    (recv,) = plan.recvs
    assert recv.fail and "9 tokens" in recv.fail and "load errors" in caplog.text
    client = _Client()
    w = WorkerState(client, Stager())
    w.start(plan)
    assert ("expect_kv", "p-1") not in client.calls, "no agent is asked"
    got = w.poll()
    assert got.finished_recving == {"r"} and got.failed_recving == {"r"}, "answered at once, failed"
    assert got.error_blocks == {1, 2, 3, 4}, "from the partial block on, recomputed"


def test_a_decode_holding_a_partial_block_of_its_own_asks_for_nothing_and_releases_prefill(caplog):
    # Known before allocation: nothing is claimed, so vLLM computes the rest itself (rather than
    # a receive failed at allocation, which vLLM's default kv_load_failure_policy, fail, ends
    # with an error).
    s = SchedulerState(16)
    p = params()
    assert s.matched_tokens("r", p, 50, 9) == (0, False)
    assert "not whole blocks" in caplog.text
    s.after_alloc("r", p, [1, 2, 3, 4], 50, 0)
    plan = s.plan()
    assert not plan.recvs and [r.agent_request for r in plan.releases] == ["p-1"]


def test_a_partial_last_block_past_prefills_tokens_is_computed_where_vllm_counts_whole_blocks():
    # An older vLLM takes every block a request received as computed, whole: a decode prompt
    # longer than the tokens P computed, those not whole blocks, would keep stale KV in the rest
    # of the last block (cached under its prompt). There it is computed locally; whole blocks of
    # P's tokens are received; vLLM 0.33 (counting the tokens said) receives the 90.
    params = {"do_remote_prefill": True, PARAM_REQUEST: "p-1", PARAM_RANKS: ["10.0.0.1:7000"], PARAM_TOKENS: 90}
    assert SchedulerState(16, whole_blocks=True).matched_tokens("r", dict(params), 110, 0) == (0, False)
    assert SchedulerState(16, whole_blocks=True).matched_tokens("r", dict(params, **{PARAM_TOKENS: 80}), 110, 0) == (80, True)
    assert SchedulerState(16, whole_blocks=True).matched_tokens("r", dict(params), 90, 0) == (90, True), "the whole prompt"
    assert SchedulerState(16, whole_blocks=False).matched_tokens("r", dict(params), 110, 0) == (90, True)


def test_a_queued_request_is_renewed_until_it_is_allocated():
    s = SchedulerState(16, renew_interval_s=0.05)
    p = params()
    prompt = Prompt(list(range(50)))
    assert s.matched_tokens("r", p, 50, 0, prompt) == (50, True)
    assert not s.plan().renews, "not due yet"
    time.sleep(0.06)
    # Each renewal names the prompt (P holds only the request of that prompt).
    assert [(r.agent_request, r.prompt) for r in s.plan().renews] == [("p-1", prompt.digest(50))]
    s.after_alloc("r", p, [1, 2, 3, 4], 50, 50)
    time.sleep(0.06)
    plan = s.plan()
    assert not plan.renews and len(plan.recvs) == 1


def test_a_request_is_renewed_from_its_arrival_and_leaves_the_queue_with_its_allocation_or_end():
    # vLLM 0.33 skips matching while every run slot is taken: renewals start at arrival.
    s = SchedulerState(16, renew_interval_s=0.05)
    prompt = Prompt(list(range(50)))
    s.arrived("r", params(), 50, prompt)
    s.arrived("r", params(), 50, Prompt(list(range(1, 51))))  # twice: the first stands
    s.arrived("local", None, 50, prompt)
    s.arrived("unbound", params(), 50, Prompt(list(range(50)), unbound="embeddings"))
    time.sleep(0.06)
    assert [(r.agent_request, r.prompt) for r in s.plan().renews] == [("p-1", prompt.digest(50))]
    # Matched later: still one entry, renewed as before.
    assert s.matched_tokens("r", params(), 50, 0, prompt) == (50, True)
    time.sleep(0.06)
    assert len(s.plan().renews) == 1
    # D took none of it (a prefix hit, a short tail): P released, no more renewals.
    s.after_alloc("r", params(), [1, 2, 3, 4], 50, 0, prompt)
    time.sleep(0.06)
    plan = s.plan()
    assert not plan.renews and [r.agent_request for r in plan.releases] == ["p-1"]
    # Aborted before it was ever matched: released, not renewed.
    s.arrived("a", params(), 50, prompt)
    s.finished("a", params(), False, [], 0, "d")
    time.sleep(0.06)
    plan = s.plan()
    assert not plan.renews and [r.agent_request for r in plan.releases] == ["p-1"]


def test_prefill_holds_its_blocks_and_names_every_rank_in_order():
    s = SchedulerState(16, tensor=2)
    # Rank 1 registered, rank 0 not yet (it started before its agent answered): params naming
    # rank 1 alone would have decode take its heads only. Nothing is offered.
    s.learn_ranks({1: "b:2"})
    assert s.finished("early", {"do_remote_decode": True}, True, [4], 10, "eng") == (False, None)
    assert s.plan().empty()
    s.learn_ranks({0: "a:1"})
    hold, out = s.finished("r", {"do_remote_decode": True}, True, [4, 5, 6, 9], 50, "eng")
    assert hold is True
    assert out[PARAM_RANKS] == ["a:1", "b:2"] and out[PARAM_TOKENS] == 50 and out[PARAM_REQUEST] == "r"
    (send,) = s.plan().sends
    assert send.blocks == [4, 5, 6, 9]
    # An aborted prefill sends nothing and frees at once.
    assert s.finished("x", {"do_remote_decode": True}, False, [1], 10, "eng") == (False, None)


def test_prefill_hands_decode_the_longest_its_ranks_hold_an_offered_request():
    s = SchedulerState(16, tensor=2)
    s.learn_ranks({0: "10.0.0.1:7000", 1: "10.0.0.2:7000"})
    s.learn_holds({0: 300.0, 1: 330.0})
    out = s.finished("r", {"do_remote_decode": True}, True, [4, 5, 6, 9], 50, "eng")[1]
    assert out[PARAM_HOLD] == 330.0 and check_params(out) is not None
    # A rank that registered with a restarted agent, the PDPair's lease raised meanwhile: D is
    # handed its new hold.
    s.learn_holds({0: 660.0})
    assert s.finished("n", {"do_remote_decode": True}, True, [4], 10, "eng")[1][PARAM_HOLD] == 660.0
    # A rank's agent that did not say (before Registered.hold_ms): none is handed on, and
    # decode renews for as long as it queues the request, as before.
    s.learn_holds({1: None})
    assert PARAM_HOLD not in s.finished("q", {"do_remote_decode": True}, True, [4], 10, "eng")[1]


def test_decode_renews_a_queued_request_no_longer_than_prefill_holds_it():
    # P takes renewals of an offered request up to its hold (MAX_HOLD_LEASES leases after its
    # KvReady, and holds one more); past it a renewal holds nothing, and a request queued for
    # long sent one a second to P's agent for as long as it waited.
    s = SchedulerState(16, renew_interval_s=0.01)
    prompt = Prompt(list(range(50)))
    s.arrived("held", params(**{PARAM_REQUEST: "held", PARAM_HOLD: 0.6}), 50, prompt)
    s.arrived("unsaid", params(**{PARAM_REQUEST: "unsaid"}), 50, prompt)
    # Queued when first matched (a vLLM that does not call on_new_request): the same.
    assert s.matched_tokens("matched", params(**{PARAM_REQUEST: "matched", PARAM_HOLD: 0.6}), 50, 0,
                            prompt) == (50, True)
    started = time.monotonic()
    early, late = [], []
    while time.monotonic() - started < 1.2:
        time.sleep(0.02)
        (early if time.monotonic() - started < 0.4 else late).extend(
            r.agent_request for r in s.plan().renews)
        if 0.4 <= time.monotonic() - started < 0.8:
            late.clear()  # about the hold's end: either way
    assert {"held", "matched", "unsaid"} <= set(early), early
    assert late and set(late) == {"unsaid"}, late
    # Still queued: allocated, it is asked for as any other.
    s.after_alloc("held", params(**{PARAM_REQUEST: "held", PARAM_HOLD: 0.6}), [1, 2, 3, 4], 50, 50, prompt)
    assert [r.agent_request for r in s.plan().recvs] == ["held"]


def test_kernel_ids():
    assert kernel_ids([0, 3], 2) == [0, 1, 6, 7]


def test_a_failed_load_vllm_ends_is_cancelled_at_the_other_ranks_and_an_abort_in_flight_too():
    # vLLM ends a request whose load failed at one rank (policy fail) and holds its blocks until
    # every rank reported it received: the other ranks' receives are cancelled (they ran to
    # their end or the lease), and the connector holds nothing. An abort in flight is cancelled;
    # vLLM holds its blocks itself until it is reported received.
    s = SchedulerState(16)
    for rid in ("failed", "aborted"):
        p = params(**{PARAM_REQUEST: rid})
        s.matched_tokens(rid, p, 50, 0)
        s.after_alloc(rid, p, [1, 2, 3, 4], 50, 50)
    s.plan()
    assert s.finished("failed", {}, False, [1, 2, 3, 4], 0, "e", load_failed=True) == (False, None)
    assert s.finished("aborted", {}, False, [1, 2, 3, 4], 0, "e") == (False, None)
    assert s.plan().cancels == ["failed", "aborted"]
    # A vLLM that does not hold them (before its PR 32255): the connector holds an abort's, and
    # a failed load's are freed at once (a rank's later report would name a request vLLM freed).
    old = SchedulerState(16, vllm_holds=False)
    for rid in ("failed", "aborted"):
        p = params(**{PARAM_REQUEST: rid})
        old.matched_tokens(rid, p, 50, 0)
        old.after_alloc(rid, p, [1, 2, 3, 4], 50, 50)
    old.plan()
    assert old.finished("failed", {}, False, [1, 2, 3, 4], 0, "e", load_failed=True) == (False, None)
    assert old.finished("aborted", {}, False, [1, 2, 3, 4], 0, "e") == (True, None)
    assert old.plan().cancels == ["aborted"]


def test_a_load_that_failed_at_one_rank_is_cancelled_at_the_other_and_each_reports_once():
    # Tensor parallel 2, policy fail: rank 0's load failed (reported received, with errors);
    # rank 1's still runs. The cancel vLLM's end of the request brings reaches both: rank 0
    # has nothing in flight and reports nothing more; rank 1 cancels and reports the request
    # received once the agent answers, so vLLM frees the blocks then (not at rank 1's lease).
    from pdpair_vllm.client import Event
    clients = [_Client(), _Client()]
    ranks = [WorkerState(c, _Saves()) for c in clients]
    for w in ranks:
        w.start(Plan(recvs=[_recv("r", [3])]))
    clients[0].finished.append(Event("RequestFailed", "a-r", {"type": "RequestFailed", "request": "a-r",
                                                               "reasons": ["ChecksumMismatch"], "message": "x"}))
    first = ranks[0].poll()
    assert (first.finished_recving, first.failed_recving) == ({"r"}, {"r"})
    assert ranks[1].poll() == Results()
    for w in ranks:
        w.start(Plan(cancels=["r"]))
    cancels = [[r for kind, r in c.calls if kind == "cancel"] for c in clients]
    assert cancels == [[], ["a-r"]]
    assert ranks[0].poll() == Results()
    clients[1].finished.append(Event("Cancelled", "a-r", {"type": "Cancelled", "request": "a-r"}))
    assert ranks[1].poll().finished_recving == {"r"}
    assert ranks[1].poll() == Results()


@pytest.mark.parametrize("vllm_holds", [True, False])
def test_an_aborted_receive_is_reported_once_each_rank_as_its_vllm_frees_it(vllm_holds):
    # A vLLM that holds an aborted receive's blocks frees them when every rank reported it
    # received (and asserts on a send's end for a request it freed); an older one frees them
    # when the connector, which held them, reports them sent.
    from pdpair_vllm.client import Event
    client = _Client()
    w = WorkerState(client, _Saves(), vllm_holds=vllm_holds)
    w.start(Plan(recvs=[_recv("c", [3]), _recv("landed", [4])]))
    client.finished.append(Event("RequestDone", "a-landed", {"type": "RequestDone", "request": "a-landed"}))
    assert w.poll().finished_recving == {"landed"}
    # Both aborted: "c" while in flight, "landed" in the step its KV was reported in.
    w.start(Plan(cancels=["c", "landed"]))
    got = w.poll()
    client.finished.append(Event("Cancelled", "a-c", {"type": "Cancelled", "request": "a-c"}))
    got2 = w.poll()
    sent = got.finished_sending | got2.finished_sending
    received = got.finished_recving | got2.finished_recving
    if vllm_holds:
        assert (sent, received) == (set(), {"c"})
    else:
        assert (sent, received) == ({"c", "landed"}, set())
    assert w.poll() == Results()


def test_the_stager_is_told_before_the_agent_is_asked_for_new_receives():
    # The direct path's agent may write a receive's blocks as soon as it is asked: the engine's
    # queued kernels (reading what those blocks held) must be done first. The client records the
    # order of calls (no agent needed for the order).
    calls = []

    class Recording(Stager):
        def before_receive(self):
            calls.append("before_receive")
            return 7  # the pool's event recorded after the engine's work so far

    class Client:
        closed = None

        def expect_kv(self, request, *args, **kw):
            calls.append(f"expect_kv {request} event {kw.get('event')}")

    w = WorkerState(Client(), Recording())
    w.start(Plan())
    assert calls == [], "no receives: nothing to wait for"
    recv = lambda r: Recv(request=r, agent_request=f"a-{r}", prefill_ranks=["10.0.0.1:7000"], logical_blocks=[1],
                          first_token=0, num_tokens=16)
    w.start(Plan(recvs=[recv("r1"), recv("r2")]))
    assert calls == ["before_receive", "expect_kv a-r1 event 7", "expect_kv a-r2 event 7"]


@pytest.mark.parametrize(
    "field,value",
    [(PARAM_REQUEST, "\ud800"), (PARAM_REQUEST, "r" * 513), (PARAM_RANKS, ["10.0.0.1:7000"] * 1025),
     (PARAM_RANKS, ["\udfff"]), (PARAM_RANKS, ["a" * 257]), (PARAM_RANKS, ["p.example:7000"]),
     (PARAM_RANKS, ["10.0.0.1"]), (PARAM_RANKS, ["10.0.0.1:0"]), (PARAM_RANKS, ["10.0.0.1:65536"]),
     (PARAM_RANKS, ["::1:7000"]), (PARAM_RANKS, ["[::1]:7000x"]), (PARAM_RANKS, ["[::1]:7000", "10.0.0.1:+1"]),
     (PARAM_TOKENS, (1 << 40) + 1), (PARAM_RELEASE, "ab" * 31), (PARAM_RELEASE, "AB" * 32),
     (PARAM_RELEASE, "zz" * 32), (PARAM_RELEASE, 7), (PARAM_HOLD, 0), (PARAM_HOLD, -1.5), (PARAM_HOLD, True),
     (PARAM_HOLD, "300"), (PARAM_HOLD, float("nan")), (PARAM_HOLD, float("inf")), (PARAM_HOLD, 1e10)],
)
def test_params_the_agent_could_not_take_are_refused_before_reaching_it(field, value):
    # A lone surrogate is escaped by json.dumps but cannot be decoded by the agent (it closed the
    # connection, every transfer of the rank with it); an oversized id or list failed the frame
    # (the worker's step raised). Both are the client's: the request is computed locally.
    with pytest.raises(ValueError, match=field):
        check_params(params(**{field: value}))


def test_ranks_named_twice_count_once():
    ranks = ["10.0.0.1:1", "[fd00::2]:2", "10.0.0.1:1"]
    assert check_params(params(**{PARAM_RANKS: ranks}))[1] == ["10.0.0.1:1", "[fd00::2]:2"]


def test_remote_decode_asked_of_an_engine_with_no_prefill_rank_is_ignored_not_fatal(caplog):
    # A decode engine's workers offer no address; a client's do_remote_decode there raised inside
    # request_finished and took the engine core down.
    s = SchedulerState(16)
    assert s.finished("r", {"do_remote_decode": True}, True, [1, 2], 20, "e") == (False, None)
    assert "0 of this engine's 1 prefill ranks are registered" in caplog.text
    assert s.plan().empty()


class _Client:
    """Records what a worker asks of its agent; answers come from ``finished``."""

    def __init__(self):
        self.calls = []
        self.finished = []
        self.closed = None
        self.refuse = False
        self.address = "10.0.0.1:7000"
        self.hold_s = None

    def release(self, request, prefill, **kw):
        self.calls.append(("release", request))

    def close(self):
        self.calls.append(("close", None))

    def release_pools(self):
        self.calls.append(("release_pools", None))

    def expect_kv(self, request, *args, **kw):
        if self.refuse:
            from pdpair_vllm.client import AgentError
            raise AgentError("sending ExpectKv: [Errno 32] Broken pipe")
        self.calls.append(("expect_kv", request))

    def kv_ready(self, request, *args, **kw):
        self.calls.append(("kv_ready", request))

    def cancel(self, request):
        self.calls.append(("cancel", request))

    def renew(self, request, prefills, **kw):
        self.calls.append(("renew", request))

    def take_finished(self):
        out, self.finished = self.finished, []
        return out


def test_a_release_or_renewal_naming_a_transfer_in_flight_is_not_sent():
    # The agent's answer to a Release or Renew names only the id: for one in flight here (a
    # client's copy of another request's params, aborted or queued; or a prefill's own id) it
    # ended that transfer, whose blocks vLLM then freed while the agent still wrote into them.
    from pdpair_vllm.transfer import Release, Send
    client = _Client()
    w = WorkerState(client, _Saves())
    w.start(Plan(recvs=[_recv("a", [1])]))
    w.save(Plan(sends=[Send("own", [3], 16)]))
    client.calls.clear()
    w.start(Plan(releases=[Release("a-a", ["10.0.0.1:7000"]), Release("other", ["10.0.0.1:7000"])],
                 renews=[Release("own", ["10.0.0.1:7000"]), Release("a-a", ["10.0.0.1:7000"]),
                         Release("queued", ["10.0.0.1:7000"])]))
    assert client.calls == [("release", "other"), ("renew", "queued")], client.calls
    assert w.poll() == Results(), "nothing in flight ended"


def test_a_receive_naming_a_transfer_in_flight_is_failed_locally_and_the_first_keeps_its_answer():
    # Two requests whose params name one prefill request (a client's copy), or a receive naming
    # this engine's own prefill in flight: asking the agent again overwrote the first's entry, so
    # the first's answer was lost (its blocks held for good) or applied to the second (which then
    # loaded blocks the agent never wrote).
    from pdpair_vllm.client import Event
    from pdpair_vllm.transfer import Send
    client = _Client()
    loads = []

    class Loads(Stager):
        def load(self, blocks):
            loads.append(blocks)

        def save(self, blocks):
            pass

    w = WorkerState(client, Loads())
    recv = lambda r, blocks: Recv(request=r, agent_request="p-1", prefill_ranks=["10.0.0.1:7000"],
                                  logical_blocks=blocks, first_token=0, num_tokens=16)
    w.start(Plan(recvs=[recv("a", [1])]))
    w.start(Plan(recvs=[recv("b", [2])]))
    assert client.calls == [("expect_kv", "p-1")], "the agent is asked once"
    got = w.poll()
    assert got.failed_recving == {"b"} and got.error_blocks == {2} and got.finished_recving == {"b"}
    client.finished.append(Event("RequestDone", "p-1", {"type": "RequestDone", "request": "p-1"}))
    got = w.poll()
    assert got.finished_recving == {"a"} and not got.failed_recving and loads == [[1]]
    # This engine's own prefill in flight, named by a receive: the receive fails; the send keeps
    # its answer. And a send whose id a receive holds is not offered.
    w.save(Plan(sends=[Send("own", [3], 16)]))
    w.start(Plan(recvs=[Recv(request="c", agent_request="own", prefill_ranks=["x:1"], logical_blocks=[4],
                             first_token=0, num_tokens=16)]))
    assert w.poll().failed_recving == {"c"}
    client.finished.append(Event("RequestDone", "own", {"type": "RequestDone", "request": "own"}))
    assert w.poll().finished_sending == {"own"}
    w.start(Plan(recvs=[Recv(request="d", agent_request="held", prefill_ranks=["x:1"], logical_blocks=[5],
                             first_token=0, num_tokens=16)]))
    w.save(Plan(sends=[Send("held", [6], 16)]))
    assert ("kv_ready", "held") not in client.calls
    assert w.poll().finished_sending == {"held"}


def test_a_receive_asked_while_a_release_of_its_id_is_unanswered_is_failed_locally():
    # A client's copy of a request's params, aborted while queued, sends a Release of P's id;
    # the real request's receive, asked for before that release's answer came, was ended by it
    # (the answer names only the id), and vLLM freed its blocks while P's KV was still on its
    # way into them.
    from pdpair_vllm.client import Event
    from pdpair_vllm.transfer import Release
    client = _Client()
    w = WorkerState(client, Stager())
    w.start(Plan(releases=[Release("p-1", ["10.0.0.1:7000"], "digest-y")]))
    recv = Recv(request="real", agent_request="p-1", prefill_ranks=["10.0.0.1:7000"], logical_blocks=[1],
                first_token=0, num_tokens=16, prompt="digest-x")
    w.start(Plan(recvs=[recv]))
    assert ("expect_kv", "p-1") not in client.calls, "not asked while the release is unanswered"
    got = w.poll()
    assert got.failed_recving == {"real"} and got.finished_recving == {"real"}, "failed locally, at once"
    client.finished.append(Event("Released", "p-1", {"type": "Released", "request": "p-1"}))
    got = w.poll()
    assert not got.finished_recving and not got.failed_recving, "the release's answer ends nothing of vLLM's"
    # Answered: the id may be asked for again.
    w.start(Plan(recvs=[Recv(request="again", agent_request="p-1", prefill_ranks=["10.0.0.1:7000"],
                             logical_blocks=[2], first_token=0, num_tokens=16)]))
    assert ("expect_kv", "p-1") in client.calls


def test_a_workers_outcomes_are_bounded():
    from pdpair_vllm import transfer
    from pdpair_vllm.client import Event
    client = _Client()
    w = WorkerState(client, Stager())
    for i in range(transfer.KEPT + 10):
        w.start(Plan())
        w._open[f"s{i}"] = ("send", f"s{i}", None)
        client.finished.append(Event("RequestDone", f"s{i}", {"type": "RequestDone", "request": f"s{i}"}))
        w.poll()
    assert len(w.outcomes) == transfer.KEPT
    assert f"s{transfer.KEPT + 9}" in w.outcomes and "s0" not in w.outcomes


def test_a_prompt_digest_covers_the_tokens_and_what_else_the_kv_depends_on():
    tokens = list(range(100, 150))
    base = Prompt(tokens, [["salt", "s"]], [("img", 10, 5)])
    d = base.digest(40)
    assert d == Prompt(list(tokens), [["salt", "s"]], [("img", 10, 5)]).digest(40), "a function of its inputs"
    assert len(bytes.fromhex(d)) == 32
    others = [
        Prompt(tokens[:39] + [7] + tokens[40:], [["salt", "s"]], [("img", 10, 5)]).digest(40),  # one token
        base.digest(39),  # fewer tokens
        Prompt(tokens, [["salt", "t"]], [("img", 10, 5)]).digest(40),  # another cache salt
        Prompt(tokens, [["salt", "s"], ["lora", "a", "/a"]], [("img", 10, 5)]).digest(40),  # an adapter
        Prompt(tokens, [["salt", "s"]], [("img2", 10, 5)]).digest(40),  # another image
        Prompt(tokens, [["salt", "s"]], [("img", 11, 5)]).digest(40),  # elsewhere
    ]
    assert all(o != d for o in others) and len(set(others)) == len(others)
    # Media starting after the KV's last token do not count: D's shorter tail still matches.
    assert Prompt(tokens, [["salt", "s"]], [("img", 10, 5), ("late", 45, 2)]).digest(40) == d
    # Tokens of any size (ids past 2^32 are not cut).
    assert Prompt([1 << 33], []).digest(1) != Prompt([0], []).digest(1)
    with pytest.raises(ValueError, match="51 tokens"):
        base.digest(51)


def test_prefill_and_decode_bind_the_same_tokens_and_an_unbound_prompt_moves_no_kv(caplog):
    prompt = list(range(200, 250))
    # P computed the prompt and sampled one token; D holds 32 tokens and receives the tail.
    p = SchedulerState(16)
    p.learn_ranks({0: "10.0.0.1:7000"})
    hold, out = p.finished("p-1", {"do_remote_decode": True}, True, [1, 2, 3, 4], 50, "e",
                           prompt=Prompt(prompt + [9]))
    (send,) = p.plan().sends
    d = SchedulerState(16)
    d.after_alloc("r", out, [5, 6, 7, 8], 50, 18, Prompt(prompt))
    (recv,) = d.plan().recvs
    assert hold and send.prompt == recv.prompt == Prompt(prompt).digest(50)
    # Another prompt of the same length: another digest (the agents refuse the pair).
    d.after_alloc("r2", params(), [5, 6, 7, 8], 50, 50, Prompt(prompt[::-1]))
    assert d.plan().recvs[0].prompt != send.prompt
    # Prompt embeddings: P offers nothing, D computes locally and releases P.
    embedded = Prompt(prompt, unbound="embeddings")
    assert p.finished("p-2", {"do_remote_decode": True}, True, [1], 50, "e", prompt=embedded) == (False, None)
    assert p.plan().empty()
    assert d.matched_tokens("r3", params(), 50, 0, embedded) == (0, False)
    d.after_alloc("r3", params(), [1, 2, 3, 4], 50, 0, embedded)
    plan = d.plan()
    assert not plan.recvs and [(r.agent_request, r.prompt) for r in plan.releases] == [("p-1", None)]
    assert caplog.text.count("embeddings") == 2
    # A release names the prompt too (P counts it only for the request of that prompt): a full
    # hit, and an abort before allocation.
    d.after_alloc("r4", params(), [1, 2, 3, 4], 50, 0, Prompt(prompt))
    d.finished("r5", params(), False, [], 0, "e", prompt=Prompt(prompt[:40]))
    assert [r.prompt for r in d.plan().releases] == [send.prompt, Prompt(prompt[:40]).digest(40)]


class _Saves(Stager):
    def save(self, blocks):
        pass

    def load(self, blocks):
        pass


def test_the_event_a_stager_recorded_after_a_steps_writes_is_named_in_each_of_its_kv_readys():
    # A GPU pool in place names, in each KvReady of a step, one event recorded after all that
    # step's writes (the agent waits for it); a staged pool names none. One per step, not per
    # request: the events are a ring of 16 and a query answers for an event's latest record, so
    # with 16 or more requests finishing each step every event was recorded again each step,
    # ahead of the GPU, and the agent's wait for the one named never ended.
    class Named(Stager):
        in_place = True

        def __init__(self):
            self.n, self.recorded = 0, []

        def save(self, blocks):
            self.n += 1
            return self.n + 4

        def save_all(self, requests):
            self.recorded.append(len(requests))
            return super().save_all(requests)

    class Told(_Client):
        def kv_ready(self, request, *args, **kw):
            self.calls.append(("kv_ready", request, kw.get("event")))

    from pdpair_vllm.transfer import Send
    for stager, events in [(Named(), [6, 6]), (_Saves(), [None, None])]:
        client = Told()
        w = WorkerState(client, stager)
        w.save(Plan(sends=[Send("a", [1], 16), Send("b", [2], 16)]))
        assert client.calls == [("kv_ready", "a", events[0]), ("kv_ready", "b", events[1])], client.calls
    # Steps of 20 finished requests each: one record a step.
    stager, client = Named(), Told()
    w = WorkerState(client, stager)
    for step in range(3):
        w.save(Plan(sends=[Send(f"s{step}-{i}", [i], 16) for i in range(20)]))
    assert stager.recorded == [20, 20, 20]
    assert {e for _, _, e in client.calls[:20]} == {24} and {e for _, _, e in client.calls[20:40]} == {44}
    w.save(Plan(sends=[]))
    assert stager.recorded == [20, 20, 20], "nothing recorded for a step without sends"


def _recv(r, blocks):
    return Recv(request=r, agent_request=f"a-{r}", prefill_ranks=["10.0.0.1:7000"], logical_blocks=blocks,
                first_token=0, num_tokens=16)


def test_a_lost_agent_ends_every_transfer_in_flight_and_later_ones_never_reach_it(caplog):
    # An agent that restarts or dies closes the connection: without noticing, the open
    # receives waited forever (vLLM's requests stuck waiting for remote KV, their blocks held)
    # and so did prefill's held blocks; the next message raised into the engine's step.
    from pdpair_vllm.transfer import Release, Send
    client = _Client()
    w = WorkerState(client, _Saves())
    w.start(Plan(recvs=[_recv("r", [1, 2]), _recv("c", [3])]))
    w.save(Plan(sends=[Send("s", [4], 16)]))
    w.start(Plan(cancels=["c"]))
    assert w.poll() == Results(), "nothing ended while the agent is up"
    client.closed = "the agent closed the connection"
    got = w.poll()
    assert got.failed_recving == {"r"} and got.error_blocks == {1, 2} and got.finished_recving == {"r", "c"}
    assert got.finished_sending == {"s"}, "prefill's blocks are free; the cancelled receive is reported received"
    assert w.outcomes == {"r": "RequestFailed", "s": "RequestFailed", "c": "Cancelled"}
    assert "lost its agent connection" in caplog.text
    calls = list(client.calls)
    w.start(Plan(recvs=[_recv("late", [5])], releases=[Release("p-9", ["x:1"])]))
    w.save(Plan(sends=[Send("late-send", [6], 16)]))
    got = w.poll()
    assert got.failed_recving == {"late"} and got.error_blocks == {5} and got.finished_sending == {"late-send"}
    assert client.calls == calls, "nothing more is sent to a lost agent"
    assert caplog.text.count("lost its agent connection") == 1, "logged once"


def test_a_send_that_fails_is_not_raised_into_the_step_and_its_transfer_ends():
    client = _Client()
    client.refuse = True
    w = WorkerState(client, _Saves())
    w.start(Plan(recvs=[_recv("r", [1])]))  # raised AgentError into vLLM's step before
    got = w.poll()
    assert got.failed_recving == {"r"} and w.lost and "Broken pipe" in w.lost
    assert client.calls == [("close", None)], "the broken connection is closed"


def test_in_place_the_transfers_of_a_lost_agent_end_only_after_the_grace(monkeypatch):
    # The direct path: the agent copies into the KV cache itself, and may still have copies
    # queued until its process is gone; the blocks are not handed back before the grace.
    from pdpair_vllm import transfer

    class InPlace(_Saves):
        in_place = True

    client = _Client()
    w = WorkerState(client, InPlace())
    w.start(Plan(recvs=[_recv("r", [1])]))
    client.closed = "the agent closed the connection"
    assert not w.poll().finished_recving, "within the grace"
    monkeypatch.setattr(transfer, "LOST_GRACE_S", 0.0)
    client.transfer_bound_s = 0.2  # the agent's handshake timeout and lease: twice that
    assert not w.poll().finished_recving, "within twice the agent's bound"
    time.sleep(0.45)
    assert w.poll().failed_recving == {"r"}


class _Held(_Saves):
    in_place = True
    closed = False

    def close(self):
        self.closed = True


def _until(cond, what, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_a_lost_agent_is_registered_with_again_once_its_transfers_ended_backing_off_meanwhile(monkeypatch, caplog):
    # An agent restarted by a rollout: the rank registers again (a new pool, a new address),
    # but only once the old connection's transfers ended (in place, the old agent may still
    # write into the KV cache until the grace), after giving up the old pool (as large as the
    # KV cache: the new agent maps another), on a thread, waiting longer after each failure.
    from pdpair_vllm import transfer
    from pdpair_vllm.client import AgentError

    monkeypatch.setattr(transfer, "RECONNECT_FIRST_S", 0.05)
    monkeypatch.setattr(transfer, "LOST_GRACE_S", 0.0)
    old, new = _Client(), _Client()
    new.address, new.hold_s = "10.0.0.1:7001", 330.0
    first, new_stager = _Held(), _Held()
    tries = []

    def reconnect():
        assert first.closed and ("release_pools", None) in old.calls, "the old pool is given up first"
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise AgentError("connecting to /run/pdpair/agent.sock: [Errno 111] Connection refused")
        return new, new_stager

    w = WorkerState(old, first, reconnect=reconnect)
    old.transfer_bound_s = 0.15
    w.start(Plan(recvs=[_recv("r", [1])]))
    old.closed = "the agent closed the connection"
    lost = time.monotonic()
    while not w.poll().finished_recving:
        assert not tries and not first.closed, "nothing given up while the old agent may still write"
        assert time.monotonic() < lost + 5
        time.sleep(0.005)
    assert time.monotonic() - lost >= 0.3, "twice the agent's bound"
    _until(lambda: w.reconnections, "registered again, without a step")
    assert len(tries) == 3
    assert tries[1] - tries[0] >= 0.09 and tries[2] - tries[1] >= 0.18, "waits twice as long after each failure"
    assert w.client is new and w.stager is new_stager and w.lost is None
    assert ("close", None) in old.calls
    assert w.take_news() == ("10.0.0.1:7001", 330.0) and w.take_news() is None, "told once"
    assert "cannot register with its agent again yet (try 1" in caplog.text
    assert "registered with its agent again (now at 10.0.0.1:7001)" in caplog.text
    w.start(Plan(recvs=[_recv("r2", [2])]))
    assert new.calls == [("expect_kv", "a-r2")] and ("expect_kv", "a-r2") not in old.calls


def test_an_idle_engine_registers_again_without_a_step_and_a_shut_one_takes_no_connection(monkeypatch):
    # vLLM's engine core takes no step while it has no request: the event reader, which sees
    # the connection end, starts the reconnection.
    from pdpair_vllm import transfer

    monkeypatch.setattr(transfer, "RECONNECT_FIRST_S", 0.01)
    old, new = _Client(), _Client()
    w = WorkerState(old, _Held(), reconnect=lambda: (new, _Held()))
    old.closed = "the agent closed the connection"
    old.on_close()  # what the event reader does
    _until(lambda: w.reconnections == 1 and w.client is new, "registered again with no step")
    # The engine shuts down while a registration is under way: its connection is not kept.
    entered, gate, late, late_stager = transfer.threading.Event(), transfer.threading.Event(), _Client(), _Held()

    def slow():
        entered.set()
        gate.wait(5)
        return late, late_stager

    w._reconnect = slow
    new.closed = "the agent closed the connection"
    new.on_close()
    assert entered.wait(5)
    w.close()
    gate.set()
    _until(lambda: ("close", None) in late.calls, "the late connection closed")
    assert w.client is new and late_stager.closed


def test_an_idle_engine_whose_release_was_not_answered_registers_again_without_a_step(monkeypatch):
    # A decode engine's last request sent a Release (a full prefix hit), then its agent went
    # before answering: the open release kept the reconnection waiting for a step's poll, which an
    # idle engine never takes.
    from pdpair_vllm import transfer
    from pdpair_vllm.transfer import Release

    monkeypatch.setattr(transfer, "RECONNECT_FIRST_S", 0.01)
    old, new = _Client(), _Client()
    w = WorkerState(old, _Held(), reconnect=lambda: (new, _Held()))
    w.start(Plan(releases=[Release("p-9", ["10.0.0.1:7000"])]))
    assert "p-9" in w._open
    old.closed = "the agent closed the connection"
    old.on_close()
    _until(lambda: w.reconnections == 1 and w.client is new, "registered again with no step")


def test_a_connection_that_ended_before_the_worker_watched_it_is_registered_again_while_idle(monkeypatch):
    # The event reader starts as the client connects; the worker watches it only after the
    # stager is made (which fills a pool as large as the KV cache): an agent gone in between
    # left an idle engine unregistered until its next step.
    from pdpair_vllm import transfer

    monkeypatch.setattr(transfer, "RECONNECT_FIRST_S", 0.01)
    old, new = _Client(), _Client()
    old.closed = "the agent closed the connection"
    old.on_close = None  # nobody watched it when it ended
    w = WorkerState(old, _Held(), reconnect=lambda: (new, _Held()))
    _until(lambda: w.reconnections == 1 and w.client is new, "registered again with no step")


def test_a_sends_addresses_are_those_handed_to_decode_then():
    p = SchedulerState(16)
    p.learn_ranks({0: "10.0.0.1:7000"})
    p.finished("p-1", {"do_remote_decode": True}, True, [1], 16, "e", prompt=Prompt(list(range(16))))
    p.learn_ranks({0: "10.0.0.1:7001"})
    assert p.plan().sends[0].addresses == {0: "10.0.0.1:7000"}


def test_prefill_offers_no_kv_at_an_address_decode_was_not_told():
    # The request ended while this rank's agent was at another address (it restarted since):
    # decode dials that one, so offering the KV here would hold the blocks to the lease.
    from pdpair_vllm.transfer import Send
    client = _Client()
    w = WorkerState(client, _Saves(), rank=1)
    w.save(Plan(sends=[Send("stale", [4], 16, addresses={0: "10.0.0.2:7000", 1: "10.0.0.1:6999"}),
                       Send("ok", [5], 16, addresses={0: "10.0.0.2:7000", 1: "10.0.0.1:7000"})]))
    assert client.calls == [("kv_ready", "ok")]
    assert w.poll().finished_sending == {"stale"}, "its blocks are free at once"


def test_a_connection_lost_while_a_step_holds_the_lock_is_still_taken_up_when_the_step_ends(monkeypatch):
    # The event reader saw the end while the engine's thread was in a step past its own check:
    # an idle engine takes no further step, so the reader must not just give up.
    from pdpair_vllm import transfer

    monkeypatch.setattr(transfer, "RECONNECT_FIRST_S", 0.01)
    old, new = _Client(), _Client()
    w = WorkerState(old, _Held(), reconnect=lambda: (new, _Held()))
    with w._lock:  # a step
        old.closed = "the agent closed the connection"
        reader = transfer.threading.Thread(target=old.on_close)  # what the event reader does
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "the reader does not wait for the step"
        time.sleep(0.05)
        assert w.reconnections == 0
    _until(lambda: w.reconnections == 1, "registered again after the step")


def test_an_unanswered_release_ends_the_connection_and_a_long_held_send_does_not(monkeypatch):
    # Prefill's held blocks wait for decode for as long as its queue renews them: no bound. A
    # release (or a receive, test_agent.py) the agent leaves unanswered past twice its bound
    # and the slack: the agent is taken for broken.
    from pdpair_vllm import transfer
    from pdpair_vllm.transfer import Release, Send

    monkeypatch.setattr(transfer, "UNANSWERED_SLACK_S", 1.0)
    client = _Client()
    client.transfer_bound_s = 0.5  # 2 s in all
    w = WorkerState(client, _Saves())
    w.save(Plan(sends=[Send("s", [4], 16)]))
    time.sleep(2.5)
    assert w.poll() == Results() and w.lost is None, "a send waits as long as it is renewed"
    w.start(Plan(releases=[Release("p-9", ["x:1"])]))
    assert w.poll() == Results() and w.lost is None
    time.sleep(2.5)
    got = w.poll()
    assert "did not answer the release 'p-9'" in w.lost, w.lost
    assert ("close", None) in client.calls
    assert got.finished_sending == {"s"}, "the connection's transfers end with it"


def test_a_silent_agent_is_asked_whether_it_lives_only_while_kv_is_offered(monkeypatch):
    from pdpair_vllm import transfer
    from pdpair_vllm.transfer import Send

    monkeypatch.setattr(transfer, "PING_AFTER_S", 0.3)
    monkeypatch.setattr(transfer, "UNANSWERED_SLACK_S", 0.2)
    client = _Client()
    client.transfer_bound_s = 0.2  # 0.6 s to answer
    client.heard_at = time.monotonic()
    client.ping = lambda: client.calls.append(("ping", None))
    w = WorkerState(client, _Saves())
    time.sleep(0.4)
    w.poll()
    assert ("ping", None) not in client.calls, "nothing offered: not asked"
    w.save(Plan(sends=[Send("s", [4], 16)]))
    w.poll()
    assert client.calls.count(("ping", None)) == 1
    w.poll()
    assert client.calls.count(("ping", None)) == 1, "one question at a time"
    client.heard_at = time.monotonic()  # answered
    time.sleep(0.4)
    w.poll()
    assert client.calls.count(("ping", None)) == 2 and w.lost is None, "silent again: asked again"
    time.sleep(0.7)
    got = w.poll()
    assert "did not answer a Capabilities within 0.6 s" in w.lost, w.lost
    assert ("close", None) in client.calls
    assert got.finished_sending == {"s"}


def test_a_receive_from_several_prefill_ranks_and_its_cancel_wait_their_linking_too(monkeypatch):
    # The agent links the ranks of an ExpectKvFromPool in turn (a dial slot, the connect, the
    # handshake: three handshake timeouts each at most) before its deadline starts: a healthy
    # agent linking cold ranks was taken for broken.
    from pdpair_vllm import transfer

    monkeypatch.setattr(transfer, "UNANSWERED_SLACK_S", 0.5)
    client = _Client()
    client.transfer_bound_s, client.handshake_timeout_s = 0.25, 0.25  # 1 s for one rank
    w = WorkerState(client, _Saves())
    pool = Recv(request="r", agent_request="a-r", prefill_ranks=[f"10.0.0.{i}:7000" for i in range(4)],
                logical_blocks=[1], first_token=0, num_tokens=16)
    w.start(Plan(recvs=[pool]))
    w.start(Plan(cancels=["r"]))  # the cancel keeps the receive's ranks and start
    time.sleep(2.0)
    assert w.poll() == Results() and w.lost is None, "four ranks: 1 s and 3 s of linking"
    time.sleep(2.5)
    w.poll()
    assert "did not answer the cancel 'a-r'" in w.lost, w.lost


def test_an_engine_name_too_long_for_the_agent_is_cut_with_a_hash_of_the_whole():
    from pdpair_vllm.connector import MAX_ENGINE_NAME, engine_name, instance_name

    assert engine_name("pod-abc", "9f1c", 3) == "pod-abc-9f1c-r3"
    long_id = "e" * 300
    a, b = engine_name("pod", long_id, 0), engine_name("pod", long_id + "x", 0)
    assert len(a.encode()) <= MAX_ENGINE_NAME and a.endswith("-r0") and a.startswith("pod-eee")
    assert a != b, "names that differ past the cut stay apart"
    assert engine_name("pod", long_id, 1) != a
    assert len(engine_name("p" * 100, "é" * 200, 7).encode()) <= MAX_ENGINE_NAME
    # The engine instance every rank names: each data-parallel rank (vLLM's engine_id_dp<n>)
    # its own, cut alike.
    assert instance_name("pod-abc", "9f1c_dp0") == "pod-abc-9f1c_dp0" != instance_name("pod-abc", "9f1c_dp1")
    i = instance_name("pod", long_id)
    assert len(i.encode()) <= MAX_ENGINE_NAME and i != instance_name("pod", long_id + "x")


def test_decodes_releases_name_the_release_token_of_the_requests_params():
    # Every Release D sends for a request of P's params names the params' token: P's agent counts
    # a release whose prompt is not the request's (vLLM's stand-in of a rejected request) by it.
    token = "ab" * 32
    s = SchedulerState(16)
    s.after_alloc("full-hit", params(**{PARAM_RELEASE: token}), [1, 2, 3, 4], 50, 0)
    s.finished("aborted", params(**{PARAM_RELEASE: token}), False, [], 0, "d0")
    s.after_alloc("old-p", params(), [1, 2, 3, 4], 50, 0)
    plan = s.plan()
    assert [(r.agent_request, r.release_token) for r in plan.releases] == [("p-1", token), ("p-1", token),
                                                                           ("p-1", None)]
