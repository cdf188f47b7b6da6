"""Content hashes of full KV blocks, for prefix caching (the reuse rules are in blocks.py).

Block i of a request is named by a chain: hash(hash of block i-1, its `block_size` token
ids), seeded with a salt (the model's name), so two blocks share a name only if every
token up to their end is the same, for the same model. A 128-bit BLAKE2b digest: a
collision would silently give one request another's KV.
"""

from __future__ import annotations

import hashlib
from array import array


def root_hash(salt: str) -> bytes:
    """The parent of a request's first block."""
    return hashlib.blake2b(salt.encode(), digest_size=16).digest()


def extend_hashes(hashes: list[bytes], root: bytes, tokens: list[int], block_size: int, num_blocks: int) -> None:
    """Grow `hashes` (a request's chain so far) to the first `num_blocks` full blocks of
    `tokens`, which must hold at least `num_blocks * block_size` token ids."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_blocks):
        chunk = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(chunk, digest_size=16, key=parent).digest()
        hashes.append(parent)
