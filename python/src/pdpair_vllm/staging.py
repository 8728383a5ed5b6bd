"""Host staging: vLLM's per-layer KV tensors copied to and from the agent's host pool (one
``KvFirst`` or ``Latent`` region mirroring the KV cache block for block), for engines whose KV
cache the agent does not take as a GPU pool (:mod:`pdpair_vllm.direct`). Torch only: no vLLM, so
the GPU check measures it beside the direct path."""

from __future__ import annotations

import logging
from typing import List

import torch

from .layout import runs
from .transfer import Stager

log = logging.getLogger("pdpair_vllm")


class TorchStager(Stager):
    """Host staging between vLLM's per-layer KV tensors and the agent's pool. Each layer's tensor
    is ``[2, num_blocks, ...]`` (K and V first), ``[num_blocks, 2, ...]`` (blocks first, as
    FlashInfer has it) or MLA's ``[num_blocks, block, dim]``; inside a block, any dense order (NHD
    or HND) is copied byte for byte. The pool is one region, K and V arrays first (``KvFirst``),
    or latent arrays (``Latent``)."""

    def __init__(self, tensors: List[torch.Tensor], pool, layout):
        self.layout = layout
        self._pool_buf = pool
        if len(layout.region_lens) != 1 or layout.arrangement not in ("KvFirst", "Latent"):
            raise ValueError(
                f"pdpair: host staging registers one KvFirst or Latent region, not {layout.regions}"
            )
        flat = torch.frombuffer(pool, dtype=torch.uint8, count=layout.pool_len)
        # Touch every page now, as the engine's own KV cache was at startup: otherwise the first
        # staging copies and the peers' first writes into a block pay its page faults.
        flat.zero_()
        self.pool = flat.view(layout.layers, len(layout.arrays), layout.num_blocks, layout.block_len)
        self.rows = [block_rows(t, layout.num_blocks, layout.block_len) for t in tensors]
        self.pinned = False
        #: The GPU the pool is pinned for (unpinned under it, from whichever thread).
        self.device = next((t.device for t in tensors if t.is_cuda), None)
        if self.device is not None:
            with torch.cuda.device(self.device):
                self.pinned = _pin(flat.data_ptr(), layout.pool_len)

    # The pool mirrors the KV cache block for block (the same ids), so runs of consecutive blocks
    # are one slice copy per layer (K and V together): a gather by index tensors ran 18x slower
    # on CPU (113 vs 6.2 ms for 64 MiB, measured 12-01).

    def save(self, blocks: List[int]) -> None:
        for first, count in runs(blocks):
            end = first + count
            for layer, rows in enumerate(self.rows):
                self.pool[layer, :, first:end].copy_(rows[:, first:end])

    def load(self, blocks: List[int]) -> None:
        for first, count in runs(blocks):
            end = first + count
            for layer, rows in enumerate(self.rows):
                rows[:, first:end].copy_(self.pool[layer, :, first:end])

    def close(self) -> None:
        """Unpins the pool (a connection given up for a new one: the old pool is unmapped once
        nothing refers to it)."""
        if self.pinned:
            self.pinned = False
            try:
                with torch.cuda.device(self.device):
                    torch.cuda.cudart().cudaHostUnregister(self.pool.data_ptr())
            except Exception as e:  # pragma: no cover - no GPU here
                log.warning("pdpair: cudaHostUnregister of the old KV pool failed: %s", e)
        # Nothing here views the pool any more: it is unmapped once its client lets it go.
        self.pool = self.rows = self._pool_buf = None


def _pin(ptr: int, size: int) -> bool:
    """Page-locks the agent's pool for the GPU (``cudaHostRegister``), so the staging copies are
    DMA transfers; without it they still work, through a bounce buffer. Not run on a GPU yet."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    except Exception as e:  # no CUDA runtime
        log.warning("pdpair: cannot page-lock the KV pool (%s); staging copies are unpinned", e)
        return False
    code = getattr(err, "value", err)
    if code != 0:
        log.warning("pdpair: cudaHostRegister of the KV pool failed (%s); staging copies are unpinned", err)
        return False
    return True


def block_rows(t: torch.Tensor, num_blocks: int, block_len: int) -> torch.Tensor:
    """A ``[2, num_blocks, block_len]`` byte view of one layer's KV tensor (no copy); of an MLA
    cache (``[num_blocks, block, dim]``), ``[1, num_blocks, block_len]``."""
    if t.dim() == 3:
        if t.shape[0] != num_blocks:
            raise ValueError(f"pdpair: MLA KV tensor shape {tuple(t.shape)} is not [{num_blocks}, block, dim]")
        arrays, kv_dim, block_dim, first_inner = 1, None, 0, 1
    elif t.dim() < 3:
        raise ValueError(f"pdpair: a KV tensor of shape {tuple(t.shape)} has no (K/V, block) dimensions")
    elif t.shape[0] == 2 and t.shape[1] == num_blocks:
        arrays, kv_dim, block_dim, first_inner = 2, 0, 1, 2
    elif t.shape[0] == num_blocks and t.shape[1] == 2:
        arrays, kv_dim, block_dim, first_inner = 2, 1, 0, 2
    else:
        raise ValueError(f"pdpair: KV tensor shape {tuple(t.shape)} is neither [2, {num_blocks}, ...] nor [{num_blocks}, 2, ...]")
    inner = sorted(zip(t.stride()[first_inner:], t.shape[first_inner:]))
    expected = 1
    for stride, size in inner:
        if stride != expected:
            raise ValueError(f"pdpair: a KV block of tensor {tuple(t.shape)} / strides {t.stride()} is not dense")
        expected *= size
    elems = expected
    if elems * t.element_size() != block_len:
        raise ValueError(
            f"pdpair: a KV block holds {elems * t.element_size()} bytes, the agent's layout {block_len}"
        )
    kv_stride = t.stride(kv_dim) if kv_dim is not None else 0
    view = torch.as_strided(t, (arrays, num_blocks, elems), (kv_stride, t.stride(block_dim), 1), t.storage_offset())
    return view.view(torch.uint8)
