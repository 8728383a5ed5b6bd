"""Host staging: vLLM's per-layer KV tensors copied to and from the agent's host pool (one
``Interleaved``, ``KvFirst`` or ``Latent`` region mirroring the KV cache block for block: vLLM
0.33's own tensors, an older vLLM's, an MLA cache's), for engines whose KV
cache the agent does not take as a GPU pool (:mod:`pdpair_vllm.direct`). Torch only: no vLLM, so
the GPU check measures it beside the direct path."""

from __future__ import annotations

import logging
from typing import List, Mapping, Optional, Sequence

import torch

from .layout import runs
from .transfer import Stager

log = logging.getLogger("pdpair_vllm")


class TorchStager(Stager):
    """Host staging between vLLM's per-layer KV tensors and the agent's pool. Each layer's tensor
    is vLLM 0.33's ``[num_blocks, heads, tokens, K|V]`` view (:func:`block_rows`), or an older
    vLLM's ``[2, num_blocks, ...]`` (K and V first), ``[num_blocks, 2, ...]`` (blocks first, as
    FlashInfer has it) or MLA's ``[num_blocks, block, dim]``; inside a block, any dense order (NHD
    or HND) is copied byte for byte. The pool is one region, K and V arrays first (``KvFirst``),
    latent arrays (``Latent``), or, for vLLM 0.33's tensors (:func:`staged_arrangement`), each
    layer's blocks with each head's token's K and V side by side as in the tensors
    (``Interleaved``, dense, layers outermost): a block's copy is then one run of bytes, and the
    pool is laid out as a direct engine's KV cache, so a staged and a direct vLLM 0.33 engine
    move whole blocks, not a head's token at a time."""

    def __init__(self, tensors: List[torch.Tensor], pool, layout):
        self.layout = layout
        self._pool_buf = pool
        if len(layout.region_lens) != 1 or layout.arrangement not in ("KvFirst", "Latent", "Interleaved"):
            raise ValueError(
                f"pdpair: host staging registers one KvFirst, Latent or Interleaved region, not {layout.regions}"
            )
        flat = torch.frombuffer(pool, dtype=torch.uint8, count=layout.pool_len)
        # Touch every page now, as the engine's own KV cache was at startup: otherwise the first
        # staging copies and the peers' first writes into a block pay its page faults.
        flat.zero_()
        #: Whether the pool keeps each block as the tensors do (``Interleaved``).
        self.side_by_side = layout.arrangement == "Interleaved"
        if self.side_by_side:
            if layout.strides and layout.strides[0] is not None and layout.strides[0] != (
                    2 * layout.array_len, 2 * layout.block_len):
                raise ValueError(f"pdpair: host staging's Interleaved pool is dense, not at strides {layout.strides[0]}")
            self.rows = [_side_by_side_blocks(t, layout) for t in tensors]
            self.pool = flat.view(layout.layers, layout.num_blocks, 2 * layout.block_len)
        else:
            self.pool = flat.view(layout.layers, len(layout.arrays), layout.num_blocks, layout.block_len)
            self.rows = [block_rows(t, layout.num_blocks, layout.block_len) for t in tensors]
            if any(r.shape[0] != len(layout.arrays) for r in self.rows):
                raise ValueError(f"pdpair: the KV tensors hold {self.rows[0].shape[0]} arrays a layer, the pool "
                                 f"{len(layout.arrays)}")
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
                self._pool_rows(layer, first, end, rows).copy_(self._tensor_rows(rows, first, end))

    def load(self, blocks: List[int]) -> None:
        for first, count in runs(blocks):
            end = first + count
            for layer, rows in enumerate(self.rows):
                self._tensor_rows(rows, first, end).copy_(self._pool_rows(layer, first, end, rows))

    def _tensor_rows(self, rows: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Blocks first..end of one layer's tensor, as :attr:`rows` views it."""
        return rows[first:end] if self.side_by_side else rows[:, first:end]

    def _pool_rows(self, layer: int, first: int, end: int, rows: torch.Tensor) -> torch.Tensor:
        """Blocks first..end of one layer of the pool, shaped as ``rows`` (a block's bytes split
        into (tokens, heads, bytes) or (heads, tokens, bytes) where vLLM's tensor interleaves K
        and V into K and V arrays, so the copy gathers them; as they lie in the tensor where the
        pool is ``Interleaved`` too)."""
        if self.side_by_side:
            return self.pool[layer, first:end].view(end - first, *rows.shape[1:])
        return self.pool[layer, :, first:end].view(rows.shape[0], end - first, *rows.shape[2:])

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


def token_layout(t: torch.Tensor) -> str:
    """``HND`` where one layer's KV tensor keeps each head's tokens together in memory, else
    ``NHD``: vLLM 0.33's ``[blocks, heads, tokens, K|V]`` (its ``LBHNC`` and ``LBNHC`` layouts,
    and the block-outermost and head-outermost ones) or an older vLLM's ``[2, blocks, tokens,
    heads, dim]``."""
    if t.dim() == 3:
        return "NHD"  # MLA: one latent vector a token
    if t.dim() == 4:
        heads, tokens = 1, 2
    else:
        tokens, heads = t.dim() - 3, t.dim() - 2
    return "HND" if t.stride(heads) > t.stride(tokens) else "NHD"


def staged_arrangement(tensors: Sequence[torch.Tensor], kv: Mapping) -> Optional[str]:
    """How host staging arranges the pool of ``tensors`` (geometry ``kv``): ``Interleaved`` for
    vLLM 0.33's ``[num_blocks, heads, tokens, K|V]``, as they lie; ``None`` (the registration's
    default: ``KvFirst``, or ``Latent`` for MLA) for an MLA cache, and for an older vLLM's
    shapes, whose blocks already are K and V arrays."""
    if not tensors or tensors[0].dim() != 4 or kv.get("mla"):
        return None
    return "Interleaved"


def block_rows(t: torch.Tensor, num_blocks: int, block_len: int) -> torch.Tensor:
    """A byte view of one layer's KV tensor (no copy), ``[arrays, num_blocks, ...]``: its K and V
    arrays (or an MLA cache's one latent array), each block's bytes in the agent pool's order.

    vLLM 0.33 hands each layer as ``[num_blocks, heads, tokens, C]``, C a head's K then V for one
    token (an MLA cache: one head, its latent vector), in whatever memory order its KV cache
    layout gives (tokens outside heads, or inside; layers or blocks outermost): the view is
    ``[2, num_blocks, tokens, heads, dim bytes]`` (NHD) or ``[2, num_blocks, heads, tokens, dim
    bytes]`` (HND). An older vLLM's ``[2, num_blocks, ...]`` or ``[num_blocks, 2, ...]`` with dense
    blocks, and MLA's ``[num_blocks, block, dim]``: ``[arrays, num_blocks, block_len]``."""
    if t.dim() == 4:
        return _interleaved_rows(t, num_blocks, block_len)
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


def _interleaved_rows(t: torch.Tensor, num_blocks: int, block_len: int) -> torch.Tensor:
    """:func:`block_rows` of vLLM 0.33's ``[num_blocks, heads, tokens, K|V]``."""
    shape = tuple(t.shape)
    if shape[0] != num_blocks:
        raise ValueError(f"pdpair: KV tensor shape {shape} is not [{num_blocks}, heads, tokens, K|V]")
    if t.stride(3) != 1:
        raise ValueError(f"pdpair: KV tensor {shape} / strides {t.stride()} does not hold a head's K|V contiguously")
    b = t.view(torch.uint8)
    _, heads, tokens, cell = b.shape
    if heads * tokens * cell == block_len:
        arrays = 1  # MLA: one latent vector a token
    elif heads * tokens * cell == 2 * block_len:
        arrays = 2  # a head's K, then its V
    else:
        raise ValueError(
            f"pdpair: a KV block of tensor {shape} holds {heads * tokens * cell} bytes, the agent's layout "
            f"{block_len} a K (or latent) array's block"
        )
    half = cell // arrays
    s_block, s_head, s_token, _ = b.stride()
    view = torch.as_strided(b, (arrays, num_blocks, heads, tokens, half), (half, s_block, s_head, s_token, 1),
                            b.storage_offset())
    return view if token_layout(t) == "HND" else view.transpose(2, 3)


def _side_by_side_blocks(t: torch.Tensor, layout) -> torch.Tensor:
    """A byte view of vLLM 0.33's ``[num_blocks, heads, tokens, K|V]`` (no copy) as an
    ``Interleaved`` pool holds a layer's blocks: ``[num_blocks, heads, tokens, K|V bytes]`` (HND)
    or ``[num_blocks, tokens, heads, K|V bytes]`` (NHD), each head's token's K then its V."""
    shape = tuple(t.shape)
    want = (layout.num_blocks, layout.local_heads, layout.block_size)
    if t.dim() != 4 or shape[:3] != want or t.stride(3) != 1:
        raise ValueError(f"pdpair: KV tensor {shape} / strides {t.stride()} is not [{want[0]}, {want[1]}, {want[2]}, "
                         "K|V] holding a head's K|V contiguously")
    b = t.view(torch.uint8)
    if b.shape[3] != 2 * layout.half_token:
        raise ValueError(f"pdpair: a KV tensor of shape {shape} holds {b.shape[3]} bytes a head and token; the agent's "
                         f"layout {2 * layout.half_token} (K then V)")
    return b if layout.layout == "HND" else b.transpose(1, 2)
