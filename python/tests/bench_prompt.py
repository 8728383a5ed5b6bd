"""What binding a request's KV to its prompt costs the scheduler, measured (not asserted): the
connector's prompt digest (``Prompt.digest``, SHA-256 over the token ids) for one request, beside
vLLM's own prefix-cache block hashing of the same prompt (``get_request_block_hasher`` with its
default ``sha256``, 16-token blocks), which vLLM's scheduler runs for every request anyway. Each
is the median of ``--rounds`` runs, in one process, one core.

    from python/tests, with the vLLM venv's python:
    python bench_prompt.py [--rounds 50] [--tokens 4096,32768,131072]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from pdpair_vllm.connector import _prompt


def median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--tokens", default="4096,32768,131072")
    args = ap.parse_args()
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(16, hash_fn)
    for n in (int(t) for t in args.tokens.split(",")):
        tokens = [(i * 7919) % 128000 for i in range(n)]

        req = Request("r", tokens, SamplingParams(max_tokens=1), None)
        digest_ms = median_ms(lambda: _prompt(req).digest(n), args.rounds)
        # The hasher hashes the blocks past those the request holds hashes of (none, here).
        vllm_ms = median_ms(lambda: hasher(req), args.rounds)
        print(json.dumps({"tokens": n, "pdpair_digest_ms": round(digest_ms, 3),
                          "vllm_block_hashes_ms": round(vllm_ms, 3), "ratio": round(digest_ms / vllm_ms, 3)}))


if __name__ == "__main__":
    main()
