"""The engine-API client (docs/engine-api.md): registers one engine's pool with its node's agent,
maps the pool the agent hands back, sends requests, and reads the agent's events on a reader
thread so the engine never blocks on them (the agent drops an event it cannot write in 10 s).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple, Union

from . import wire
from .layout import PoolLayout

#: The engine API version this client speaks (the agent's ``engine_api::API_VERSION``).
API_VERSION = 5
#: The agent's default socket (``PDPAIR_AGENT_SOCKET`` in pods the operator runs).
DEFAULT_SOCKET = "/var/run/pdpair/agent.sock"
#: Events after which the agent does nothing more for a request.
FINAL = ("RequestDone", "RequestFailed", "Released", "Cancelled")


class AgentError(Exception):
    """The agent refused the registration, or the connection failed."""


class AgentUnreachable(AgentError):
    """No agent serves at the socket yet: no socket, a connection refused, or one the agent
    accepted and then closed or left unanswered before the registration's answer (the node's
    agent is starting, or shutting down in a rollout). Other failures (no permission on the
    socket, a refusal, a frame that is not the agent's) are :class:`AgentError`: a
    misconfiguration, which waiting does not mend; except a refusal the agent says is busy
    (:class:`AgentBusy`)."""


class AgentBusy(AgentUnreachable):
    """The agent refused the registration at one of its bounds on what it holds at once
    (``RegistrationFailed`` with ``busy``: engines registered, GPU memory descriptors of other
    registrations in progress), which frees as other engines go or finish registering: the
    same registration is tried again later, as when no agent serves, not taken as a refusal
    of what it says (the direct path would stage through host memory for good)."""


class Unreachable:
    """In an :class:`AgentClient`'s place while a rank's agent could not be reached at startup:
    a connection already lost, so the rank starts without its agent and registers once it
    answers, as after losing one (:class:`~pdpair_vllm.transfer.WorkerState`)."""

    address: Optional[str] = None
    capabilities: dict = {}
    transfer_bound_s: Optional[float] = None
    handshake_timeout_s: Optional[float] = None
    hold_s: Optional[float] = None

    def __init__(self, why: str):
        self.closed: Optional[str] = why
        self.on_close = None

    def take_finished(self) -> list:
        return []

    def release_pools(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Event:
    """One agent event about a request."""

    type: str
    request: str
    raw: dict = field(repr=False)

    @property
    def final(self) -> bool:
        return self.type in FINAL

    @property
    def reasons(self) -> List[str]:
        reasons = self.raw.get("reasons")
        return [r for r in reasons if isinstance(r, str)] if isinstance(reasons, list) else []

    @property
    def message(self) -> str:
        m = self.raw.get("message")
        return m if isinstance(m, str) else ""


def registration(
    *,
    pdpair: str,
    role: str,
    engine: str,
    kv: dict,
    num_blocks: int,
    pairing_key: bytes,
    tensor: int = 1,
    tensor_rank: int = 0,
    instance: Optional[str] = None,
    pod_engines: Optional[int] = None,
    data: int = 1,
    pod: Optional[str] = None,
    mode: Optional[str] = None,
    checksum: Optional[str] = None,
    handshake_timeout_ms: Optional[int] = None,
    lease_ms: Optional[int] = None,
    memory_fd: bool = False,
    kv_arrangement: Optional[str] = None,
    regions: Optional[List[dict]] = None,
    gpu: Optional[dict] = None,
    staging: Optional[str] = None,
) -> dict:
    """A ``RegisterPool`` message. Settings left ``None`` are filled by the agent from the
    PDPair (in a cluster); outside one the agent requires them. ``regions`` splits the pool
    (``[{"layers": n, "kv_arrangement": ...}, ...]``, in layer order); without it the pool is one
    region arranged ``kv_arrangement`` (``None``: ``KvFirst``, or ``Latent`` for MLA). ``gpu`` makes it a GPU pool
    (``{"device_uuid", "regions": [{"ipc_handle", "offset"}], "event"}``, docs/engine-api.md);
    ``staging`` says why a host pool is registered instead (published in the PDEndpoint);
    ``instance`` names the engine the rank is one of, ``pod_engines`` how many its Pod runs."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role is {role!r}, not prefill or decode")
    message = {
        "type": "RegisterPool",
        "api_version": API_VERSION,
        "pdpair": pdpair,
        "role": role,
        "engine": engine,
        "parallelism": {"tensor": tensor, "pipeline": 1, "data": data},
        "kv": kv,
        "pairing_key": pairing_key.hex(),
        "memory_fd": memory_fd,
        "num_blocks": num_blocks,
        "tensor_rank": tensor_rank,
    }
    optional = {
        "kv_arrangement": kv_arrangement,
        "regions": list(regions) if regions else None,
        "gpu": gpu,
        "staging": staging,
        "instance": instance,
        "pod_engines": pod_engines,
        "pod": pod,
        "mode": mode,
        "checksum": checksum,
        "handshake_timeout_ms": handshake_timeout_ms,
        "lease_ms": lease_ms,
    }
    message.update({k: v for k, v in optional.items() if v is not None})
    return message


def _millis(value: object) -> bool:
    """Whether an agent's ``value`` is milliseconds (an integer, 0 to 2^40)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 40


def pairing_key_from_env(env=os.environ) -> bytes:
    """The pair's secret from the file at ``PDPAIR_PAIRING_KEY_FILE`` (the operator mounts it),
    once it is the key of the PDPair ``PDPAIR_UID`` names (:func:`read_pairing_key`)."""
    path = env.get("PDPAIR_PAIRING_KEY_FILE")
    if not path:
        raise AgentError("PDPAIR_PAIRING_KEY_FILE is not set: the engine does not run under pdpair")
    return read_pairing_key(path, env.get("PDPAIR_UID") or None)


#: How long an engine waits for the kubelet to bring its own PDPair's pairing Secret when the one
#: mounted is an earlier PDPair's of the same name (the kubelet refreshes a mounted Secret within
#: about a minute and a half by default).
PAIRING_WAIT_S = 300.0

_log = logging.getLogger("pdpair_vllm")


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def read_pairing_key(path: str, uid: Optional[str], wait_s: Optional[float] = None) -> bytes:
    """The pairing key at ``path``. With ``uid`` (the engine's ``PDPAIR_UID``: the PDPair its
    pod was made for) and a ``pdpair-uid`` file beside the key (the operator writes both into the
    Secret), only once that file names ``uid``: the Secret's name holds its PDPair's uid, but a
    pod rendered by an operator from before that (or a Secret mounted by hand) can hold another
    PDPair's key, and an engine that paired with that key would be refused by every peer holding
    its own for as long as it runs. Waits up to ``wait_s`` (:data:`PAIRING_WAIT_S`) for the kubelet to
    bring the new Secret, then fails naming both. A Secret without the file (made before it was
    written, or brought by the user) is taken as it is."""
    uid_path = os.path.join(os.path.dirname(path), "pdpair-uid")
    wait = PAIRING_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait
    warned = False
    while True:
        before = _read_text(uid_path) if uid else None
        with open(path, "rb") as f:
            key = f.read()
        after = _read_text(uid_path) if uid else None
        # The kubelet swaps a Secret's files together: the same uid before and after the key
        # was read means the key is that uid's.
        if before is None and after is None:
            return key
        if before == after == uid:
            if warned:
                _log.warning("pdpair: the pairing key at %s is this PDPair's (%s) now", path, uid)
            return key
        if time.monotonic() >= deadline:
            raise AgentError(f"the pairing key at {path} is PDPair uid {after!r}'s, not this pod's PDPair's ({uid}): "
                             "this pod mounts another PDPair's pairing Secret (one of a PDPair of this name deleted before, mounted by "
                             "a pod rendered before the Secret's name held the uid), and its own has not "
                             f"reached this pod in {wait:.0f} s; "
                             "restart the pod")
        if not warned and before == after:
            warned = True
            _log.warning("pdpair: the pairing key at %s is PDPair uid %s's, an earlier PDPair of this name; waiting "
                         "for the kubelet to bring this PDPair's (%s)", path, after, uid)
        time.sleep(0.5)


class AgentClient:
    """One registered engine (one tensor-parallel rank)."""

    #: How long one write to the agent may block (an agent that stops reading would otherwise
    #: hang the engine's step inside :meth:`send`): the send then fails with :class:`AgentError`.
    SEND_TIMEOUT_S = 30.0

    def __init__(self, sock: socket.socket, reg: dict, layout: PoolLayout, address: str, pools: List[mmap.mmap],
                 capabilities: Optional[dict] = None):
        # Writes time out, reads (the event reader, which waits as long as events take) do not.
        t = self.SEND_TIMEOUT_S
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(t), int(t % 1 * 1e6)))
        self._sock = sock
        self.registration = reg
        #: The agent's ``Capabilities`` answer (its UCX, the memory types it moves, its GPUs, the
        #: pool memory it accepts and why not GPU pools), asked before registering.
        self.capabilities = capabilities or {}
        self.layout = layout
        #: The side-channel address decode engines name as this prefill engine's (empty on decode).
        self.address = address
        #: The pool's regions, each mapped shared: this engine's KV staging memory (none for a
        #: GPU pool, which is the engine's own memory).
        self.pools = pools
        #: The first region (a one-region pool's whole memory); ``None`` for a GPU pool.
        self.pool = pools[0] if pools else None
        #: How long the agent's transfers of one request may run (its handshake timeout and
        #: lease, from ``Registered``), in seconds; ``None`` when it did not say.
        self.transfer_bound_s: Optional[float] = None
        #: The agent's handshake timeout (from ``Registered``), in seconds; ``None`` when it did
        #: not say.
        self.handshake_timeout_s: Optional[float] = None
        #: The longest a prefill request's blocks are held after its ``KvReady``, renewals
        #: included (``Registered.hold_ms``), in seconds; ``None`` when the agent did not say.
        self.hold_s: Optional[float] = None
        #: When the agent was last heard from (any frame; registering counts), ``time.monotonic()``.
        self.heard_at = time.monotonic()
        self._lock = threading.Condition()
        self._events: Dict[str, Deque[Event]] = {}
        self._finished: Deque[Event] = deque()
        self._closed: Optional[str] = None
        #: Called on the event reader's thread once the connection ended.
        self.on_close: Optional[Callable[[], None]] = None
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="pdpair-agent-events", daemon=True)
        self._reader.start()

    @staticmethod
    def register(socket_path: str, reg: Union[dict, Callable[[dict], Union[dict, Tuple[dict, List[Tuple[int, int]]]]]],
                 timeout: float = 30.0) -> "AgentClient":
        """Connects to the agent and registers ``reg`` (a :func:`registration`, or a function
        from the agent's ``Capabilities`` answer to one, asked on the same connection first). For
        a host pool the agent allocates the regions and passes their descriptors, each mapped
        whole; a GPU pool (``gpu`` set) is the engine's own memory, and nothing is passed. The
        function may also return the VMM allocations its GPU pool lies in, ``(reg, [(descriptor,
        bytes), ...])``: they are shared first (``ShareGpuMemory``, at most ``wire.MAX_FDS`` a
        frame) and closed here once sent."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            try:
                sock.connect(socket_path)
            except (ConnectionRefusedError, FileNotFoundError, BlockingIOError) as e:
                # Nobody listens there (yet): the agent is starting, or restarting. Or its
                # backlog is full (EAGAIN: an agent swamped or stuck), which waiting may mend.
                raise AgentUnreachable(f"connecting to the agent at {socket_path}: {e}") from None
            except OSError as e:  # no permission on the socket, a path that is not one, ...
                raise AgentError(f"connecting to the agent at {socket_path}: {e}") from None
            try:
                # What the agent can do, before registering: which pool memory it accepts.
                wire.send(sock, {"type": "Capabilities"})
                capabilities, stray = wire.recv_with_fds(sock)
                for fd in stray:
                    os.close(fd)
            except (OSError, wire.Closed) as e:  # closed, reset or timed out: not serving (yet, or still)
                raise AgentUnreachable(f"asking the agent at {socket_path} for its capabilities: {e}") from None
            except wire.FrameError as e:
                raise AgentError(f"asking the agent at {socket_path} for its capabilities: {e}") from None
            if capabilities.get("type") != "Capabilities":
                raise AgentError(f"the agent answered Capabilities with {capabilities.get('type')}: "
                                 f"{capabilities.get('message', '')}")
            shared: List[Tuple[int, int]] = []
            if callable(reg):
                reg = reg(capabilities)
                if isinstance(reg, tuple):
                    reg, shared = reg
            try:
                for i in range(0, len(shared), wire.MAX_FDS):
                    batch = shared[i:i + wire.MAX_FDS]
                    wire.send(sock, {"type": "ShareGpuMemory", "sizes": [n for _, n in batch]}, [fd for fd, _ in batch])
            except (OSError, wire.FrameError):
                pass  # the agent refused and closed: its answer to the registration says why
            finally:
                for fd, _ in shared:
                    os.close(fd)
            layout = PoolLayout.new(
                reg["kv"], reg["parallelism"].get("tensor", 1), reg["num_blocks"], reg.get("tensor_rank", 0),
                reg.get("kv_arrangement"), reg.get("regions"),
            )
            if reg.get("memory_fd"):
                raise AgentError("memory_fd is true, but this client lets the agent allocate the pool: register with "
                                 "memory_fd false")
            try:
                try:
                    wire.send(sock, reg)
                except OSError:
                    pass  # the agent refused what was shared and closed: its answer says why
                answer, fds = wire.recv_with_fds(sock)
            except (OSError, wire.Closed) as e:
                raise AgentUnreachable(f"registering with the agent at {socket_path}: {e}") from None
            except wire.FrameError as e:
                raise AgentError(f"registering with the agent at {socket_path}: {e}") from None
        except BaseException:
            sock.close()
            raise
        pools: List[mmap.mmap] = []
        gpu = bool(reg.get("gpu"))
        try:
            if answer["type"] == "RegistrationFailed":
                raise (AgentBusy if answer.get("busy") is True else AgentError)(str(answer.get("message")))
            lens = layout.region_lens
            if answer["type"] != "Registered" or len(fds) != (0 if gpu else len(lens)):
                raise AgentError(
                    f"unexpected answer to RegisterPool: {answer['type']} with {len(fds)} descriptors "
                    f"for {len(lens)} {'GPU ' if gpu else ''}regions"
                )
            sizes = [os.fstat(fd).st_size for fd in fds] if not gpu else lens
            said = answer.get("region_lens")
            if said != lens or answer.get("memory_len") != layout.pool_len or any(s < n for s, n in zip(sizes, lens)):
                raise AgentError(
                    f"the agent's regions hold {sizes} bytes (says {said!r}, {answer.get('memory_len')!r} in all); "
                    f"this geometry needs {lens}"
                )
            for fd, n in zip(fds, lens):
                pools.append(mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
        except (AgentError, OSError) as e:
            for m in pools:
                m.close()
            sock.close()
            if isinstance(e, AgentError):
                raise
            raise AgentError(f"mapping the agent's pool: {e}") from None
        finally:
            for fd in fds:
                os.close(fd)
        sock.settimeout(None)
        client = AgentClient(sock, reg, layout, str(answer.get("address", "")), pools, capabilities)
        bounds = [answer.get("handshake_timeout_ms"), answer.get("lease_ms")]
        if all(_millis(b) for b in bounds):
            client.transfer_bound_s = sum(bounds) / 1000
            client.handshake_timeout_s = bounds[0] / 1000
        hold = answer.get("hold_ms")
        if _millis(hold) and hold > 0:
            client.hold_s = hold / 1000
        return client

    # --- requests -------------------------------------------------------------------------------

    def send(self, message: dict) -> None:
        with self._send_lock:
            try:
                wire.send(self._sock, message)
            except OSError as e:
                raise AgentError(f"sending {message.get('type')}: {e}") from None

    def kv_ready(self, request: str, blocks: List[int], num_tokens: int, first_token: int = 0,
                 prompt: Optional[str] = None, event: Optional[int] = None,
                 release_token: Optional[str] = None) -> None:
        """Prefill: the request's KV is in ``blocks`` of the pool. ``prompt``: its prompt digest
        (hex), which decode's must equal. ``event``: which of the GPU pool's ``gpu.events`` the
        engine recorded after the writes. ``release_token``: the secret (64 hex digits) handed
        to the request's decode only, whose ``Release`` naming it counts whatever its prompt."""
        message = {"type": "KvReady", "request": request, "blocks": blocks, "num_tokens": num_tokens,
                   "first_token": first_token}
        if prompt is not None:
            message["prompt"] = prompt
        if event is not None:
            message["event"] = event
        if release_token is not None:
            message["release_token"] = release_token
        self.send(message)

    def expect_kv(self, request: str, prefill_ranks: List[str], blocks: List[int], num_tokens: int, first_token: int = 0,
                  prompt: Optional[str] = None, event: Optional[int] = None) -> None:
        """Decode: KV for ``request`` comes from the prefill pool whose ranks' addresses are
        ``prefill_ranks`` (the agent picks which ranks hold this rank's heads). ``prompt``: its
        prompt digest (hex), which prefill's must equal. ``event``: which of the GPU pool's
        ``gpu.events`` the engine recorded after its work so far (nothing writes the blocks
        before it passed)."""
        if len(prefill_ranks) == 1:
            message = {"type": "ExpectKv", "prefill": prefill_ranks[0]}
        else:
            message = {"type": "ExpectKvFromPool", "prefill_ranks": list(prefill_ranks)}
        message.update({"request": request, "blocks": blocks, "num_tokens": num_tokens, "first_token": first_token})
        if prompt is not None:
            message["prompt"] = prompt
        if event is not None:
            message["event"] = event
        self.send(message)

    def release(self, request: str, prefill: Union[str, List[str]], prompt: Optional[str] = None,
                release_token: Optional[str] = None) -> None:
        """Decode: nothing of ``request`` is needed from the prefill at ``prefill`` (an address,
        or every rank's of a prefill pool: released at once, one answer). ``prompt``: the
        request's prompt digest (prefill counts the release only for the request of that
        prompt, or of ``release_token``, from the request's params)."""
        ranks = [prefill] if isinstance(prefill, str) else list(prefill)
        message = {"type": "Release", "request": request, "prefill": ranks[0]}
        if ranks[1:]:
            message["prefills"] = ranks[1:]
        if prompt is not None:
            message["prompt"] = prompt
        if release_token is not None:
            message["release_token"] = release_token
        self.send(message)

    def renew(self, request: str, prefills: List[str], prompt: Optional[str] = None) -> None:
        """Decode: ``request`` is queued here; its ``prefills`` keep its blocks one more lease
        (only the request of ``prompt``, its prompt digest). One frame for them all where the
        agent takes ``prefills`` (``Capabilities.renew_prefills``), else one per rank."""
        if not prefills:
            return
        batches = [prefills] if self.capabilities.get("renew_prefills") is True else [[p] for p in prefills]
        for batch in batches:
            message = {"type": "Renew", "request": request, "prefill": batch[0]}
            if len(batch) > 1:
                message["prefills"] = batch[1:]
            if prompt is not None:
                message["prompt"] = prompt
            self.send(message)

    def cancel(self, request: str) -> None:
        """Either side: give up ``request``; answered by exactly one final event, after which
        nothing writes into its blocks."""
        self.send({"type": "Cancel", "request": request})

    def ping(self) -> None:
        """Asks the agent its ``Capabilities``, which it answers at once: the answer moves
        :attr:`heard_at` (and is otherwise dropped)."""
        self.send({"type": "Capabilities"})

    # --- events ---------------------------------------------------------------------------------

    def _read(self) -> None:
        reason = "the agent closed the connection"
        try:
            while True:
                raw = wire.recv(self._sock)
                self.heard_at = time.monotonic()
                request = raw.get("request")
                if not isinstance(request, str):
                    continue
                event = Event(raw["type"], request, raw)
                with self._lock:
                    self._events.setdefault(request, deque()).append(event)
                    if event.final:
                        self._finished.append(event)
                    self._lock.notify_all()
        except (OSError, wire.FrameError) as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - anything else the agent's bytes raise (a frame
            # nested past Python's recursion limit, an event missing a field): the connection is
            # given up as lost, so what waits on it ends, instead of the reader dying unseen.
            reason = f"the agent sent what this connector cannot read: {type(e).__name__}: {e}"
        # Shut down, not only given up: the agent frees this engine's registration only when
        # the connection ends, and the rank registers again under the same name.
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._lock:
            self._closed = reason
            self._lock.notify_all()
        if self.on_close is not None:
            self.on_close()

    def release_pools(self) -> None:
        """Unmaps the pool (a lost connection's: the engine registers a new one); a region
        still viewed (by a stager not yet collected) is unmapped once nothing views it."""
        pools, self.pools, self.pool = self.pools, [], None
        for m in pools:
            try:
                m.close()
            except BufferError:
                pass

    @property
    def closed(self) -> Optional[str]:
        """Why the agent connection ended, or ``None`` while it is up."""
        return self._closed

    def wait(self, request: str, timeout: float = 30.0) -> Event:
        """The next final event about ``request`` (earlier non-final ones are skipped)."""
        with self._lock:
            ok = self._lock.wait_for(lambda: self._has_final(request) or self._closed is not None, timeout)
            if self._has_final(request):
                queue = self._events[request]
                while True:
                    event = queue.popleft()
                    if event.final:
                        self._finished_remove(event)
                        return event
            if not ok:
                raise TimeoutError(f"no answer about request {request!r} within {timeout} s")
            raise AgentError(f"agent connection lost: {self._closed}")

    def _has_final(self, request: str) -> bool:
        return any(e.final for e in self._events.get(request, ()))

    def _finished_remove(self, event: Event) -> None:
        try:
            self._finished.remove(event)
        except ValueError:
            pass

    def take_finished(self) -> List[Event]:
        """Final events not yet taken, in arrival order (each request's queue is cleared)."""
        with self._lock:
            out = list(self._finished)
            self._finished.clear()
            for event in out:
                self._events.pop(event.request, None)
            return out

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(timeout=5)
