"""``PdpairConnector``: vLLM's V1 KV connector interface over pdpair's node agent.

A thin adapter: the decisions are in :mod:`pdpair_vllm.transfer` (engine-agnostic), the agent
protocol in :mod:`pdpair_vllm.client`. Load it with ``--kv-transfer-config
'{"kv_connector":"PdpairConnector","kv_connector_module_path":"pdpair_vllm","kv_role":"kv_producer"}'``
on prefill, ``kv_consumer`` on decode (the operator renders it, docs/vllm.md); with ``kv_both``
set ``PDPAIR_ROLE`` or ``kv_connector_extra_config.role`` to ``prefill`` or ``decode``. Where the agent accepts GPU pools, the KV tensors
themselves are its pool (:mod:`pdpair_vllm.direct`: nothing is copied by the engine); otherwise
the KV moves through the agent's host pool: P's worker copies its blocks into the pool after the
prefill, D's worker copies them from its pool into the KV cache when the agent reports them
received and verified.

``kv_connector_extra_config`` (all optional; in a pod the operator's ``PDPAIR_*`` env is used):
``role`` (prefill|decode; else ``PDPAIR_ROLE``, or from ``kv_role`` producer/consumer), ``socket``
(``PDPAIR_AGENT_SOCKET``), ``pdpair`` (``PDPAIR_NAMESPACE``/``PDPAIR_NAME``), ``pairing_key_file``
(``PDPAIR_PAIRING_KEY_FILE``), ``kv`` (identity fields vLLM cannot tell: ``model`` as the PDPair
spells it, ``attentionBackend``; else ``PDPAIR_KV``, JSON), ``settings`` (mode, checksum,
handshake_timeout_ms, lease_ms: outside a cluster, where the agent cannot read the PDPair),
``tensor_rank`` (when vLLM's distributed state is not initialised), ``renew_interval_s``,
``direct`` (``auto``, ``true`` or ``false``: the direct GPU path where it can be, required, or never).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import socket
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM >= 0.12
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM reports through get_finished only
    KVConnectorTransferResults = None
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
except ImportError:  # pragma: no cover
    KVConnectorHandshakeMetadata = object
try:  # vLLM >= 0.33: workers tell the scheduler things after a step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover
    KVConnectorWorkerMetadata = object

from . import client as agent_client
from .client import AgentClient
from . import direct
from .layout import ELEMENT_BYTES
from .staging import TorchStager, token_layout
from .transfer import Plan, Prompt, Results, SchedulerState, Stager, WorkerState, _short

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


#: What ``Scheduler`` sources said on vLLM releases the connector was tested with (release ->
#: the answer of each question below), for an image whose sources cannot be read (``.pyc``
#: only): a release here is answered as measured; any other gets the question's safe guess.
MEASURED_SCHEDULERS: Dict[Tuple[int, int], Dict[str, bool]] = {
    (0, 33): {"holds_aborted_receives": True, "counts_received_blocks_whole": False},
}


def _vllm_release() -> Optional[Tuple[int, int]]:
    """The installed vLLM's major and minor release where it is one (``0.33.0``,
    ``0.33.1+cu129`` or ``+rocm634`` -> ``(0, 33)``); ``None`` where it cannot be told or is a
    development or pre-release build (``0.33.1.dev5+g1234abc``, ``0.34.0rc1``), which may hold
    later scheduler changes than the release measured."""
    try:
        from importlib.metadata import version

        text = version("vllm")
    except Exception:  # noqa: BLE001 - any failure means "cannot tell"
        return None
    return _release_of(text)


def _release_of(text: str) -> Optional[Tuple[int, int]]:
    """:func:`_vllm_release` of version ``text``."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.\d+(?:\.post\d+)?(?:\+[A-Za-z0-9.]+)?", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _scheduler_says(method: str, text: str, question: str, unknown: bool, what: str, then: str) -> bool:
    """Whether the source of vLLM's ``Scheduler.<method>``, which says what this vLLM does where
    no release note does, holds ``text``. Where it cannot be read, the answer measured on this
    vLLM release (:data:`MEASURED_SCHEDULERS`, under ``question``), else ``unknown``, logging
    that ``what`` cannot be told and ``then`` what the connector does."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler

        source = inspect.getsource(getattr(Scheduler, method))
    except Exception as e:  # noqa: BLE001 - any failure means "cannot tell"
        release = _vllm_release()
        measured = MEASURED_SCHEDULERS.get(release, {}).get(question) if release else None
        if measured is not None:
            log.info("pdpair: vLLM's scheduler source cannot be read (%s); %s taken from its release %d.%d",
                     e, what, *release)
            return measured
        log.warning("pdpair: cannot tell %s (%s, vLLM release %s not measured); %s", what, e,
                    "unknown" if release is None else "%d.%d" % release, then)
        return unknown
    return text in source


def vllm_holds_aborted_receives() -> bool:
    """Whether this vLLM's scheduler holds the blocks of a request aborted while it waits for
    remote KV until its workers report it received (vLLM PR 32255, early 2026; 0.33 does),
    read from ``Scheduler.finish_requests`` (no release note says which version). Where that
    cannot be read, the answer measured on this release, else ``False``: the connector then
    holds the blocks itself, which a newer vLLM takes too, but for an abort in the very step
    the KV landed, where it stops the engine (loudly); the other guess, on an older vLLM,
    would free the blocks while the agent still writes into them."""
    return _scheduler_says("finish_requests", "WAITING_FOR_REMOTE_KVS", "holds_aborted_receives", False,
                           "whether vLLM holds an aborted request's blocks", "the connector holds them")


def vllm_counts_received_blocks_whole() -> bool:
    """Whether this vLLM takes every block a request received as computed, whole (older ones:
    ``len(block_ids) * self.block_size`` in ``Scheduler._update_waiting_for_remote_kv``), rather
    than the tokens the connector said would come (0.33: ``num_computed_tokens``, set at
    allocation). Where that cannot be read, the answer measured on this release, else ``True``:
    a decode prompt longer than the tokens P computed, those not whole blocks, is then computed
    locally (the safe guess: the other, on a vLLM that counts whole blocks, leaves stale KV in
    the last block's rest, cached)."""
    return _scheduler_says("_update_waiting_for_remote_kv", "* self.block_size", "counts_received_blocks_whole",
                           True, "how vLLM counts received KV", "partial last blocks are computed locally")


COMPLETED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
log = logging.getLogger("pdpair_vllm")


class PdpairMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step (sent to every worker)."""

    def __init__(self, plan: Plan):
        self.plan = plan


class PdpairHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once after the KV caches are registered (vLLM's engine core collects
    it from every worker): this rank's agent address (empty on decode), and how long its agent
    holds an offered request's blocks (``Registered.hold_ms``, seconds; ``None`` where it did
    not say)."""

    def __init__(self, address: str, hold_s: Optional[float] = None):
        self.address = address
        self.hold_s = hold_s


class PdpairWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler after a step: ranks whose agent address or hold changed (a rank
    registered with a restarted agent, which listens at a new address and holds an offered
    request's blocks as the PDPair's lease now says), which D must be told from now on."""

    def __init__(self, addresses: Dict[int, str], holds: Optional[Dict[int, Optional[float]]] = None):
        self.addresses = dict(addresses)
        self.holds = dict(holds or {})

    def aggregate(self, other: "PdpairWorkerMetadata") -> "PdpairWorkerMetadata":
        return PdpairWorkerMetadata({**self.addresses, **getattr(other, "addresses", {})},
                                    {**self.holds, **getattr(other, "holds", {})})


def _extra(vllm_config) -> dict:
    cfg = vllm_config.kv_transfer_config
    extra = getattr(cfg, "kv_connector_extra_config", None) or {}
    return dict(extra)


#: The longest engine name the agent takes (``MAX_ENGINE_NAME`` in its engine API).
MAX_ENGINE_NAME = 253


def engine_name(host: str, engine_id: str, rank: int) -> str:
    """The name this rank registers under: ``<host>-<engine_id>-r<rank>``; where that is longer
    than the agent takes (a long ``engine_id``, a long bare pod name), its start and a hash of
    the whole, so names stay apart and fit."""
    return _within(f"{host}-{engine_id}-r{rank}", f"-r{rank}")


def instance_name(host: str, engine_id: str) -> str:
    """The engine instance every rank of this engine names (``RegisterPool.instance``):
    ``<host>-<engine_id>`` (vLLM suffixes each data-parallel rank's ``engine_id`` with
    ``_dp<rank>``: an engine of its own), cut as :func:`engine_name` cuts."""
    return _within(f"{host}-{engine_id}", "")


def pod_engines(parallel_config) -> Optional[int]:
    """How many engines this engine's Pod runs (``RegisterPool.pod_engines``), where vLLM says:
    the data-parallel ranks of one group it starts in the Pod (``data_parallel_size_local``;
    external load balancing pins it to 1), each an engine of its own, whole in the Pod.
    ``None`` where it does not: a dense model's ranks (vLLM runs them as independent engines of
    data parallelism 1 each, ``reconfigure_for_independent_dp_rank``, before the connector is
    made: it sees none), ranks or workers Ray places over the cluster (its data-parallel backend
    or executor), an external launcher's, or engines spread over several nodes."""
    def whole(name: str) -> Optional[int]:
        value = getattr(parallel_config, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    data, local = whole("data_parallel_size"), whole("data_parallel_size_local")
    if data is None or data < 2 or local is None or local > data:
        return None
    if getattr(parallel_config, "data_parallel_backend", None) != "mp":
        return None
    if getattr(parallel_config, "distributed_executor_backend", None) not in ("mp", "uni"):
        return None
    try:
        spread = parallel_config.nnodes_within_dp
    except Exception:  # an older vLLM's config: not said
        return None
    return local if spread == 1 else None


def _within(name: str, suffix: str) -> str:
    """``name`` where it fits the agent's bound, else its start, a hash of the whole and
    ``suffix``."""
    if len(name.encode()) <= MAX_ENGINE_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    tail = f"-{digest}{suffix}"
    head = name.encode()[:MAX_ENGINE_NAME - len(tail)].decode(errors="ignore")
    return head + tail


def _role(vllm_config, extra: dict) -> str:
    role = extra.get("role") or os.environ.get("PDPAIR_ROLE")
    if not role:
        kv_role = vllm_config.kv_transfer_config.kv_role
        role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv_role)
    if role not in ("prefill", "decode"):
        raise ValueError(
            f"pdpair: the engine's role is {role!r}; set kv_connector_extra_config.role or PDPAIR_ROLE "
            "to prefill or decode (kv_role kv_producer/kv_consumer also say it)"
        )
    return role


#: vLLM parallelism pdpair does not move KV for, and why: refused at startup, naming the
#: setting, rather than pairing blocks that do not hold what the other side's do.
UNSUPPORTED_PARALLELISM = {
    "pipeline_parallel_size": "each pipeline stage holds only its layers' KV",
    "decode_context_parallel_size": "each rank's blocks hold only its share of the tokens",
    "prefill_context_parallel_size": "each rank computes only its share of the prompt",
}


def check_parallelism(parallel_config) -> None:
    """Raises ``ValueError`` naming the first parallelism setting above 1 that pdpair does not
    support (docs/vllm.md)."""
    for name, why in UNSUPPORTED_PARALLELISM.items():
        size = int(getattr(parallel_config, name, 1) or 1)
        if size > 1:
            raise ValueError(f"pdpair: {name} is {size}; pdpair moves KV with tensor parallelism only ({why}): "
                             "run the pools with it at 1")


def _direct_setting(value) -> Optional[bool]:
    """``kv_connector_extra_config.direct``: ``"auto"`` (the default: direct where it can be),
    ``true`` (direct or the registration fails, saying why), ``false`` (always stage)."""
    if value in ("auto", None):
        return None
    if value in (True, "true", "True"):
        return True
    if value in (False, "false", "False"):
        return False
    raise ValueError(f"pdpair: kv_connector_extra_config.direct is {value!r}, not auto, true or false")


def _prompt(request: "Request") -> Prompt:
    """What vLLM computes a request's KV from, as its prefix cache keys it: the tokens, the LoRA
    adapter (name and path), the cache salt, the multimodal inputs' identifiers and positions.
    Prompt embeddings are not bound (the token ids of an embedded prompt do not say what it
    was): such a request's KV does not move; nor does it where the request does not say all of
    that (another vLLM's ``Request``: binding less would be silent)."""
    missing = [a for a in ("lora_request", "cache_salt", "mm_features", "prompt_embeds") if not hasattr(request, a)]
    if missing:
        return Prompt(request.all_token_ids, unbound=f"this vLLM's requests do not say {', '.join(missing)}, "
                                                     "so pdpair cannot bind their KV to what it was computed from")
    extras = []
    lora = request.lora_request
    if lora is not None:
        extras.append(["lora", str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")])
    if request.cache_salt:
        extras.append(["salt", str(request.cache_salt)])
    media = [(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
             for f in request.mm_features or ()]
    unbound = None
    if request.prompt_embeds is not None:
        unbound = "its prompt is given as embeddings, which pdpair cannot bind its KV to"
    return Prompt(request.all_token_ids, extras, media, unbound)


def _prompt_if_remote(request: "Request") -> Optional[Prompt]:
    """:func:`_prompt` for a request whose KV may move (it has ``kv_transfer_params``); ``None``
    for the others, which the scheduler asks about every step they wait."""
    return _prompt(request) if _params(request) else None


def _params(request: "Request") -> Optional[dict]:
    """The request's ``kv_transfer_params`` where they are an object, else ``None``. They come
    from a client, which may put anything there (vLLM passes ``vllm_xargs``' strings, numbers
    and lists through): one that is not an object is logged and ignored, the request computed
    without remote KV, where its first use raised inside the scheduler's step and ended the
    engine."""
    params = request.kv_transfer_params
    if params is None or isinstance(params, dict):
        return params
    log.warning("pdpair: ignoring kv_transfer_params of request %s (computed locally): %s, not an object",
                _short(request.request_id), _short(params))
    # vLLM's own scheduler reads them right after on_new_request (`.get`, which a string or a
    # list does not have: the engine died there too): gone for it as well.
    request.kv_transfer_params = None
    return None


def _layer_index(name: str) -> Tuple[int, str]:
    m = re.search(r"(\d+)", name)
    return (int(m.group(1)) if m else -1, name)


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    return {"half": "float16", "float": "float32"}.get(name, name)


class PdpairConnector(KVConnectorBase_V1):
    """pdpair's KV connector (docs/vllm.md)."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """Only where the KV is always staged (``direct: false``): sleep mode frees the KV cache
        and maps new memory at the same addresses on wake, while on the direct path the agent
        holds the old allocation as the pool, so KV would land where vLLM no longer reads it and
        decode would run on whatever its cache held. vLLM refuses ``enable_sleep_mode`` then,
        naming this connector."""
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        return _direct_setting(extra.get("direct")) is False

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        check_parallelism(vllm_config.parallel_config)
        self._extra = _extra(vllm_config)
        self._engine_id = str(vllm_config.kv_transfer_config.engine_id or "vllm")
        cache = vllm_config.cache_config
        self._block_size = int(cache.block_size)
        self._sched: Optional[SchedulerState] = None
        self._worker: Optional[WorkerState] = None
        self._results = Results()
        self._errors: set = set()
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerState(self._block_size, float(self._extra.get("renew_interval_s", 1.0)),
                                         int(self._extra.get("min_transfer_tokens", 1)),
                                         vllm_holds=vllm_holds_aborted_receives(),
                                         whole_blocks=vllm_counts_received_blocks_whole(),
                                         tensor=int(vllm_config.parallel_config.tensor_parallel_size))

    # ==== scheduler side =========================================================================

    def on_new_request(self, request: "Request") -> None:
        # vLLM 0.33 calls it as a request arrives (older ones do not: their requests are renewed
        # from their first get_num_new_matched_tokens).
        if self._sched is not None:
            self._sched.arrived(request.request_id, _params(request), request.num_prompt_tokens,
                                _prompt_if_remote(request))

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        assert self._sched is not None
        return self._sched.matched_tokens(request.request_id, _params(request),
                                          request.num_prompt_tokens, num_computed_tokens, _prompt_if_remote(request))

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        ids = blocks.get_block_ids()[0] if blocks is not None else []
        self._sched.after_alloc(request.request_id, _params(request), list(ids),
                                request.num_prompt_tokens, num_external_tokens, _prompt_if_remote(request))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self._sched is not None
        return PdpairMetadata(self._sched.plan())

    def update_connector_output(self, connector_output) -> None:
        assert self._sched is not None
        self._sched.received(connector_output.finished_recving or ())
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, PdpairWorkerMetadata) and meta.addresses:
            log.warning("pdpair: prefill ranks %s registered with their restarted agents, at %s from now on",
                        sorted(meta.addresses), [meta.addresses[r] for r in sorted(meta.addresses)])
            self._sched.learn_ranks(meta.addresses)
            self._sched.learn_holds(getattr(meta, "holds", {}))

    def set_xfer_handshake_metadata(self, metadata) -> None:
        assert self._sched is not None
        ours = {int(rank): m for rank, m in metadata.items() if isinstance(m, PdpairHandshakeMetadata)}
        self._sched.learn_ranks({rank: m.address for rank, m in ours.items() if m.address})
        self._sched.learn_holds({rank: getattr(m, "hold_s", None) for rank, m in ours.items() if m.address})

    def request_finished(self, request: "Request", block_ids) -> Tuple[bool, Optional[dict]]:
        assert self._sched is not None
        ids = block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids
        status = getattr(request.status, "name", str(request.status))
        # The prompt's KV, computed: not a token past the prompt (a request that ran more than
        # its first step, or async scheduling's step in flight, whose KV may not be written
        # yet), which decode does not ask for: it asks for its prompt's tokens, and a count
        # that differs fails the transfer (TokenCountMismatch) and decode computes it all.
        in_flight = int(getattr(request, "num_in_flight_tokens", 0) or 0)
        computed = max(0, min(request.num_computed_tokens - in_flight, request.num_prompt_tokens))
        return self._sched.finished(request.request_id, _params(request), status in COMPLETED,
                                    list(ids or []), computed, self._engine_id,
                                    load_failed=status == "FINISHED_ERROR", prompt=_prompt_if_remote(request))

    # ==== worker side ============================================================================

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        tensors = [kv_caches[n] for n in names]
        first = tensors[0]
        if first.dim() not in (3, 4, 5):
            raise ValueError(
                f"pdpair: KV tensors of shape {tuple(first.shape)} are not supported: this version moves vLLM 0.33's "
                "[blocks, heads, tokens, K|V] caches, an older vLLM's [2, blocks, ...] or [blocks, 2, ...], and MLA's "
                "[blocks, block, dim] latent arrays"
            )
        num_blocks = first.shape[1] if first.dim() == 5 and first.shape[0] == 2 else first.shape[0]
        role = _role(self._vllm_config, self._extra)
        rank, tp = self._rank()
        kv = self._geometry(first, len(tensors))
        if kv["kernelBlockSize"] < 1 or self._block_size % kv["kernelBlockSize"]:
            raise ValueError(
                f"pdpair: vLLM's block size {self._block_size} is not a whole number of the KV cache's kernel blocks "
                f"of {kv['kernelBlockSize']} tokens (KV tensor shape {tuple(first.shape)})"
            )
        # Pipeline parallelism is refused when vLLM builds the connector; data parallel ranks
        # are engines of their own, each with its whole KV cache (the PDEndpoint says how many).
        data = int(getattr(self._vllm_config.parallel_config, "data_parallel_size", 1) or 1)
        reg = agent_client.registration(
            pdpair=self._pdpair(), role=role, engine=engine_name(self._host(), self._engine_id, rank), kv=kv,
            num_blocks=num_blocks, pairing_key=self._pairing_key(), tensor=tp, tensor_rank=rank,
            instance=instance_name(self._host(), self._engine_id), data=data,
            pod_engines=pod_engines(self._vllm_config.parallel_config),
            pod=os.environ.get("PDPAIR_POD_NAME"), **dict(self._extra.get("settings") or {}),
        )
        #: What this rank registered: the agent publishes its parallelism and geometry in the
        #: PDEndpoint, which the operator compares with the pool's declaration.
        self.registration = reg
        sock = self._extra.get("socket") or os.environ.get("PDPAIR_AGENT_SOCKET") or agent_client.DEFAULT_SOCKET
        try:
            client, stager = self._connect(sock, reg, tensors, rank)
        except agent_client.AgentUnreachable as e:
            # The node's agent is starting, or restarting in a rollout: the engine (its model
            # loaded by now) starts without it rather than crash-looping, and registers once the
            # agent answers, as after losing it. Until then its KV moves nowhere (decode computes
            # its requests' KV; prefill offers none). So too where the agent is at one of its
            # bounds on what it holds at once (busy), which frees as other engines go or finish
            # registering.
            busy = isinstance(e, agent_client.AgentBusy)
            log.warning("pdpair: rank %d %s (%s); the engine starts without it and registers once it %s", rank,
                        "cannot register with its agent yet" if busy else "cannot reach its agent", e,
                        "takes the registration" if busy else "answers")
            client, stager = agent_client.Unreachable(str(e)), Stager()
            self.kv_path = ("unregistered", str(e))
        # A restarted agent listens at a new address, which a prefill rank's scheduler learns
        # through the workers' metadata: a vLLM without it would hand decode the old one.
        self._worker = WorkerState(client, stager, rank, reconnect=lambda: self._connect(sock, self._again(reg), tensors, rank),
                                   per_logical=self._block_size // int(kv["kernelBlockSize"]),
                                   vllm_holds=vllm_holds_aborted_receives())

    def _again(self, reg: dict) -> dict:
        """The registration again after the agent connection was lost: a prefill rank names the
        address decode engines were handed, where its restarted agent listens again when it can
        (else at a new one, which reaches the scheduler through the workers' metadata)."""
        if reg.get("role") != "prefill" or self._worker is None or not self._worker.client.address:
            return reg
        return dict(reg, address=self._worker.client.address)

    def _connect(self, sock: str, reg: dict, tensors: List[torch.Tensor], rank: int) -> Tuple[AgentClient, Stager]:
        """Registers this rank's KV with its agent (at startup, and again after losing it, on
        the worker's reconnect thread) and builds how it moves: the KV tensors as the agent's
        GPU pool, or host staging."""
        if tensors[0].is_cuda:
            torch.cuda.set_device(tensors[0].device)  # a reconnect runs on its own thread
        client, stager, why = direct.register(sock, reg, tensors, _direct_setting(self._extra.get("direct", "auto")))
        caps = client.capabilities
        if stager is not None:
            log.info("pdpair: rank %d moves KV in GPU memory directly: its KV tensors are the agent's GPU pool, "
                     "no host staging (agent %s, GPU %s)", rank, caps.get("agent"), stager.uuid)
        else:
            log.info(
                "pdpair: rank %d stages KV through host memory (agent %s, UCX %s moves %s; pool memory it accepts: "
                "%s; direct path not taken: %s)",
                rank, caps.get("agent"), caps.get("ucx_version"), caps.get("ucx_memory_types"),
                caps.get("pool_memory"), why,
            )
            try:
                stager = TorchStager(tensors, client.pool, client.layout)
            except BaseException:
                client.close()
                raise
        #: Which path this rank's KV takes, ``direct`` or ``staged``, and why not direct.
        self.kv_path = ("staged", why) if why else ("direct", None)
        return client, stager

    @property
    def _client(self) -> Optional[AgentClient]:
        """This rank's agent connection (the current one, after a reconnection)."""
        return self._worker.client if self._worker is not None else None

    def _rank(self) -> Tuple[int, int]:
        tp = int(self._vllm_config.parallel_config.tensor_parallel_size)
        if "tensor_rank" in self._extra:
            return int(self._extra["tensor_rank"]), tp
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank()), tp
        except Exception:  # distributed state not initialised: a single rank
            return 0, tp

    def _host(self) -> str:
        return os.environ.get("PDPAIR_POD_NAME") or socket.gethostname()

    def _pdpair(self) -> str:
        if self._extra.get("pdpair"):
            return str(self._extra["pdpair"])
        name = os.environ.get("PDPAIR_NAME")
        if not name:
            raise ValueError("pdpair: the PDPair is unknown; set kv_connector_extra_config.pdpair or PDPAIR_NAME")
        return f"{os.environ.get('PDPAIR_NAMESPACE', 'default')}/{name}"

    def _pairing_key(self) -> bytes:
        path = self._extra.get("pairing_key_file")
        if path:
            return agent_client.read_pairing_key(path, os.environ.get("PDPAIR_UID") or None)
        return agent_client.pairing_key_from_env()

    def _geometry(self, t: torch.Tensor, layers: int) -> dict:
        """The geometry this engine really has (read from vLLM's config and the KV tensors: five
        dimensions, K/V and blocks then block, heads, dim in logical order; or MLA's three, blocks,
        block, latent dim), with the identity fields vLLM cannot tell (model name, attention
        backend, hybrid, hostBuffer) from the PDPair's declaration. ``engineVersion`` is vLLM's
        own: the operator compares it only where the pool declares one."""
        mc = self._vllm_config.model_config
        declared = json.loads(os.environ.get("PDPAIR_KV") or "{}")
        declared.update(self._extra.get("kv") or {})
        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        if cache_dtype not in ELEMENT_BYTES and cache_dtype != "auto":
            raise ValueError(f"pdpair: cache_dtype {cache_dtype!r} is not one pdpair moves")
        if t.dim() == 4:
            # vLLM 0.33: [blocks, heads, tokens, C], C one head's K then V for a token (MLA: one
            # head, its latent vector), in bytes C * element size.
            mla = bool(getattr(mc, "use_mla", False))
            kernel, cell = int(t.shape[2]), int(t.shape[3]) * t.element_size()
            if mla:
                heads, head_dim, layout = 1, int(t.shape[3]), "NHD"
            else:
                heads, head_dim, layout = int(mc.get_total_num_kv_heads()), int(mc.get_head_size()), token_layout(t)
                local = int(mc.get_num_kv_heads(self._vllm_config.parallel_config))
                if int(t.shape[1]) != local:
                    # A backend packing K and V as two head slots ([blocks, 2, tokens, heads * dim])
                    # would pass the size check below with two heads and file one head's K and V
                    # as K and the next one's as V.
                    raise ValueError(
                        f"pdpair: a KV tensor of shape {tuple(t.shape)} holds {int(t.shape[1])} heads; this rank has "
                        f"{local} KV heads (an attention backend whose cache is not [blocks, heads, tokens, K|V])"
                    )
                if cell != 2 * head_dim * t.element_size():
                    raise ValueError(
                        f"pdpair: a KV tensor of shape {tuple(t.shape)} holds {cell} bytes a head and token; K and V "
                        f"of head size {head_dim} in {t.dtype} are {2 * head_dim * t.element_size()} (a V head size "
                        "other than K's is not one pdpair moves)"
                    )
        elif t.dim() == 3:
            # MLA: one latent vector per token: one "head" of the latent's width.
            mla = True
            kernel, heads, head_dim, layout = int(t.shape[1]), 1, int(t.shape[2]), "NHD"
        else:
            mla = False
            kernel, layout = int(t.shape[2]), token_layout(t)
            heads, head_dim = int(mc.get_total_num_kv_heads()), int(mc.get_head_size())
        import vllm

        kv = {
            "engine": "vllm",
            "engineVersion": vllm.__version__,
            "model": declared.get("model", mc.model),
            "dtype": _dtype_name(mc.dtype),
            "cacheDtype": cache_dtype,
            "layers": layers,
            "kvHeads": heads,
            "headDim": head_dim,
            "attentionBackend": declared.get("attentionBackend", os.environ.get("VLLM_ATTENTION_BACKEND", "auto")),
            "layout": layout,
            "blockSize": self._block_size,
            "kernelBlockSize": int(kernel),
            "mla": mla,
            # As declared: whether vLLM runs its hybrid KV cache manager and stages KV in a host
            # buffer are settings of the deployment that the rule table checks between the pools;
            # reported unset they would read false, a mismatch where the pool declares true.
            "hybrid": bool(declared.get("hybrid", False)),
            "hostBuffer": bool(declared.get("hostBuffer", False)),
        }
        return kv

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._worker is None:
            return
        meta = self._connector_metadata
        if isinstance(meta, PdpairMetadata):
            self._worker.start(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the request is reported received

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # blocks are staged once the request finished (wait_for_save)

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        meta = self._connector_metadata
        if isinstance(meta, PdpairMetadata):
            self._worker.save(meta.plan)

    def _poll(self) -> Results:
        if self._worker is None:
            return Results()
        results = self._worker.poll()
        self._errors |= results.error_blocks
        return results

    def get_transfer_results(self, finished_req_ids):
        r = self._poll()
        if KVConnectorTransferResults is None:  # pragma: no cover
            return r
        return KVConnectorTransferResults(
            finished_sending=set(r.finished_sending),
            finished_recving=set(r.finished_recving),
            failed_recving=set(r.failed_recving),
        )

    def get_finished(self, finished_req_ids) -> Tuple[Optional[set], Optional[set]]:
        # Older vLLM asks this instead of get_transfer_results.
        r = self._poll()
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_block_ids_with_load_errors(self) -> set:
        errors, self._errors = self._errors, set()
        return errors

    def get_handshake_metadata(self):
        if self._client is None:
            return None
        return PdpairHandshakeMetadata(self._client.address, self._client.hold_s)

    def build_connector_worker_meta(self):
        news = self._worker.take_news() if self._worker is not None else None
        if not news or not news[0]:
            return None
        address, hold = news
        return PdpairWorkerMetadata({self._worker.rank: address}, {self._worker.rank: hold})

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
