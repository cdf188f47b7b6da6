"""Paged attention over the block-first KV pool: the seam a GPU kernel replaces.

The worker owns ONE pool tensor per memory tier, block-first, so that one block is one
contiguous region holding every layer's K and V for `block_size` token slots. Moving a
request between HBM and DRAM is then one copy per block, never one per layer:

    kv_pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

    block 0 ┌─ layer 0 ─┬─ K: [block_size, num_kv_heads, head_dim]
            │           └─ V: [block_size, num_kv_heads, head_dim]
            ├─ layer 1 ─┬─ K ...
            │   ...     └─ V ...
            └─ layer L-1 ...
    block 1 ┌─ layer 0 ...                        (contiguous, block after block)

Layer l reads and writes through the strided view `kv_pool[:, l]`:
`[num_blocks, 2, block_size, num_kv_heads, head_dim]`. Token position p of a request
lives in slot (block_table[p // block_size], p % block_size).

`write_kv` and `paged_attention` are the only functions that touch the pool during a
forward; `AttentionMetadata` is everything they need, built once per step.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker import cpu_kernels


@dataclass
class DecodeBatch:
    """The single-token queries of a step.

    On the CPU (float32) a native kernel reads each context where it lies in the pool
    (cpu_kernels.py). Elsewhere they are attended in one padded SDPA call: their contexts are
    gathered by whole blocks (one contiguous copy per block); the slots past each request's
    context (the tail of its last block, and whole padding blocks) are zeroed after the
    gather, since the pool may hold anything there (`padding`, built on that path's first use:
    the native kernel never reads it, and on CPU its few tensor ops took ~0.2 ms a step).
    """

    block_ids: torch.Tensor  # [R, max_blocks] long; padding repeats the row's first block
    context_lens: torch.Tensor  # [R] long: keys per row, the new one included
    block_size: int
    host_context_lens: torch.Tensor  # context_lens on the host, where `padding` is built

    def to(self, device) -> DecodeBatch:
        return DecodeBatch(
            _move(self.block_ids, device), _move(self.context_lens, device), self.block_size, self.host_context_lens
        )

    @functools.cached_property
    def padding(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """On the batch's device: (rows, keys), the [P] long coordinates of every gathered slot
        past its context, and the mask [R, 1, 1, max_blocks * block_size] bool, True = attend."""
        keys = torch.arange(self.block_ids.shape[1] * self.block_size)[None, :]  # [1, S]
        valid = keys < self.host_context_lens[:, None]  # [R, S]
        pad_rows, pad_keys = (~valid).nonzero(as_tuple=True)
        device = self.block_ids.device
        return _move(pad_rows, device), _move(pad_keys, device), _move(valid[:, None, None, :], device)


@dataclass
class PrefillSegment:
    """A run of more than one query token of one request (a prefill chunk)."""

    q_start: int  # first row of this request in the flattened step
    q_len: int
    # Tokens already in the cache before this chunk; 0 means the chunk is the whole context
    # so far and attends only to its own fresh K/V (no gather).
    num_cached: int
    block_ids: torch.Tensor  # [blocks holding num_cached + q_len tokens]
    mask: torch.Tensor | None  # [q_len, num_cached + q_len] bool when num_cached > 0

    def to(self, device) -> PrefillSegment:
        mask = None if self.mask is None else _move(self.mask, device)
        return PrefillSegment(self.q_start, self.q_len, self.num_cached, _move(self.block_ids, device), mask)

    @functools.cached_property
    def as_decode_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's queries as decode rows (batch-invariant attention): each row's block table
        [q_len, blocks] and the keys it sees [q_len]; built once a step, read by every layer."""
        tables = self.block_ids.expand(self.q_len, -1).contiguous()
        return tables, torch.arange(self.num_cached + 1, self.num_cached + self.q_len + 1)


@dataclass
class AttentionMetadata:
    """One step's layout. Rows [0, num_decodes) are single-token queries (decodes); the
    prefill segments follow."""

    slot_blocks: torch.Tensor  # [T] long: block id where each new token's K/V goes
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    num_decodes: int
    decodes: DecodeBatch | None
    prefills: list[PrefillSegment]

    def to(self, device) -> AttentionMetadata:
        """Built on the host (small Python lists), then moved in one go."""
        return AttentionMetadata(
            slot_blocks=_move(self.slot_blocks, device),
            slot_offsets=_move(self.slot_offsets, device),
            num_decodes=self.num_decodes,
            decodes=None if self.decodes is None else self.decodes.to(device),
            prefills=[seg.to(device) for seg in self.prefills],
        )


def _move(t: torch.Tensor, device) -> torch.Tensor:
    return t if t.device == torch.device(device) else t.to(device, non_blocking=True)


def build_metadata(
    num_cached: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device,
) -> AttentionMetadata:
    """Metadata for requests laid out in this order (all single-token ones first).

    `block_tables[i]` must cover positions [0, num_cached[i] + num_new[i]).
    """
    num_decodes = _count_leading_decodes(num_new)
    if any(n == 1 for n in num_new[num_decodes:]):
        raise ValueError("single-token requests must come first in a step")
    blocks, offsets = slot_mapping(num_cached, num_new, block_tables, block_size)
    decodes = None
    if num_decodes:
        decodes = _decode_batch(num_cached[:num_decodes], block_tables[:num_decodes], block_size)
    prefills = []
    q_start = num_decodes
    for c, n, table in zip(num_cached[num_decodes:], num_new[num_decodes:], block_tables[num_decodes:]):
        prefills.append(_prefill_segment(q_start, c, n, table, block_size))
        q_start += n
    return AttentionMetadata(
        slot_blocks=torch.tensor(blocks, dtype=torch.long),
        slot_offsets=torch.tensor(offsets, dtype=torch.long),
        num_decodes=num_decodes,
        decodes=decodes,
        prefills=prefills,
    ).to(device)


def slot_mapping(
    num_cached: list[int], num_new: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[list[int], list[int]]:
    """(block id, offset) of every new token, flattened in request order."""
    blocks: list[int] = []
    offsets: list[int] = []
    for c, n, table in zip(num_cached, num_new, block_tables):
        if len(table) < -(-(c + n) // block_size):
            raise ValueError(f"block table of {len(table)} blocks cannot hold {c + n} tokens")
        for p in range(c, c + n):
            blocks.append(table[p // block_size])
            offsets.append(p % block_size)
    return blocks, offsets


def _count_leading_decodes(num_new: list[int]) -> int:
    i = 0
    while i < len(num_new) and num_new[i] == 1:
        i += 1
    return i


def padded_tables(contexts: list[int], block_tables: list[list[int]], block_size: int) -> list[list[int]]:
    """Each row's blocks holding its `contexts[i]` keys, padded to the widest with its first block
    (the decode kernels' [R, max_blocks] table; the padding is never read)."""
    used = [table[: -(-c // block_size)] for c, table in zip(contexts, block_tables)]
    width = max(map(len, used))
    return [u + u[:1] * (width - len(u)) for u in used]


def _decode_batch(num_cached: list[int], block_tables: list[list[int]], block_size: int) -> DecodeBatch:
    ctx = [c + 1 for c in num_cached]  # keys per request, the new one included
    rows = padded_tables(ctx, block_tables, block_size)
    context_lens = torch.tensor(ctx)
    return DecodeBatch(torch.tensor(rows, dtype=torch.long), context_lens, block_size, context_lens)


def _prefill_segment(
    q_start: int, num_cached: int, q_len: int, table: list[int], block_size: int
) -> PrefillSegment:
    total = num_cached + q_len
    block_ids = torch.tensor(table[: -(-total // block_size)], dtype=torch.long)
    if num_cached == 0:
        return PrefillSegment(q_start, q_len, 0, block_ids, None)
    rows = torch.arange(q_len)[:, None] + num_cached
    mask = torch.arange(total)[None, :] <= rows  # [q_len, total]
    return PrefillSegment(q_start, q_len, num_cached, block_ids, mask)


# ---------------------------------------------------------------- the seam


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the step's new K/V in their slots.

    kv_layer: [num_blocks, 2, block_size, KV, D] (a strided view of the pool); k, v: [T, KV, D],
    rounded to the pool's dtype where it is narrower than the model's (a bfloat16 KV cache)
    """
    native = cpu_kernels.for_tensor(k)
    if native is not None and native.supports_write_kv(k, v, kv_layer, meta):
        return native.write_kv(kv_layer, k, v, meta)
    kv_layer[:, 0].index_put_((meta.slot_blocks, meta.slot_offsets), k.to(kv_layer.dtype))
    kv_layer[:, 1].index_put_((meta.slot_blocks, meta.slot_offsets), v.to(kv_layer.dtype))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
    invariant: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Attention of every query row over its request's context; K/V already written.

    q: [T, H, D]; k, v: [T, KV, D] (this step's fresh keys, used directly by a prefill that
    starts at position 0, as the pool holds them); kv_layer: [num_blocks, 2, block_size, KV, D],
    of q's dtype or a narrower one. Returns [T, H, D].

    invariant (on CPU with the native kernels): each row's result is a function of its own query
    and keys alone, to the bit, whatever else the step holds: decodes run on fixed spans and a
    prefill chunk's queries run as decode rows of the same kernel. A token recomputed after a
    preemption then gets exactly the attention its decode got (models with int8 activations need
    it: their rounding turns float differences into different tokens).
    """
    out = torch.empty_like(q)
    r = meta.num_decodes
    if r:
        out[:r] = _decode_attention(q[:r], kv_layer, meta.decodes, invariant)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_layer, seg, invariant)
    return out


def _decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, batch: DecodeBatch, invariant: bool = False
) -> torch.Tensor:
    """All single-token queries: the native CPU kernel where it applies, else `_decode_sdpa`."""
    native = cpu_kernels.for_tensor(q)
    if native is not None and native.supports_decode(q, kv_layer):
        return native.decode_attention(q, kv_layer, batch.block_ids, batch.context_lens, invariant)
    return _decode_sdpa(q, kv_layer, batch)


def _decode_sdpa(q: torch.Tensor, kv_layer: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """All single-token queries in one padded SDPA call.

    The query heads of one KV group ride in SDPA's query-length slot, so grouped-query
    attention needs no repeated K/V: q [R, KV, G, D] against k [R, KV, S, D].
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv = kv_layer.shape[3]
    k, v = (t.to(q.dtype) for t in gather_blocks(kv_layer, batch.block_ids))  # [R, S, KV, D] each
    pad_rows, pad_keys, mask = batch.padding
    k[pad_rows, pad_keys] = 0.0  # whatever the pool held there, make it finite
    v[pad_rows, pad_keys] = 0.0
    qg = q.view(num_rows, num_kv, num_heads // num_kv, head_dim)  # [R, KV, G, D]
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.reshape(num_rows, num_heads, head_dim)  # from [R, KV, G, D]


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, seg: PrefillSegment,
    invariant: bool = False,
) -> torch.Tensor:  # fmt: skip
    """One chunk, causal; a chunk after cached tokens sees them all plus its own prefix. The
    native CPU kernels read every key from the pool (invariant: the decode kernel, a row per
    query); SDPA takes a first chunk's fresh K/V as they are and gathers a later chunk's context."""
    native = cpu_kernels.for_tensor(q)
    if invariant and native is not None and native.supports_decode(q, kv_layer):
        return native.decode_attention(q, kv_layer, *seg.as_decode_rows, invariant=True)
    if native is not None and native.supports_prefill(q, kv_layer):
        return native.prefill_attention(q, kv_layer, seg.block_ids, seg.num_cached)
    qh = q.transpose(0, 1)[None]  # [1, H, n, D]
    if seg.num_cached == 0:
        if kv_layer.dtype != k.dtype:  # what later steps will read: the keys rounded as stored
            k, v = (t.to(kv_layer.dtype).to(k.dtype) for t in (k, v))
        kh = k.transpose(0, 1)[None]  # [1, KV, n, D]
        vh = v.transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        total = seg.num_cached + seg.q_len
        kc, vc = (t.to(q.dtype) for t in gather_blocks(kv_layer, seg.block_ids))  # [S, KV, D] each, S >= total
        kh = kc[:total].transpose(0, 1)[None]  # [1, KV, total, D]
        vh = vc[:total].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seg.mask, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, H, D]


def gather_blocks(kv_layer: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the K and V of whole blocks, one contiguous copy per block.

    kv_layer: [N, 2, B, KV, D]; block_ids: [..., nb] -> k, v: [..., nb * B, KV, D]
    """
    _, _, block_size, num_kv, head_dim = kv_layer.shape
    flat = block_ids.reshape(-1)
    shape = (*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv, head_dim)
    k = kv_layer[:, 0].flatten(1).index_select(0, flat).view(shape)
    v = kv_layer[:, 1].flatten(1).index_select(0, flat).view(shape)
    return k, v
