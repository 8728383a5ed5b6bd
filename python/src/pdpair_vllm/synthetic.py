"""The synthetic KV pattern (the agent's ``agent/src/synthetic.rs``): bytes that depend only on
(seed, layer, global head, absolute token, K/V, byte), so a decode engine checks every received
byte without trusting checksums, whichever engine (Python or the agent's Rust one) wrote them.
"""

from __future__ import annotations

import struct
from typing import List

from .layout import PoolLayout

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def token_bytes(seed: int, layer: int, head: int, token: int, v: bool, n: int) -> bytes:
    """``n`` bytes of one head's one token's K (``v`` false) or V."""
    x = (seed ^ (layer << 52) ^ (head << 40) ^ ((token * _GOLDEN) & _M) ^ int(v)) & _M
    out = bytearray()
    while len(out) < n:
        x = (x + _GOLDEN) & _M
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
        z ^= z >> 31
        out += struct.pack("<Q", z)
    return bytes(out[:n])


def _regions(mem) -> list:
    """One buffer per region: a list of them, or one buffer for a one-region pool."""
    return list(mem) if isinstance(mem, (list, tuple)) else [mem]


def fill(mem, layout: PoolLayout, seed: int, blocks: List[int], first_token: int, num_tokens: int) -> None:
    """Prefill: writes the pattern of tokens ``first_token..num_tokens`` into ``blocks`` (``mem``:
    the pool's region buffers, or its one buffer)."""
    mems, half = _regions(mem), layout.half_token
    for (r, at), layer, head, t, v in layout.tokens(blocks, first_token, num_tokens):
        mems[r][at : at + half] = token_bytes(seed, layer, head, t, v, half)


def clear(mem, layout: PoolLayout, blocks: List[int]) -> None:
    """Decode: zeroes blocks, so stale bytes cannot pass verification."""
    mems = _regions(mem)
    for block in blocks:
        for layer in range(layout.layers):
            for r, at, n in layout.block_extents(layer, block):
                mems[r][at : at + n] = bytes(n)


def verify(mem, layout: PoolLayout, seed: int, blocks: List[int], first_token: int, num_tokens: int) -> int:
    """Decode: how many received tokens' K or V (or latents) differ from the pattern."""
    mems, half = _regions(mem), layout.half_token
    bad = 0
    for (r, at), layer, head, t, v in layout.tokens(blocks, first_token, num_tokens):
        if bytes(mems[r][at : at + half]) != token_bytes(seed, layer, head, t, v, half):
            bad += 1
    return bad
