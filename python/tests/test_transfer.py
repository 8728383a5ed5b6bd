"""The engine-agnostic state machines without vLLM: what the scheduler side plans from
``kv_transfer_params`` (untrusted: they come from a client through the proxy)."""

from __future__ import annotations

import time

import pytest

from pdpair_vllm.transfer import (PARAM_RANKS, PARAM_REQUEST, PARAM_TOKENS, Plan, Recv, SchedulerState, Stager,
                                  WorkerState, check_params, kernel_ids)


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
    s = SchedulerState(16, 16)
    bad = params(**{field: value})
    assert s.matched_tokens("r", bad, 50, 0) == (0, False)
    assert field in caplog.text
    s.after_alloc("r", bad, [1, 2, 3, 4], 50, 0)
    assert s.plan().empty(), "nothing is asked of any agent"


def test_decode_asks_for_the_tail_after_its_prefix_hit_in_kernel_blocks():
    s = SchedulerState(block_size=32, kernel_block_size=16)
    p = params()
    assert s.matched_tokens("r", p, 50, 32) == (18, True)
    s.after_alloc("r", p, [7, 3], 50, 18)
    (recv,) = s.plan().recvs
    assert (recv.agent_request, recv.first_token, recv.num_tokens) == ("p-1", 32, 50)
    assert recv.logical_blocks == [3] and recv.blocks == [6, 7]
    assert p["do_remote_prefill"] is False, "one transfer per request"
    assert s.plan().empty(), "handed to the workers once"


def test_a_short_tail_is_recomputed_and_prefill_released():
    s = SchedulerState(16, 16, min_transfer_tokens=16)
    p = params(**{PARAM_TOKENS: 49})
    assert s.matched_tokens("r", p, 49, 48) == (0, False)
    s.after_alloc("r", p, [1, 2, 3, 4], 49, 0)
    plan = s.plan()
    assert not plan.recvs and [r.agent_request for r in plan.releases] == ["p-1"]


def test_a_queued_request_is_renewed_until_it_is_allocated():
    s = SchedulerState(16, 16, renew_interval_s=0.05)
    p = params()
    assert s.matched_tokens("r", p, 50, 0) == (50, True)
    assert not s.plan().renews, "not due yet"
    time.sleep(0.06)
    assert [r.agent_request for r in s.plan().renews] == ["p-1"]
    s.after_alloc("r", p, [1, 2, 3, 4], 50, 50)
    time.sleep(0.06)
    plan = s.plan()
    assert not plan.renews and len(plan.recvs) == 1


def test_prefill_holds_its_blocks_and_names_every_rank_in_order():
    s = SchedulerState(16, 16)
    s.learn_ranks({1: "b:2", 0: "a:1"})
    hold, out = s.finished("r", {"do_remote_decode": True}, True, [4, 5, 6, 9], 50, "eng")
    assert hold is True
    assert out[PARAM_RANKS] == ["a:1", "b:2"] and out[PARAM_TOKENS] == 50 and out[PARAM_REQUEST] == "r"
    (send,) = s.plan().sends
    assert send.blocks == [4, 5, 6, 9]
    # An aborted prefill sends nothing and frees at once.
    assert s.finished("x", {"do_remote_decode": True}, False, [1], 10, "eng") == (False, None)


def test_kernel_ids():
    assert kernel_ids([0, 3], 2) == [0, 1, 6, 7]


def test_a_failed_load_vllm_ends_is_not_cancelled_but_an_abort_in_flight_is():
    # vLLM ends a request whose load failed (policy fail) before it hands the connector the
    # worker's report, and frees its blocks whatever the connector says: no Cancel, no hold.
    s = SchedulerState(16, 16)
    for rid in ("failed", "aborted"):
        p = params(**{PARAM_REQUEST: rid})
        s.matched_tokens(rid, p, 50, 0)
        s.after_alloc(rid, p, [1, 2, 3, 4], 50, 50)
    s.plan()
    assert s.finished("failed", {}, False, [1, 2, 3, 4], 0, "e", load_failed=True) == (False, None)
    assert s.finished("aborted", {}, False, [1, 2, 3, 4], 0, "e") == (True, None)
    assert s.plan().cancels == ["aborted"]


def test_the_stager_is_told_before_the_agent_is_asked_for_new_receives():
    # The direct path's agent may write a receive's blocks as soon as it is asked: the engine's
    # queued kernels (reading what those blocks held) must be done first. The client records the
    # order of calls (no agent needed for the order).
    calls = []

    class Recording(Stager):
        def before_receive(self):
            calls.append("before_receive")

    class Client:
        def expect_kv(self, request, *args):
            calls.append(f"expect_kv {request}")

    w = WorkerState(Client(), Recording())
    w.start(Plan())
    assert calls == [], "no receives: nothing to wait for"
    recv = lambda r: Recv(request=r, agent_request=f"a-{r}", prefill_ranks=["10.0.0.1:7000"], logical_blocks=[1],
                          blocks=[1], first_token=0, num_tokens=16)
    w.start(Plan(recvs=[recv("r1"), recv("r2")]))
    assert calls == ["before_receive", "expect_kv a-r1", "expect_kv a-r2"]
