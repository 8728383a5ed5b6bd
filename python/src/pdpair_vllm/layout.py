"""Where an engine's KV blocks are in its agent pool: the same layout as the agent's
``agent/src/layout.rs`` (docs/engine-api.md, "Pool memory layout"), which a test checks on the same
inputs through real transfers with the agent's own synthetic engine.

One region, layer after layer; inside a layer either a K array then a V array of ``num_blocks``
blocks (``KvFirst``, FlashAttention's ``[2, num_blocks, ...]``) or each block's K then its V
(``BlocksFirst``, FlashInfer's ``[num_blocks, 2, ...]``); a block holds ``kernelBlockSize`` tokens of
this rank's KV heads, HND (head, token, dim) or NHD (token, head, dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Tuple

ELEMENT_BYTES = {
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
}


ARRANGEMENTS = ("KvFirst", "BlocksFirst")


class LayoutError(ValueError):
    """A geometry that cannot describe a pool; the message names the field and value."""


def _positive(kv: Mapping, name: str) -> int:
    value = kv.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"kv.{name} is {value!r}; it must be an integer of at least 1")
    return value


def element_bytes(kv: Mapping) -> int:
    """Bytes per KV element: ``cacheDtype``, with ``auto`` (or none) meaning the model's ``dtype``."""
    dtype = kv.get("cacheDtype", "auto")
    if dtype == "auto":
        dtype = kv.get("dtype")
    if dtype not in ELEMENT_BYTES:
        raise LayoutError(
            f"kv.cacheDtype/dtype resolves to {dtype!r}, not one of {', '.join(sorted(ELEMENT_BYTES))}"
        )
    return ELEMENT_BYTES[dtype]


@dataclass(frozen=True)
class PoolLayout:
    layers: int
    local_heads: int
    head_offset: int
    head_dim: int
    element_bytes: int
    block_size: int
    num_blocks: int
    layout: str  # "HND" or "NHD"
    arrangement: str = "KvFirst"  # or "BlocksFirst"

    @staticmethod
    def new(kv: Mapping, tensor: int, num_blocks: int, rank: int, arrangement: str = "KvFirst") -> "PoolLayout":
        """The layout of tensor-parallel rank ``rank`` of an engine with geometry ``kv`` (the
        PDPair's camelCase ``kv`` object) and ``tensor`` ranks."""
        heads = _positive(kv, "kvHeads")
        tp = tensor if isinstance(tensor, int) and tensor > 0 else 1
        if not 0 <= rank < tp:
            raise LayoutError(f"tensor_rank {rank} is outside parallelism.tensor {tp}")
        if kv.get("mla", False):
            local, offset = heads, 0
        elif tp <= heads:
            local, offset = heads // tp, rank * (heads // tp)
        else:
            local, offset = 1, rank * heads // tp
        block = kv.get("kernelBlockSize", kv.get("blockSize"))
        layout = kv.get("layout")
        if layout not in ("HND", "NHD"):
            raise LayoutError(f"kv.layout is {layout!r}, not HND or NHD")
        if arrangement not in ARRANGEMENTS:
            raise LayoutError(f"kv_arrangement is {arrangement!r}, not one of {', '.join(ARRANGEMENTS)}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise LayoutError(f"num_blocks is {num_blocks!r}; it must be at least 1")
        return PoolLayout(
            layers=_positive(kv, "layers"),
            local_heads=local,
            head_offset=offset,
            head_dim=_positive(kv, "headDim"),
            element_bytes=element_bytes(kv),
            block_size=_positive({"kernelBlockSize": block}, "kernelBlockSize"),
            num_blocks=num_blocks,
            layout=layout,
            arrangement=arrangement,
        )

    @property
    def half_token(self) -> int:
        """Bytes of one head's one token's K (or V)."""
        return self.head_dim * self.element_bytes

    @property
    def block_len(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.local_heads * self.half_token

    @property
    def array_len(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def region_len(self) -> int:
        """Bytes of the whole pool."""
        return 2 * self.layers * self.array_len

    @property
    def block_stride(self) -> int:
        """Bytes from one block of a layer's K (or V) to the next."""
        return self.block_len if self.arrangement == "KvFirst" else 2 * self.block_len

    def block_offset(self, layer: int, v: bool, block: int) -> int:
        """Offset of a block of a layer's K (``v`` false) or V array."""
        start = 2 * layer * self.array_len
        if self.arrangement == "KvFirst":
            return start + int(v) * self.array_len + block * self.block_len
        return start + block * 2 * self.block_len + int(v) * self.block_len

    def token_offset(self, head: int, token: int) -> int:
        """Offset of a local head's token inside a block."""
        if self.layout == "HND":
            return (head * self.block_size + token) * self.half_token
        return (token * self.local_heads + head) * self.half_token

    def blocks_for(self, num_tokens: int, first_token: int = 0) -> int:
        """Blocks that hold tokens ``first_token..num_tokens``."""
        live = max(num_tokens - first_token, 0)
        return -(-live // self.block_size)

    def tokens(self, blocks: List[int], first_token: int, num_tokens: int):
        """(byte offset, layer, global head, absolute token, v) of every live token's K and V in
        ``blocks`` (in token order, the first holding ``first_token``)."""
        for i, block in enumerate(blocks):
            for j in range(self.block_size):
                t = first_token + i * self.block_size + j
                if t >= num_tokens:
                    return
                for layer in range(self.layers):
                    for h in range(self.local_heads):
                        for v in (False, True):
                            at = self.block_offset(layer, v, block) + self.token_offset(h, j)
                            yield at, layer, self.head_offset + h, t, v


def runs(blocks: List[int]) -> List[Tuple[int, int]]:
    """Consecutive block ids joined: ``[(first, count), ...]`` in order."""
    out: List[Tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out
