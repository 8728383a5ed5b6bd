"""Where an engine's KV blocks are in its agent pool: the same layout as the agent's
``agent/src/layout.rs`` (docs/engine-api.md, "Pool memory layout"), which a test checks on the same
inputs through real transfers with the agent's own synthetic engine.

A pool is one or more regions (one memory each), each holding a run of consecutive layers, layer
after layer; inside a layer either a K array then a V array of ``num_blocks`` blocks (``KvFirst``,
FlashAttention's ``[2, num_blocks, ...]``), each block's K then its V (``BlocksFirst``, FlashInfer's
``[num_blocks, 2, ...]``), an MLA cache's one latent array (``Latent``, ``[num_blocks, block,
dim]``), or each head's each token's K then its V side by side (``Interleaved``, vLLM 0.33's
``[blocks, heads, tokens, K|V]`` views of one allocation, layers and blocks the strides the engine
names apart); a block holds ``kernelBlockSize`` tokens of this rank's KV heads, HND (head, token, dim) or
NHD (token, head, dim).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Mapping, Optional, Sequence, Tuple

ELEMENT_BYTES = {
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
}


ARRANGEMENTS = ("KvFirst", "BlocksFirst", "Latent", "Interleaved")
#: The most regions one pool may have (the agent's ``layout::MAX_REGIONS``).
MAX_REGIONS = 128


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


def _arrangement(latent: bool, arrangement: Optional[str], field: str) -> str:
    if arrangement is None:
        return "Latent" if latent else "KvFirst"
    if arrangement not in ARRANGEMENTS:
        raise LayoutError(f"{field} is {arrangement!r}, not one of {', '.join(ARRANGEMENTS)}")
    if latent and arrangement != "Latent":
        raise LayoutError(f"{field} is {arrangement}; kv.mla is true, so the cache is one latent array per layer: Latent")
    if not latent and arrangement == "Latent":
        raise LayoutError(f"{field} is Latent, but kv.mla is false: K and V are KvFirst, BlocksFirst or Interleaved")
    return arrangement


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
    latent: bool = False
    #: (first layer, layers, arrangement) per region, in layer order; empty: one KvFirst region.
    regions: Tuple[Tuple[int, int, str], ...] = ()
    #: Per region, an ``Interleaved`` one's (layer stride, block stride) in bytes, else ``None``;
    #: empty: none named (dense, layers outermost).
    strides: Tuple[Optional[Tuple[int, int]], ...] = ()

    @staticmethod
    def new(kv: Mapping, tensor: int, num_blocks: int, rank: int, arrangement: Optional[str] = None,
            regions: Optional[Sequence[Mapping]] = None) -> "PoolLayout":
        """The layout of tensor-parallel rank ``rank`` of an engine with geometry ``kv`` (the
        PDPair's camelCase ``kv`` object) and ``tensor`` ranks, in one region arranged
        ``arrangement`` or split into ``regions`` (the registration's ``[{"layers": n,
        "kv_arrangement": ...}]``)."""
        heads = _positive(kv, "kvHeads")
        tp = tensor if isinstance(tensor, int) and tensor > 0 else 1
        if not 0 <= rank < tp:
            raise LayoutError(f"tensor_rank {rank} is outside parallelism.tensor {tp}")
        latent = bool(kv.get("mla", False))
        if latent:
            local, offset = heads, 0
        elif tp <= heads:
            local, offset = heads // tp, rank * (heads // tp)
        else:
            local, offset = 1, rank * heads // tp
        block = kv.get("kernelBlockSize", kv.get("blockSize"))
        layout = kv.get("layout")
        if layout not in ("HND", "NHD"):
            raise LayoutError(f"kv.layout is {layout!r}, not HND or NHD")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise LayoutError(f"num_blocks is {num_blocks!r}; it must be at least 1")
        layers = _positive(kv, "layers")
        if regions:
            if arrangement is not None:
                raise LayoutError("kv_arrangement and regions are both set: with regions, each region names its "
                                  "kv_arrangement")
            if len(regions) > MAX_REGIONS:
                raise LayoutError(f"regions has {len(regions)} entries; a pool has 1..={MAX_REGIONS}")
            spans, strides, first = [], [], 0
            for i, r in enumerate(regions):
                n = r.get("layers")
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise LayoutError(f"regions[{i}].layers is {n!r}; a region holds at least 1")
                arranged = _arrangement(latent, r.get("kv_arrangement"), f"regions[{i}].kv_arrangement")
                spans.append((first, n, arranged))
                given = (r.get("layer_stride"), r.get("block_stride"))
                if arranged != "Interleaved" and given != (None, None):
                    raise LayoutError(f"regions[{i}] names strides for a {arranged} region; only Interleaved regions take them")
                strides.append(given if arranged == "Interleaved" else None)
                first += n
            if first != layers:
                raise LayoutError(f"regions hold {first} layers in all; the geometry has kv.layers {layers}")
        else:
            spans = [(0, layers, _arrangement(latent, arrangement, "kv_arrangement"))]
            strides = [(None, None) if spans[0][2] == "Interleaved" else None]
        out = PoolLayout(
            layers=layers,
            local_heads=local,
            head_offset=offset,
            head_dim=_positive(kv, "headDim"),
            element_bytes=element_bytes(kv),
            block_size=_positive({"kernelBlockSize": block}, "kernelBlockSize"),
            num_blocks=num_blocks,
            layout=layout,
            latent=latent,
            regions=tuple(spans),
        )
        chunk = 2 * out.block_len
        named = []
        for i, ((_, n, _), given) in enumerate(zip(spans, strides)):
            if given is None:
                named.append(None)
                continue
            block = given[1] if given[1] is not None else chunk
            layer = given[0] if given[0] is not None else block * num_blocks
            for what, v in (("layer_stride", layer), ("block_stride", block)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise LayoutError(f"regions[{i}].{what} is {v!r}; a stride is a count of bytes")
            apart = (block >= chunk and (n <= 1 or layer >= num_blocks * block)) or \
                (layer >= chunk and block >= n * layer)
            if not apart:
                raise LayoutError(
                    f"regions[{i}].layer_stride {layer} and regions[{i}].block_stride {block} make blocks of {chunk} bytes "
                    f"(K and V) overlap: layers outermost needs block_stride >= {chunk} and layer_stride >= num_blocks "
                    f"({num_blocks}) x block_stride; blocks outermost needs layer_stride >= {chunk} and block_stride >= "
                    f"layers ({n}) x layer_stride")
            named.append((layer, block))
        return replace(out, strides=tuple(named))

    @property
    def _regions(self) -> Tuple[Tuple[int, int, str], ...]:
        return self.regions or ((0, self.layers, "Latent" if self.latent else "KvFirst"),)

    @property
    def arrangement(self) -> str:
        """The arrangement of a one-region pool (of the first region otherwise)."""
        return self._regions[0][2]

    @property
    def arrays(self) -> Tuple[bool, ...]:
        """A layer's arrays: K (``False``) and V (``True``), or MLA's latent alone."""
        return (False,) if self.latent else (False, True)

    @property
    def half_token(self) -> int:
        """Bytes of one head's one token's K (or V, or latent)."""
        return self.head_dim * self.element_bytes

    @property
    def block_len(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.local_heads * self.half_token

    @property
    def array_len(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def layer_len(self) -> int:
        return len(self.arrays) * self.array_len

    def _strides(self, r: int) -> Optional[Tuple[int, int]]:
        """Region ``r``'s (layer stride, block stride) where it is ``Interleaved``."""
        if self._regions[r][2] != "Interleaved":
            return None
        named = self.strides[r] if r < len(self.strides) else None
        return named or (2 * self.block_len * self.num_blocks, 2 * self.block_len)

    @property
    def region_lens(self) -> List[int]:
        """Bytes of each region, in order."""
        out = []
        for r, (_, n, _) in enumerate(self._regions):
            s = self._strides(r)
            out.append(n * self.layer_len if s is None else (n - 1) * s[0] + (self.num_blocks - 1) * s[1] + 2 * self.block_len)
        return out

    @property
    def pool_len(self) -> int:
        """Bytes of the whole pool, all regions."""
        return sum(self.region_lens)

    def unit(self, layer: int) -> int:
        """Bytes from one head's token's K (or V) to the next one's: a half token, or two where K
        and V lie side by side."""
        return self.half_token * (2 if self._regions[self.region_of(layer)[0]][2] == "Interleaved" else 1)

    def block_extents(self, layer: int, block: int) -> List[Tuple[int, int, int]]:
        """The bytes a layer's block occupies, ``(region, offset, bytes)``: each array's block, or
        (``Interleaved``) its K and V together."""
        if self.unit(layer) != self.half_token:
            r, at = self.block_offset(layer, False, block)
            return [(r, at, 2 * self.block_len)]
        return [(*self.block_offset(layer, v, block), self.block_len) for v in self.arrays]

    def region_of(self, layer: int) -> Tuple[int, int]:
        """The region holding ``layer``, and the layer's index inside it."""
        for r, (first, n, _) in enumerate(self._regions):
            if first <= layer < first + n:
                return r, layer - first
        raise LayoutError(f"layer {layer} is outside the pool's {self.layers} layers")

    def block_stride(self, layer: int) -> int:
        """Bytes from one block of a layer's K (or V) to the next."""
        r = self.region_of(layer)[0]
        s = self._strides(r)
        if s is not None:
            return s[1]
        return 2 * self.block_len if self._regions[r][2] == "BlocksFirst" else self.block_len

    def block_offset(self, layer: int, v: bool, block: int) -> Tuple[int, int]:
        """The region, and the offset in it, of a block of a layer's K (``v`` false, or the
        latent) or V array."""
        r, local = self.region_of(layer)
        s = self._strides(r)
        if s is not None:
            return r, local * s[0] + block * s[1] + int(v) * self.half_token
        start = local * self.layer_len
        arrangement = self._regions[r][2]
        if arrangement == "KvFirst":
            return r, start + int(v) * self.array_len + block * self.block_len
        if arrangement == "BlocksFirst":
            return r, start + block * 2 * self.block_len + int(v) * self.block_len
        return r, start + block * self.block_len

    def token_offset(self, head: int, token: int, layer: int) -> int:
        """Offset of a local head's token inside a layer's block."""
        unit = self.unit(layer)
        if self.layout == "HND":
            return (head * self.block_size + token) * unit
        return (token * self.local_heads + head) * unit

    def blocks_for(self, num_tokens: int, first_token: int = 0) -> int:
        """Blocks that hold tokens ``first_token..num_tokens``."""
        live = max(num_tokens - first_token, 0)
        return -(-live // self.block_size)

    def tokens(self, blocks: List[int], first_token: int, num_tokens: int):
        """((region, byte offset), layer, global head, absolute token, v) of every live token's K
        and V (or latent) in ``blocks`` (in token order, the first holding ``first_token``)."""
        for i, block in enumerate(blocks):
            for j in range(self.block_size):
                t = first_token + i * self.block_size + j
                if t >= num_tokens:
                    return
                for layer in range(self.layers):
                    for h in range(self.local_heads):
                        for v in self.arrays:
                            r, at = self.block_offset(layer, v, block)
                            yield (r, at + self.token_offset(h, j, layer)), layer, self.head_offset + h, t, v


def runs(blocks: List[int]) -> List[Tuple[int, int]]:
    """Consecutive block ids joined: ``[(first, count), ...]`` in order."""
    out: List[Tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out
