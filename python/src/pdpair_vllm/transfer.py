"""The connector's state machines, engine-agnostic (no vLLM, no torch): the scheduler side decides
what moves and when a request's blocks may be freed; the worker side (one per tensor-parallel rank)
talks to its node's agent through :class:`~pdpair_vllm.client.AgentClient` and stages blocks
between the engine's KV cache and the agent's pool through a :class:`Stager`.

The flow (docs/vllm.md):

- P gets a request with ``kv_transfer_params: {"do_remote_decode": true}``; when it finishes,
  :meth:`SchedulerState.finished` holds its blocks (``delay_free``) and returns the params the proxy
  hands to D: P's request id, its ranks' agent addresses, its token count. On the next step every
  P worker copies the blocks into its pool and sends ``KvReady``; the agent's final event frees them.
- D gets those params: :meth:`SchedulerState.matched_tokens` claims every prompt token it does not
  hold (asynchronously); after allocation :meth:`SchedulerState.after_alloc` plans the receive of
  the missing tail only (pairing is by absolute token position), or a ``Release`` when D holds the
  whole prompt. Every D worker asks its agent (``ExpectKv``/``ExpectKvFromPool``); on
  ``RequestDone`` it copies the blocks from its pool into the KV cache and reports the request
  received; on ``RequestFailed`` (FailClosed checksum, lease, peer lost, refused handshake) it
  reports the request's blocks as load errors, so the engine recomputes them or fails the request.
- An abort on D while the KV is on its way keeps the request's blocks until the agent answers
  ``Cancel``: after that answer nothing writes into the pool blocks that vLLM reuses. Who holds
  them depends on the vLLM (``vllm_holds`` of :class:`SchedulerState` and :class:`WorkerState`): one that holds an aborted request waiting
  for remote KV itself (vLLM PR 32255, early 2026; 0.33 does) frees its blocks once every rank
  reports it received, which a rank does when the cancel is answered, or did already; an older
  one frees them when the connector, which then holds them (``delay_free``), reports them sent.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import logging
import secrets
import sys
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .client import AgentClient, AgentError, Event

log = logging.getLogger("pdpair_vllm")

#: Keys of the ``kv_transfer_params`` P returns and D reads (besides vLLM's own two flags).
PARAM_REQUEST = "pdpair_request"
PARAM_RANKS = "pdpair_prefill_ranks"
PARAM_TOKENS = "pdpair_num_tokens"
#: A secret P makes per request and hands only to the request's D (these params): a ``Release``
#: naming it counts for the request whatever prompt it names (vLLM's frontend that rejects a
#: request hands the connector a stand-in of prompt ``[0]`` to end, with the params).
PARAM_RELEASE = "pdpair_release_token"
#: The longest P holds the request's blocks after offering them, renewals included, in seconds
#: (its agent's ``Registered.hold_ms``): D renews a request it queues no longer than that after
#: it arrived, past which a renewal holds nothing (P takes renewals for a lease less after its
#: ``KvReady``, which P's worker sends a step after the params went out: a lease of margin).
#: Absent where P's agent did not say: D renews for as long as it queues the request.
PARAM_HOLD = "pdpair_hold_s"
#: The longest hold a client's params may name (about 31 years).
MAX_HOLD_S = 1e9


def kernel_ids(logical: Iterable[int], per_logical: int) -> List[int]:
    """vLLM's (logical) block ids as the kernel blocks the pool and the KV tensors hold."""
    return [b * per_logical + j for b in logical for j in range(per_logical)]


@dataclass
class Prompt:
    """What a request's KV is computed from, as the engine knows it: its tokens and what else
    the KV depends on. P and D derive the same :meth:`digest`, which their agents compare before
    any KV moves: a client that hands D another prompt's ``kv_transfer_params`` gets no KV (D
    would cache it under its own prompt's blocks and serve it to later requests)."""

    #: The request's tokens (prompt, then any output P computed the KV of).
    tokens: Sequence[int]
    #: What else the KV depends on, the same on P and D (JSON-able): a LoRA adapter, a cache salt.
    extras: List[list] = field(default_factory=list)
    #: Multimodal inputs: (identifier, first token, tokens) each; one starting before the KV's
    #: last token counts.
    media: List[Tuple[str, int, int]] = field(default_factory=list)
    #: Why its KV cannot be bound to it (prompt embeddings: the tokens do not say what the KV
    #: was computed from), or ``None``.
    unbound: Optional[str] = None

    def digest(self, num_tokens: int) -> str:
        """SHA-256, hex, of the first ``num_tokens`` tokens and what the KV of those depends on
        (docs/engine-api.md, "Prompt digests")."""
        if not 0 <= num_tokens <= len(self.tokens):
            raise ValueError(f"the KV of {num_tokens} tokens cannot come from a prompt of {len(self.tokens)}")
        ids = array("q", self.tokens[:num_tokens])
        if sys.byteorder != "little":
            ids.byteswap()
        keys = list(self.extras) + [["mm", i, at, n] for i, at, n in self.media if at < num_tokens]
        extra = json.dumps(keys, separators=(",", ":"), ensure_ascii=True).encode()
        h = hashlib.sha256(b"pdpair prompt v1\0")
        h.update(num_tokens.to_bytes(8, "little"))
        h.update(ids.tobytes())
        h.update(len(extra).to_bytes(8, "little"))
        h.update(extra)
        return h.hexdigest()


@dataclass
class Send:
    """P: stage ``blocks`` (vLLM's logical ids: the worker, which knows its KV cache's kernel
    block size, moves the kernel blocks they hold) of ``request`` and tell the agent they are
    ready."""

    request: str
    blocks: List[int]
    num_tokens: int
    #: The request's prompt digest (:meth:`Prompt.digest`), when the engine gave its prompt.
    prompt: Optional[str] = None
    #: The agent address of each rank (tensor rank -> address) handed to D in the request's
    #: params: a rank whose agent is at another address now (it reconnected to a restarted
    #: agent) does not offer the KV there, where no decode would ask for it.
    addresses: Optional[Dict[int, str]] = None
    #: The request's release token (``PARAM_RELEASE``), handed to D in its params.
    release_token: Optional[str] = None


@dataclass
class Recv:
    """D: receive the tail of ``agent_request`` (P's id) into ``logical_blocks`` (vLLM's ids; the
    worker receives into the kernel blocks they hold)."""

    request: str
    agent_request: str
    prefill_ranks: List[str]
    logical_blocks: List[int]
    first_token: int
    num_tokens: int
    #: D's prompt digest over ``num_tokens`` tokens, when the engine gave its prompt.
    prompt: Optional[str] = None
    #: Why no agent is asked: the worker fails the receive at once (its blocks load errors, which
    #: vLLM recomputes or fails by ``kv_load_failure_policy``), or ``None``.
    fail: Optional[str] = None


@dataclass
class Release:
    """D: nothing of ``agent_request`` is needed; P frees its blocks."""

    agent_request: str
    prefill_ranks: List[str]
    #: D's prompt digest: P counts the release only for the request of that prompt, or of
    #: ``release_token`` (from the request's params).
    prompt: Optional[str] = None
    release_token: Optional[str] = None


@dataclass
class Plan:
    """One step's work for the workers (vLLM's connector metadata)."""

    sends: List[Send] = field(default_factory=list)
    recvs: List[Recv] = field(default_factory=list)
    releases: List[Release] = field(default_factory=list)
    renews: List[Release] = field(default_factory=list)
    #: D requests aborted while their KV was on its way: cancel, free after the answer.
    cancels: List[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.sends or self.recvs or self.releases or self.renews or self.cancels)


#: Bytes of a request id, at most (the agent's bound, ``engine_api::MAX_REQUEST_ID``).
MAX_REQUEST_ID = 512
#: Prefill ranks one request may name, at most (the agent's bound), and bytes of each address
#: (``[IPv6]:port`` at its longest: the agent takes IP addresses and ports only). 1024 of them
#: fit the agent's bound on a registered engine's frame (128 KiB and the pool's block ids), which
#: addresses of any 256 bytes did not: the agent ended the rank's connection, and every
#: transfer of the rank with it, for one client's params.
MAX_RANKS = 1024
MAX_ADDRESS = 47
#: Tokens one request may have, at most (the agent's bound, 2^40).
MAX_TOKENS = 1 << 40


def _text(value: object, limit: int) -> bool:
    """A non-empty string the agent can take: UTF-8 (no lone surrogates, which JSON escapes and
    the agent cannot decode), at most ``limit`` bytes."""
    if not isinstance(value, str) or not value:
        return False
    try:
        return len(value.encode("utf-8")) <= limit
    except UnicodeEncodeError:
        return False


def _address(value: object) -> bool:
    """``ip:port`` or ``[ipv6]:port``, as the agent parses a prefill address."""
    if not _text(value, MAX_ADDRESS) or not value.isascii():
        return False
    host, _, port = value.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return False
    try:
        if host.startswith("[") and host.endswith("]"):
            ipaddress.IPv6Address(host[1:-1])
        else:
            ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def check_params(params: Optional[dict]) -> Optional[Tuple[str, List[str], int]]:
    """P's request id, ranks and token count from D's ``kv_transfer_params``, or ``None`` when
    they ask for no remote prefill. They come from a client through the proxy: untrusted, so a
    malformed field raises ``ValueError`` naming it and its value (cut short). Ranks named twice
    count once."""
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params is {_short(params)}, not an object")
    if not params or not params.get("do_remote_prefill"):
        return None
    request, ranks, tokens = params.get(PARAM_REQUEST), params.get(PARAM_RANKS), params.get(PARAM_TOKENS)
    if not _text(request, MAX_REQUEST_ID):
        raise ValueError(f"kv_transfer_params.{PARAM_REQUEST} is {_short(request)}, not a request id "
                         f"(UTF-8, 1 to {MAX_REQUEST_ID} bytes)")
    if (not isinstance(ranks, list) or not ranks or len(ranks) > MAX_RANKS
            or not all(_address(r) for r in ranks)):
        raise ValueError(f"kv_transfer_params.{PARAM_RANKS} is {_short(ranks)}, not a list of 1 to {MAX_RANKS} "
                         f"addresses (ip:port or [ipv6]:port)")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= MAX_TOKENS:
        raise ValueError(f"kv_transfer_params.{PARAM_TOKENS} is {_short(tokens)}, not a token count")
    token = params.get(PARAM_RELEASE)
    if token is not None and not _release_token(token):
        raise ValueError(f"kv_transfer_params.{PARAM_RELEASE} is {_short(token)}, not a release token "
                         f"(64 lowercase hex digits)")
    hold = params.get(PARAM_HOLD)
    if hold is not None and not (isinstance(hold, (int, float)) and not isinstance(hold, bool)
                                 and 0 < hold <= MAX_HOLD_S):
        raise ValueError(f"kv_transfer_params.{PARAM_HOLD} is {_short(hold)}, not a hold in seconds "
                         f"(above 0, at most {MAX_HOLD_S:g})")
    return request, list(dict.fromkeys(ranks)), tokens


def _release_token(value: object) -> bool:
    """32 bytes in lowercase hex, as the agent takes a release token."""
    return (isinstance(value, str) and len(value) == 64
            and all(c in "0123456789abcdef" for c in value))


def release_token(params: Optional[dict]) -> Optional[str]:
    """The release token of params :func:`check_params` took, if P gave one."""
    return params.get(PARAM_RELEASE) if params else None


def _renew_until(params: Optional[dict], now: float) -> Optional[float]:
    """When D stops renewing a request of params :func:`check_params` took that arrived at
    ``now`` (``time.monotonic()``): P's hold after it (:data:`PARAM_HOLD`), or never where P
    did not say."""
    hold = params.get(PARAM_HOLD) if params else None
    return None if hold is None else now + float(hold)


def _short(value: object) -> str:
    """A client's value for a log line: its repr, cut to 200 characters."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _remote(params: Optional[dict]) -> Optional[Tuple[str, List[str], int]]:
    """:func:`check_params`, where a malformed request must not take the engine down: it is
    logged and served without remote KV (D computes the prompt itself)."""
    try:
        return check_params(params)
    except ValueError as e:
        log.warning("pdpair: ignoring kv_transfer_params (the request is computed locally): %s", e)
        if isinstance(params, dict):
            params["do_remote_prefill"] = False
        return None


class SchedulerState:
    """The scheduler side, one per engine."""

    def __init__(self, block_size: int, renew_interval_s: float = 1.0, min_transfer_tokens: int = 1,
                 vllm_holds: bool = True, tensor: int = 1, whole_blocks: bool = True):
        """``tensor``: the engine's tensor-parallel ranks, each of which must have told its agent
        address before a prefill offers KV. ``block_size``: vLLM's (logical) block size. The kernel block size is the workers'
        to know (they read it from the KV tensors; the scheduler has no way to): plans name
        logical blocks. ``vllm_holds``: whether vLLM holds the blocks of a request aborted while
        it waits for remote KV until its workers report it received (the module's docstring).
        ``whole_blocks``: whether vLLM takes every block a request received as computed, whole
        (older ones), rather than the tokens the connector said would come (0.33)."""
        if block_size < 1:
            raise ValueError(f"block_size {block_size} is not a block size")
        self.block_size = block_size
        self.tensor = max(1, tensor)
        self.vllm_holds = vllm_holds
        self.whole_blocks = whole_blocks
        self.renew_interval_s = renew_interval_s
        #: D: a missing tail shorter than this is recomputed locally and P released (vLLM never
        #: lets a prefix hit cover the whole prompt, so a full hit is "all but a few tokens").
        self.min_transfer_tokens = max(1, min_transfer_tokens)
        #: P: each worker rank's agent address, learned from the workers.
        self.prefill_ranks: Dict[int, str] = {}
        self._plan = Plan()
        #: D: requests whose KV is on its way (vLLM id -> agent request id).
        self.receiving: Dict[str, str] = {}
        #: D: requests waiting for blocks (vLLM id -> (agent request, ranks, last renew, prompt
        #: digest, when renewals stop: ``None``, never)).
        self.queued: Dict[str, Tuple[str, List[str], float, Optional[str], Optional[float]]] = {}
        #: P: the longest its agents hold a request's blocks after it is offered, renewals
        #: included (seconds; the ranks' longest), handed to D in the params; ``None`` where
        #: the agents did not say.
        self.hold_s: Optional[float] = None
        #: P: each rank's hold (seconds; ``None`` where its agent did not say).
        self._holds: Dict[int, Optional[float]] = {}

    def learn_ranks(self, ranks: Dict[int, str]) -> None:
        """P: worker ranks' agent addresses (at startup, and again when a rank reconnected to a
        restarted agent, which listens at a new address)."""
        self.prefill_ranks.update(ranks)

    def learn_holds(self, holds: Dict[int, Optional[float]]) -> None:
        """P: how long worker ranks' agents hold an offered request's blocks
        (``Registered.hold_ms``, seconds; at startup, and again when a rank reconnected): the
        longest of the ranks' is handed to D, so D renews for as long as any rank would take it;
        none where a rank's agent did not say."""
        self._holds.update(holds)
        known = [self._holds.get(rank) for rank in self.prefill_ranks]
        self.hold_s = max(known) if known and all(h is not None and h > 0 for h in known) else None

    # --- D --------------------------------------------------------------------------------------

    def arrived(self, request: str, params: Optional[dict], num_prompt_tokens: int,
                prompt: Optional[Prompt] = None) -> None:
        """vLLM took a new request (``on_new_request``). One that asks for remote prefill is
        renewed at P from now on: vLLM asks :meth:`matched_tokens` only once the request may be
        scheduled, and while every run slot is taken (or the token budget spent) it may wait
        longer than P's lease, which would then end it (decode computes the prompt itself). It
        leaves the queue with :meth:`after_alloc` (which releases P where D took nothing) or
        :meth:`finished`."""
        remote = _remote(params)
        if remote is None or request in self.queued or (prompt is not None and prompt.unbound):
            return
        self._queue(request, remote, params, num_prompt_tokens, prompt)

    def _queue(self, request: str, remote: Tuple[str, List[str], int], params: dict, num_prompt_tokens: int,
               prompt: Optional[Prompt]) -> None:
        """D: ``request`` (``remote``: :func:`check_params` of its ``params``) waits for blocks,
        renewed at P from now on, until P's hold after now."""
        agent_request, ranks, tokens = remote
        digest = prompt.digest(min(tokens, num_prompt_tokens)) if prompt is not None else None
        now = time.monotonic()
        self.queued[request] = (agent_request, ranks, now, digest, _renew_until(params, now))

    def matched_tokens(self, request: str, params: Optional[dict], num_prompt_tokens: int,
                       num_computed_tokens: int, prompt: Optional[Prompt] = None) -> Tuple[int, bool]:
        """Tokens D will receive beyond what it holds, and whether asynchronously. None for a
        prompt whose KV cannot be bound to it (computed here; P is released after allocation)."""
        remote = _remote(params)
        if remote is None:
            return 0, False
        if prompt is not None and prompt.unbound:
            log.warning("pdpair: request %s is computed locally, not received: %s", request, prompt.unbound)
            return 0, False
        tokens = remote[2]
        count = min(tokens, num_prompt_tokens) - num_computed_tokens
        if count < self.min_transfer_tokens:
            return 0, False
        if self.whole_blocks and tokens < num_prompt_tokens and tokens % self.block_size:
            # A vLLM that counts every block it received as computed, whole: past P's tokens,
            # the rest of their last block would keep whatever it held before, and be cached
            # under this prompt (a client handing D a longer prompt with P's params). Computed
            # here; P is released after allocation. (vLLM 0.33 counts the tokens said: D
            # receives P's and computes the rest.)
            log.warning("pdpair: request %s: P computed %d of its %d prompt tokens, not whole blocks of %d; "
                        "computed locally", request, tokens, num_prompt_tokens, self.block_size)
            return 0, False
        if num_computed_tokens % self.block_size:
            # KV is received into whole blocks after D's own: with a partial one held here,
            # nothing is asked (P is released after allocation) and D computes the rest.
            log.warning("pdpair: request %s holds %d tokens of its own, not whole blocks of %d; computed locally",
                        request, num_computed_tokens, self.block_size)
            return 0, False
        if request not in self.queued:
            self._queue(request, remote, params, num_prompt_tokens, prompt)
        return count, True

    def after_alloc(self, request: str, params: Optional[dict], block_ids: Sequence[int],
                    num_prompt_tokens: int, num_external_tokens: int, prompt: Optional[Prompt] = None) -> None:
        """D allocated ``block_ids`` (all of the request's, logical) for the
        ``num_external_tokens`` it claimed: it holds the tokens before them (its own prefix hit),
        so it receives the tail, or releases P when it claimed none. ``prompt``: the request's,
        whose digest the agents check against P's."""
        remote = _remote(params)
        queued = self.queued.pop(request, None)
        if remote is None:
            return
        agent_request, ranks, tokens = remote
        params["do_remote_prefill"] = False  # one transfer per request
        total = min(tokens, num_prompt_tokens)
        if queued is not None:
            digest = queued[3]  # of the same tokens, taken when it was queued
        else:
            digest = prompt.digest(total) if prompt is not None and not prompt.unbound else None
        if num_external_tokens <= 0:
            self._plan.releases.append(Release(agent_request, ranks, digest, release_token(params)))
            return
        local = total - num_external_tokens
        if local < 0 or local % self.block_size:
            # vLLM waits for this request's KV (it said it would come): failed at once, so it
            # is computed here, not left waiting for good with its blocks held.
            why = f"a local prefix of {local} tokens is not whole blocks of {self.block_size}"
            log.warning("pdpair: request %s: %s; P released, and its blocks from there on are load errors "
                        "(recomputed or failed by kv_load_failure_policy)", request, why)
            self._plan.releases.append(Release(agent_request, ranks, digest, release_token(params)))
            held = max(local, 0) // self.block_size
            self._plan.recvs.append(Recv(request, agent_request, ranks, list(block_ids[held:]), max(local, 0),
                                         total, digest, fail=why))
            return
        held = local // self.block_size
        logical = list(block_ids[held:])
        self._plan.recvs.append(
            Recv(request, agent_request, ranks, logical, local, total, digest)
        )
        self.receiving[request] = agent_request

    def received(self, requests: Iterable[str]) -> None:
        """The workers reported these requests received (or failed)."""
        for r in requests:
            self.receiving.pop(r, None)

    # --- both -----------------------------------------------------------------------------------

    def finished(self, request: str, params: Optional[dict], completed: bool, block_ids: Sequence[int],
                 num_computed_tokens: int, engine: str, load_failed: bool = False,
                 prompt: Optional[Prompt] = None) -> Tuple[bool, Optional[dict]]:
        """vLLM's ``request_finished``: whether to hold the blocks, and the params for D.
        ``load_failed``: vLLM ended the request because its KV failed to load (the worker reported
        the transfer over; vLLM frees the blocks whatever this returns). ``prompt``: P's, whose
        digest its agent holds D's against."""
        self.queued.pop(request, None)
        if params and params.get("do_remote_prefill"):
            # D: finished before allocation (an abort): P frees its blocks.
            remote = _remote(params)
            params["do_remote_prefill"] = False
            if remote is not None:
                digest = None
                if prompt is not None and not prompt.unbound:
                    digest = prompt.digest(min(remote[2], len(prompt.tokens)))
                # vLLM's frontend that rejected the request hands a stand-in of prompt [0]: its
                # digest is not the request's, and the release token from the params counts.
                self._plan.releases.append(Release(remote[0], remote[1], digest, release_token(params)))
            return False, None
        if request in self.receiving and load_failed:
            # One rank's load failed (kv_load_failure_policy fail) and vLLM ended the request.
            # Where vLLM holds the blocks until every rank reported the request received, the
            # other ranks' receives still run (to their end or the lease): they are cancelled,
            # so the blocks free once the agents answer. A rank that reported already has
            # nothing in flight and sends nothing. An older vLLM freed the blocks at once.
            self.receiving.pop(request)
            if self.vllm_holds:
                self._plan.cancels.append(request)
            return False, None
        if request in self.receiving:
            # D: aborted while its KV is on its way (WAITING_FOR_REMOTE_KVS). Where vLLM holds
            # the blocks itself until the workers report the request received (each rank once:
            # when the agent answers the Cancel, or already, its KV landed in the step the abort
            # came in), holding them here too would ask for a send's end as well, which vLLM
            # takes for a request it may have freed already (and asserts on). An older vLLM
            # frees them at once: the connector holds them until the workers report them sent.
            self.receiving.pop(request)
            self._plan.cancels.append(request)
            return not self.vllm_holds, None
        if not params or not params.get("do_remote_decode") or not completed or not block_ids:
            return False, None
        if len(self.prefill_ranks) < self.tensor:
            # A decode engine (its workers have no address to offer), or a prefill engine whose
            # workers have not all registered (a rank that started before its agent answered):
            # nothing to send. Params naming some ranks only would have decode take those ranks'
            # heads alone. The flag comes from a client, so this must not take the engine down.
            log.warning("pdpair: request %s asks for remote decode, but %d of this engine's %d prefill ranks are "
                        "registered with their agent; its KV is not offered", request, len(self.prefill_ranks),
                        self.tensor)
            return False, None
        if prompt is not None and prompt.unbound:
            log.warning("pdpair: request %s asks for remote decode; its KV is not offered: %s", request, prompt.unbound)
            return False, None
        tokens = num_computed_tokens
        if prompt is not None and tokens > len(prompt.tokens):
            log.warning("pdpair: request %s computed %d tokens of %d known; its KV is not offered", request, tokens,
                        len(prompt.tokens))
            return False, None
        logical = list(block_ids[: -(-tokens // self.block_size)])
        digest = prompt.digest(tokens) if prompt is not None else None
        token = secrets.token_hex(32)
        self._plan.sends.append(Send(request, logical, tokens, digest,
                                     dict(self.prefill_ranks), token))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAM_REQUEST: request,
            PARAM_RANKS: [self.prefill_ranks[r] for r in sorted(self.prefill_ranks)],
            PARAM_TOKENS: tokens,
            PARAM_RELEASE: token,
            **({PARAM_HOLD: self.hold_s} if self.hold_s is not None else {}),
            "pdpair_engine": engine,
        }

    def plan(self) -> Plan:
        """This step's work (and the renewals due), handed to the workers once."""
        now = time.monotonic()
        for request, (agent_request, ranks, last, digest, until) in list(self.queued.items()):
            # Past P's hold a renewal holds nothing (P refuses it): none is sent.
            if now - last >= self.renew_interval_s and (until is None or now < until):
                self._plan.renews.append(Release(agent_request, ranks, digest))
                self.queued[request] = (agent_request, ranks, now, digest, until)
        plan, self._plan = self._plan, Plan()
        return plan


class Stager:
    """Copies blocks between an engine's KV cache and the agent's pool (host staging)."""

    #: Whether the agent reads and writes the engine's KV cache itself (the direct path), rather
    #: than a pool the engine copies through.
    in_place = False

    def save(self, blocks: List[int]) -> Optional[int]:  # KV cache -> pool
        """Copies ``blocks`` of the KV cache into the pool (or, in place, marks them written);
        returns the pool's event recorded after the writes, for the ``KvReady`` to name, if any."""
        raise NotImplementedError

    def save_all(self, requests: List[List[int]]) -> Optional[int]:
        """:meth:`save` of each request's blocks finishing in one step; returns one event recorded
        after all their writes, for each of the step's ``KvReady`` to name. One per step, not
        one per request: a GPU pool's events are a ring of 16, and ``cuEventQuery`` answers for
        an event's latest record only, so recording one per request re-recorded every event each
        step once 16 requests finished in a step, always ahead of the GPU under vLLM's async
        scheduling, and the agent's wait for the one it was named never ended (to the lease)."""
        event = None
        for blocks in requests:
            event = self.save(blocks)
        return event

    def before_receive(self) -> Optional[int]:
        """Before the agent is asked for new receives' blocks (it may write them at once);
        returns the pool's event recorded after the engine's work so far, for the ``ExpectKv``
        to name (the agent writes nothing before it passed), if any."""

    def load(self, blocks: List[int]) -> None:  # pool -> KV cache
        raise NotImplementedError

    def close(self) -> None:
        """Gives up what it holds of the agent's pool (a connection given up for a new one)."""


@dataclass
class Results:
    """What one worker reports to the scheduler after a step."""

    finished_sending: Set[str] = field(default_factory=set)
    finished_recving: Set[str] = field(default_factory=set)
    failed_recving: Set[str] = field(default_factory=set)
    error_blocks: Set[int] = field(default_factory=set)


#: Requests whose outcome and staging times a worker keeps (for logs and tests), at most.
KEPT = 4096

#: Seconds, at least, a worker whose KV cache is the agent's pool (:attr:`Stager.in_place`) waits,
#: once its agent connection is gone, before it gives up the transfers in flight: an agent that
#: still runs ends a request's transfers within twice its handshake timeout and lease (its
#: deadline, then the wind-down), so the wait is that where the agent said it
#: (``AgentClient.transfer_bound_s``). A staged worker gives them up at once (the agent never
#: touches its KV cache; its pool is read only on ``RequestDone``).
LOST_GRACE_S = 5.0

#: Seconds past twice the agent's bound (``AgentClient.transfer_bound_s``: a running agent ends a
#: request's transfers within that) a receive, its cancel or a release may go unanswered before
#: the worker takes its agent for broken (a task of the agent's that died without answering, a
#: stopped process: the connection stays up and nothing else would end the request, whose blocks
#: both sides hold) and ends the connection, as if it were lost. Not for sends: decode renews a
#: prefill's lease while its request waits in vLLM's queue, for as long as that takes (a silent
#: agent is asked whether it lives instead, :data:`PING_AFTER_S`). A receive
#: naming several prefill ranks (``ExpectKvFromPool``) gets :data:`LINK_HANDSHAKES` handshake
#: timeouts more per rank: the agent links the ranks in turn before its deadline starts.
UNANSWERED_SLACK_S = 10.0

#: Seconds an agent may be silent while this worker offers KV (a send, which nothing else times)
#: before it is asked its ``Capabilities``; unanswered past twice its bound and
#: :data:`UNANSWERED_SLACK_S`, it is taken for broken like an unanswered receive. A stopped prefill
#: agent held the engine's blocks for good.
PING_AFTER_S = 10.0

#: Handshake timeouts the agent may take to link one prefill rank: waiting for a dial slot,
#: the connect, and the handshake.
LINK_HANDSHAKES = 3

#: Seconds before a worker that lost its agent connection first tries to register again (once
#: its transfers in flight have ended), doubling after each failure up to :data:`RECONNECT_MAX_S`.
RECONNECT_FIRST_S = 0.5
RECONNECT_MAX_S = 10.0


class _Reconnector:
    """Registers one rank with its agent again, on its own thread (a connection or a
    registration may take seconds, an agent starting up, which the engine's step must not wait
    for; and an idle engine takes no steps): tries after :data:`RECONNECT_FIRST_S`, doubling the
    wait after each failure up to :data:`RECONNECT_MAX_S`, until one succeeds or it is stopped."""

    def __init__(self, worker: "WorkerState", connect: Callable[[], Tuple[AgentClient, "Stager"]]):
        self._worker = worker
        self._connect = connect
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="pdpair-agent-reconnect", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        wait, failures = RECONNECT_FIRST_S, 0
        while not self._stop.wait(wait):
            try:
                client, stager = self._connect()
            except Exception as e:  # any failure is retried
                failures += 1
                wait = min(2 * wait, RECONNECT_MAX_S)
                (log.warning if failures in (1, 10) or failures % 100 == 0 else log.debug)(
                    "pdpair: rank %d cannot register with its agent again yet (try %d: %s: %s); retrying in %.1f s",
                    self._worker.rank, failures, type(e).__name__, e, wait)
                continue
            self._worker._reconnected(self, client, stager)
            return


def _locked(method):
    """Runs a :class:`WorkerState` method under its lock (the reconnect thread swaps the
    connection under it)."""

    @functools.wraps(method)
    def run(self, *args, **kw):
        with self._lock:
            return method(self, *args, **kw)

    return run


def _keep(table: dict, key: str, value):
    """``table[key]``, set to ``value`` when absent, keeping only the newest :data:`KEPT` keys."""
    if key not in table:
        table[key] = value
        while len(table) > KEPT:
            table.pop(next(iter(table)))
    return table[key]


def _set(table: dict, key: str, value) -> None:
    _keep(table, key, value)
    table[key] = value


class WorkerState:
    """One worker rank's side: its agent connection and its staging."""

    def __init__(self, client: AgentClient, stager: Stager, rank: int = 0,
                 reconnect: Optional[Callable[[], Tuple[AgentClient, Stager]]] = None, per_logical: int = 1,
                 vllm_holds: bool = True):
        """``per_logical``: kernel blocks per vLLM block in this rank's KV cache (vLLM's block
        size over the kernel block size its attention backend took); plans name vLLM's blocks,
        the pool and the agent kernel blocks. ``reconnect`` registers this rank with its agent again (a new client and stager), for
        when the connection is lost (an agent restarted by a rollout); ``None``: never."""
        self.client = client
        self.stager = stager
        self.rank = rank
        if per_logical < 1:
            raise ValueError(f"pdpair: {per_logical} kernel blocks per block")
        self.per_logical = per_logical
        #: How an aborted receive ends (:class:`SchedulerState`): reported received (vLLM holds
        #: its blocks) or sent (the connector held them).
        self.vllm_holds = vllm_holds
        self._reconnect = reconnect
        self._reconnector: Optional[_Reconnector] = None
        self._shut = False
        # The engine's thread holds it for a step's calls; the reconnect thread to swap the
        # connection; the event reader, when the connection ends, only if it is free.
        self._lock = threading.RLock()
        #: Agent addresses a send was refused for (each logged once).
        self._stale: Set[str] = set()
        #: Times this rank registered with its agent again after losing it.
        self.reconnections = 0
        #: P: this rank's agent address and hold (``Registered.hold_ms``, seconds) after it
        #: reconnected where either changed (a restarted agent listens at another address, and
        #: takes the PDPair's lease as it is now), until the scheduler is told
        #: (:meth:`take_news`).
        self._news: Optional[Tuple[str, Optional[float]]] = None
        # agent request id -> ("send" | "recv" | "cancel" | "release", vLLM id, Recv or None)
        self._open: Dict[str, Tuple[str, str, Optional[Recv]]] = {}
        #: When each receive or release now open was sent (agent request id -> monotonic time;
        #: a cancel keeps its receive's): see :data:`UNANSWERED_SLACK_S`.
        self._asked: Dict[str, float] = {}
        #: When the agent was asked its ``Capabilities`` for want of news (:data:`PING_AFTER_S`),
        #: while that is unanswered.
        self._pinged: Optional[float] = None
        self._by_request: Dict[str, str] = {}
        self._results = Results()
        #: How each request ended with the agent (vLLM id -> final event type), for logs and tests:
        #: the last :data:`KEPT` requests.
        self.outcomes: Dict[str, str] = {}
        #: Milliseconds of staging copies per request (vLLM id -> "save"/"load" -> ms; in place, a
        #: save is the step's, for all its requests), the last :data:`KEPT` requests.
        self.staging_ms: Dict[str, Dict[str, float]] = {}
        #: Why the agent connection is gone (a send failed, or the agent closed it), and when
        #: this worker noticed; ``None`` while it is up.
        self.lost: Optional[str] = None
        self._lost_at = 0.0
        client.on_close = self._on_close
        if client.closed is not None:
            # Ended before it was watched (the event reader starts as the client connects; the
            # stager filled the pool since): an idle engine would take no step to notice.
            self._on_close()

    def _gone(self) -> bool:
        """Whether the agent connection is gone (noticed, and logged, once)."""
        why = self.lost or self.client.closed
        if why is not None and self._lost_at == 0.0:
            self.lost, self._lost_at = why, time.monotonic()
            log.error("pdpair: rank %d lost its agent connection (%s): its %d transfers in flight end as failed, and "
                      "no KV moves on this rank (its requests are computed locally, or fail, by kv_load_failure_policy) until it registers with its agent "
                      "again%s", self.rank, why, len(self._open),
                      "" if self._reconnect is not None else " (it does not try: restart the engine)")
        return why is not None

    def _grace(self) -> float:
        """Seconds an in-place worker waits after losing its agent (:data:`LOST_GRACE_S`)."""
        bound = getattr(self.client, "transfer_bound_s", None)
        return max(LOST_GRACE_S, 2 * bound) if bound is not None else LOST_GRACE_S

    def _call(self, send, *args, **kw) -> None:
        """One message to the agent; a connection that fails is noted (:meth:`_gone`) and closed
        (a write cut short leaves the stream unusable; the agent then lets this engine go), not
        raised into the engine's step."""
        try:
            send(*args, **kw)
        except AgentError as e:
            if self.lost is None:
                self.lost = str(e)
            self._gone()
            self.client.close()

    def _in_flight(self, agent_request: str, what: str) -> bool:
        """Whether ``agent_request`` is in flight here (logged, as the ``what`` not sent)."""
        if agent_request not in self._open:
            return False
        log.warning("pdpair: a %s of %s is not sent: that id is in flight here for request %s", what,
                    _short(agent_request), self._open[agent_request][1])
        return True

    def _kernel(self, logical: Sequence[int]) -> List[int]:
        """vLLM's block ids as this rank's kernel blocks."""
        return kernel_ids(logical, self.per_logical)

    def _fail_locally(self, recv: Recv) -> None:
        """A receive no agent was asked for: its blocks are load errors at once."""
        self._results.failed_recving.add(recv.request)
        self._results.error_blocks.update(recv.logical_blocks)
        self._results.finished_recving.add(recv.request)

    @_locked
    def start(self, plan: Plan) -> None:
        """Before the forward pass: ask for the KV of new receives, release, renew, cancel."""
        event = self.stager.before_receive() if plan.recvs else None
        for recv in plan.recvs:
            if recv.fail is not None:
                self._fail_locally(recv)
                continue
            if recv.agent_request in self._open:
                # The id names a transfer in flight here (another request's params, or this
                # engine's own prefill): asking again would take its answer for this one.
                log.warning("pdpair: request %s names %s, which is in flight here; its KV is computed locally",
                            recv.request, _short(recv.agent_request))
                self._fail_locally(recv)
                continue
            if self._gone():
                self._fail_locally(recv)
                continue
            # Open before it is sent: a send that fails leaves it to be given up like the rest.
            self._open[recv.agent_request] = ("recv", recv.request, recv)
            self._asked[recv.agent_request] = time.monotonic()
            self._by_request[recv.request] = recv.agent_request
            self._call(self.client.expect_kv, recv.agent_request, recv.prefill_ranks, self._kernel(recv.logical_blocks),
                       recv.num_tokens, recv.first_token, prompt=recv.prompt, event=event)
        if not self._gone():
            # Every rank releases every prefill rank, in one message (a second release of the
            # name while the first is expected is refused); a prefill rank serving several
            # decode ranks (more of them than prefill ranks) waits for each one's. One renews
            # for all.
            # A release or renewal naming a transfer in flight here (a client's copy of another
            # request's params, or of this engine's own prefill's id) is not sent: the agent's
            # answer to it names only the id, and would end the transfer in flight (its blocks
            # freed while the agent still writes into them, or a prefill's while decode reads).
            # A release is open until answered: its answer names only the id, and would end a
            # receive of that id asked for meanwhile (a client's copy of the params, aborted while
            # queued, then the real request), whose blocks vLLM would then free while the agent
            # still writes into them. Such a receive fails locally instead (above).
            for rel in plan.releases:
                if not self._in_flight(rel.agent_request, "release"):
                    self._open[rel.agent_request] = ("release", "(a release)", None)
                    self._asked[rel.agent_request] = time.monotonic()
                    self._call(self.client.release, rel.agent_request, list(rel.prefill_ranks), prompt=rel.prompt,
                               release_token=rel.release_token)
            for ren in plan.renews if self.rank == 0 else ():
                if self._in_flight(ren.agent_request, "renewal"):
                    continue
                self._call(self.client.renew, ren.agent_request, list(ren.prefill_ranks), prompt=ren.prompt)
        for request in plan.cancels:
            agent_request = self._by_request.get(request)
            if agent_request is None or agent_request not in self._open:
                # Nothing in flight here: this rank reported the request received (or failed)
                # already. A vLLM that holds the blocks frees them once every rank has; for an
                # older one the connector holds them, until reported sent.
                if not self.vllm_holds:
                    self._results.finished_sending.add(request)
                continue
            # Keeps the receive (its ranks: how long the agent may take, _check_answered).
            self._open[agent_request] = ("cancel", request, self._open[agent_request][2])
            if not self._gone():
                self._call(self.client.cancel, agent_request)

    @_locked
    def save(self, plan: Plan) -> None:
        """After the forward pass: stage finished prefills into the pool and announce them."""
        offered = []
        for send in plan.sends:
            if send.request in self._open:
                # A receive here claims this id (a client named it): the send cannot be told
                # apart from it, so it is not offered; its blocks are free.
                log.warning("pdpair: request %s is in flight here as a receive; its KV is not offered", send.request)
                self._results.finished_sending.add(send.request)
                continue
            if self._gone():
                self._results.finished_sending.add(send.request)  # no agent to offer it to
                continue
            told = send.addresses.get(self.rank) if send.addresses is not None else self.client.address
            if told != self.client.address:
                # D was told another address for this rank (its agent restarted between the
                # request's end and now): no decode would ask this agent for it.
                (log.debug if str(told) in self._stale else log.error)(
                    "pdpair: request %s was handed to decode with agent address %s for rank %d, which is at %s now; "
                    "its KV is not offered (and no more requests handed out so are logged). If every request "
                    "says so, this vLLM does not tell its scheduler a new address (worker metadata, vLLM 0.33 "
                    "on): restart the engine", send.request, told, self.rank, self.client.address)
                if len(self._stale) < KEPT:
                    self._stale.add(str(told))
                self._results.finished_sending.add(send.request)
                continue
            offered.append((send, self._kernel(send.blocks)))
        if not offered:
            return
        if self.stager.in_place:
            # One event after the step's writes, named by each of its requests.
            t = time.perf_counter()
            event = self.stager.save_all([blocks for _, blocks in offered])
            took = (time.perf_counter() - t) * 1e3
            for send, blocks in offered:
                self._announce(send, blocks, event, took)
            return
        # Staged: each request announced as soon as its own copy is in the pool.
        for send, blocks in offered:
            t = time.perf_counter()
            event = self.stager.save(blocks)
            self._announce(send, blocks, event, (time.perf_counter() - t) * 1e3)

    def _announce(self, send, blocks: List[int], event: Optional[int], staging_ms: float) -> None:
        """Offers a finished prefill's KV to the agent (its blocks in the pool)."""
        _keep(self.staging_ms, send.request, {})["save"] = staging_ms
        self._open[send.request] = ("send", send.request, None)
        self._call(self.client.kv_ready, send.request, blocks, send.num_tokens, prompt=send.prompt, event=event,
                   release_token=send.release_token)

    @_locked
    def poll(self) -> Results:
        """Applies the agent's final events since the last call and returns what to report.
        Once the agent connection is gone the transfers still open end as failed (after
        :data:`LOST_GRACE_S` where the agent works in the KV cache itself)."""
        for event in self.client.take_finished():
            self._apply(event)
        self._check_answered()
        self._check_alive()
        if self._open and self._gone() and not (
                self.stager.in_place and time.monotonic() - self._lost_at < self._grace()):
            for agent_request, (kind, _, _) in list(self._open.items()):
                end = "Cancelled" if kind == "cancel" else "RequestFailed"
                self._apply(Event(end, agent_request, {"type": end, "request": agent_request,
                                                        "reasons": ["AgentConnectionLost"], "message": self.lost}))
        self._begin_reconnect()
        results, self._results = self._results, Results()
        return results

    def _check_answered(self) -> None:
        """Ends the connection, as lost, once a receive, cancel or release has gone unanswered
        for twice the agent's bound and :data:`UNANSWERED_SLACK_S`, and a receive from several
        prefill ranks their linking (:data:`LINK_HANDSHAKES`); an agent that did not say its
        bound is not timed."""
        for agent_request in [r for r in self._asked if self._open.get(r, ("send",))[0] == "send"]:
            del self._asked[agent_request]  # answered (or given up)
        bound = getattr(self.client, "transfer_bound_s", None)
        if bound is None or not self._asked or self._gone():
            return
        handshake = getattr(self.client, "handshake_timeout_s", None) or 0.0

        def limit(agent_request: str) -> float:
            _, _, recv = self._open[agent_request]
            ranks = len(recv.prefill_ranks) if recv is not None else 1
            linking = LINK_HANDSHAKES * handshake * ranks if ranks > 1 else 0.0
            return 2 * bound + linking + UNANSWERED_SLACK_S

        now = time.monotonic()
        for late, asked in self._asked.items():
            waited = limit(late)
            if now - asked > waited:
                break
        else:
            return
        kind, request, _ = self._open[late]
        self._give_up(f"the agent did not answer the {kind} {_short(late)} (request {request}) within {waited:.1f} s "
                      f"(twice its handshake timeout and lease, its prefill ranks' linking, and {UNANSWERED_SLACK_S:g} s): "
                      "it is taken as broken")

    def _check_alive(self) -> None:
        """While KV is offered, asks a silent agent whether it lives (:data:`PING_AFTER_S`), and
        ends the connection, as lost, when it does not answer within twice its bound and
        :data:`UNANSWERED_SLACK_S`; an agent that did not say its bound is not asked."""
        bound = getattr(self.client, "transfer_bound_s", None)
        heard = getattr(self.client, "heard_at", None)
        if self._pinged is not None and (heard is None or heard >= self._pinged):
            self._pinged = None  # answered (or a new connection)
        offering = any(kind == "send" for kind, _, _ in self._open.values())
        if bound is None or heard is None or not offering or self._gone():
            return
        now = time.monotonic()
        if self._pinged is None:
            if now - heard > PING_AFTER_S:
                self._pinged = now
                self._call(self.client.ping)
            return
        waited = 2 * bound + UNANSWERED_SLACK_S
        if now - self._pinged > waited:
            self._give_up(f"the agent, silent for {now - heard:.1f} s while this rank offered KV, did not answer a "
                          f"Capabilities within {waited:.1f} s (twice its handshake timeout and lease, and "
                          f"{UNANSWERED_SLACK_S:g} s): it is taken as broken")

    def _give_up(self, why: str) -> None:
        """Takes a connected agent for broken: the connection ends as if it were lost."""
        self.lost = why
        self._gone()
        self.client.close()

    def _on_close(self) -> None:
        """The event reader saw the connection end: an idle engine takes no steps, so the
        reconnection starts from here, on a thread of its own once the lock is free (a step, or
        the engine closing this connection while it waits for this reader, may hold it)."""
        threading.Thread(target=self._begin_reconnect_locked, name="pdpair-agent-lost", daemon=True).start()

    def _begin_reconnect_locked(self) -> None:
        with self._lock:
            self._begin_reconnect()

    def _begin_reconnect(self) -> None:
        """Once the connection is lost and every transfer of it has ended, gives up the old
        pool (a rank's pool is as large as its KV cache, and the new agent maps another) and
        registers again on a thread (:class:`_Reconnector`). Nothing of the old connection
        carries over: its requests ended as failed, and the new agent knows none of them."""
        if self._gone():
            # A release waits for nothing of vLLM's (its request ended): unanswered, it is given
            # up with the connection. Left open, only a step's poll ended it, and an idle engine
            # (vLLM takes no step without requests) never registered again.
            for agent_request in [r for r, (kind, _, _) in self._open.items() if kind == "release"]:
                del self._open[agent_request]
        if self._reconnect is None or self._reconnector is not None or self._shut or self._open or not self._gone():
            return
        self.stager.close()
        self.stager = Stager()
        self.client.release_pools()
        self._reconnector = _Reconnector(self, self._reconnect)

    def _reconnected(self, reconnector: _Reconnector, client: AgentClient, stager: Stager) -> None:
        """The reconnect thread registered again: the new connection is this rank's from now on."""
        with self._lock:
            if self._shut or reconnector is not self._reconnector:
                client.close()
                stager.close()
                return
            old = self.client
            # Watched before it is this rank's: whoever sees it as `self.client` (without the
            # lock) finds it watched.
            client.on_close = self._on_close
            self.client, self.stager, self._reconnector = client, stager, None
            self.lost, self._lost_at = None, 0.0
            self.reconnections += 1
            old.close()
            if client.address != old.address or client.hold_s != old.hold_s:
                self._news = (client.address, client.hold_s)
            log.warning("pdpair: rank %d registered with its agent again%s; its KV moves again", self.rank,
                        f" (now at {client.address})" if client.address else "")
            if client.closed is not None:  # ended before it was watched
                self._begin_reconnect()

    @_locked
    def take_news(self) -> Optional[Tuple[str, Optional[float]]]:
        """P: this rank's agent address and hold, once after either changed (the scheduler hands
        them to D)."""
        news, self._news = self._news, None
        return news

    def close(self) -> None:
        """The engine shuts down: the connection is closed and no reconnection is taken."""
        with self._lock:
            self._shut = True
            if self._reconnector is not None:
                self._reconnector.stop()
            self.client.close()

    def _apply(self, event: Event) -> None:
        entry = self._open.pop(event.request, None)
        if entry is None:
            return
        kind, request, recv = entry
        if kind == "release":
            # Answered: nothing of a vLLM request's was waiting on it.
            return
        if kind == "cancel" and event.type != "Cancelled":
            # The request's own end crossed the Cancel: its answer is still to come.
            self._open[event.request] = entry
            return
        self._by_request.pop(request, None)
        _set(self.outcomes, request, event.type)
        r = self._results
        if kind == "send":
            # P: done, failed or released: the blocks are free.
            r.finished_sending.add(request)
            return
        if kind == "cancel":
            # D: the cancel was answered; nothing writes into the blocks any more. Reported as
            # received (the request's one report from this rank) where vLLM holds them, as sent
            # where the connector did.
            (r.finished_recving if self.vllm_holds else r.finished_sending).add(request)
            return
        assert recv is not None
        if event.type == "RequestDone":
            t = time.perf_counter()
            self.stager.load(self._kernel(recv.logical_blocks))
            _keep(self.staging_ms, request, {})["load"] = (time.perf_counter() - t) * 1e3
        else:
            log.warning("pdpair: receiving request %s (%s) failed: %s: %s", request, event.request,
                        ",".join(event.reasons) or event.type, event.message)
            r.failed_recving.add(request)
            r.error_blocks.update(recv.logical_blocks)
        r.finished_recving.add(request)
