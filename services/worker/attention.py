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

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ContextIndex:
    """Where a request's context tokens sit in the pool: slot (blocks[..., i], offsets[..., i])
    holds token i. Gathering by token slot (not by whole block) never reads a slot that was
    not written, so the pool needs no initialisation and padding stays finite."""

    blocks: torch.Tensor  # [..., S] long
    offsets: torch.Tensor  # [..., S] long

    def to(self, device: torch.device) -> ContextIndex:
        return ContextIndex(_move(self.blocks, device), _move(self.offsets, device))


@dataclass
class PrefillSegment:
    """A run of more than one query token of one request (a prefill chunk)."""

    q_start: int  # first row of this request in the flattened step
    q_len: int
    # Tokens already in the cache before this chunk; 0 means the chunk is the whole context
    # so far and attends only to its own fresh K/V (no gather).
    num_cached: int
    context: ContextIndex | None  # [num_cached + q_len] when num_cached > 0
    mask: torch.Tensor | None  # [q_len, num_cached + q_len] bool when num_cached > 0

    def to(self, device: torch.device) -> PrefillSegment:
        if self.context is None:
            return self
        return PrefillSegment(
            self.q_start, self.q_len, self.num_cached, self.context.to(device), _move(self.mask, device)
        )


@dataclass
class AttentionMetadata:
    """One step's layout. Rows [0, num_decodes) are single-token queries (decodes), batched
    into one padded SDPA call; the prefill segments follow."""

    slot_blocks: torch.Tensor  # [T] long: block id where each new token's K/V goes
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    num_decodes: int
    decode_context: ContextIndex | None  # [R, S_max]; padding repeats the last real token
    decode_mask: torch.Tensor | None  # [R, 1, 1, S_max] bool
    prefills: list[PrefillSegment]

    def to(self, device: torch.device) -> AttentionMetadata:
        """Built on the host (small Python lists), then moved in one go."""
        return AttentionMetadata(
            slot_blocks=_move(self.slot_blocks, device),
            slot_offsets=_move(self.slot_offsets, device),
            num_decodes=self.num_decodes,
            decode_context=None if self.decode_context is None else self.decode_context.to(device),
            decode_mask=None if self.decode_mask is None else _move(self.decode_mask, device),
            prefills=[seg.to(device) for seg in self.prefills],
        )


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == torch.device(device) else t.to(device, non_blocking=True)


def build_metadata(
    num_cached: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for requests laid out in this order (all single-token ones first).

    `block_tables[i]` must cover positions [0, num_cached[i] + num_new[i]).
    """
    num_decodes = _count_leading_decodes(num_new)
    if any(n == 1 for n in num_new[num_decodes:]):
        raise ValueError("single-token requests must come first in a step")
    blocks, offsets = slot_mapping(num_cached, num_new, block_tables, block_size)
    context, mask = None, None
    if num_decodes:
        context, mask = _decode_context(num_cached[:num_decodes], block_tables[:num_decodes], block_size)
    prefills = []
    q_start = num_decodes
    for c, n, table in zip(num_cached[num_decodes:], num_new[num_decodes:], block_tables[num_decodes:]):
        prefills.append(_prefill_segment(q_start, c, n, table, block_size))
        q_start += n
    return AttentionMetadata(
        slot_blocks=torch.tensor(blocks, dtype=torch.long),
        slot_offsets=torch.tensor(offsets, dtype=torch.long),
        num_decodes=num_decodes,
        decode_context=context,
        decode_mask=mask,
        prefills=prefills,
    ).to(device)


def slot_mapping(
    num_cached: list[int], num_new: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[list[int], list[int]]:
    """(block id, offset) of every new token, flattened in request order."""
    blocks: list[int] = []
    offsets: list[int] = []
    for c, n, table in zip(num_cached, num_new, block_tables):
        need = -(-(c + n) // block_size)
        if len(table) < need:
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


def _decode_context(
    num_cached: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[ContextIndex, torch.Tensor]:
    ctx = torch.tensor([c + 1 for c in num_cached])  # [R] keys per request, new one included
    max_ctx = int(ctx.max())
    max_blocks = -(-max_ctx // block_size)
    tables = torch.zeros(len(num_cached), max_blocks, dtype=torch.long)  # [R, nb]
    for i, table in enumerate(block_tables):
        row = table[:max_blocks]
        tables[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    keys = torch.arange(max_ctx)[None, :]  # [1, S]
    pos = torch.minimum(keys, ctx[:, None] - 1)  # [R, S]: padding repeats the last real token
    context = ContextIndex(tables.gather(1, pos // block_size), pos % block_size)
    mask = (keys < ctx[:, None])[:, None, None, :]  # [R, 1, 1, S]
    return context, mask


def _prefill_segment(q_start: int, num_cached: int, q_len: int, table: list[int], block_size: int) -> PrefillSegment:
    if num_cached == 0:
        return PrefillSegment(q_start, q_len, 0, None, None)
    total = num_cached + q_len
    pos = torch.arange(total)
    context = ContextIndex(torch.tensor(table, dtype=torch.long)[pos // block_size], pos % block_size)
    rows = torch.arange(q_len)[:, None] + num_cached
    mask = pos[None, :] <= rows  # [q_len, total]
    return PrefillSegment(q_start, q_len, num_cached, context, mask)


# ---------------------------------------------------------------- the seam


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the step's new K/V in their slots.

    kv_layer: [num_blocks, 2, block_size, KV, D] (a strided view of the pool); k, v: [T, KV, D]
    """
    kv_layer[:, 0].index_put_((meta.slot_blocks, meta.slot_offsets), k)
    kv_layer[:, 1].index_put_((meta.slot_blocks, meta.slot_offsets), v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Attention of every query row over its request's context; K/V already written.

    q: [T, H, D]; k, v: [T, KV, D] (this step's fresh keys, used directly by a prefill that
    starts at position 0); kv_layer: [num_blocks, 2, block_size, KV, D]. Returns [T, H, D].
    """
    out = torch.empty_like(q)
    r = meta.num_decodes
    if r:
        out[:r] = _decode_attention(q[:r], kv_layer, meta)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_layer, seg)
    return out


def _decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """All single-token queries in one padded SDPA call.

    The query heads of one KV group ride in SDPA's query-length slot, so grouped-query
    attention needs no repeated K/V: q [R, KV, G, D] against k [R, KV, S, D].
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv = kv_layer.shape[3]
    k, v = gather_context(kv_layer, meta.decode_context)  # [R, S, KV, D] each
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [R, KV, S, D]
    qg = q.view(num_rows, num_kv, num_heads // num_kv, head_dim)  # [R, KV, G, D]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask)  # [R, KV, G, D]
    return out.reshape(num_rows, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, seg: PrefillSegment
) -> torch.Tensor:
    """One chunk, causal; a chunk after cached tokens sees them all plus its own prefix."""
    qh = q.transpose(0, 1)[None]  # [1, H, n, D]
    if seg.num_cached == 0:
        kh = k.transpose(0, 1)[None]  # [1, KV, n, D]
        vh = v.transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        kc, vc = gather_context(kv_layer, seg.context)  # [S, KV, D] each
        kh, vh = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]  # [1, KV, S, D]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seg.mask, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, H, D]


def gather_context(kv_layer: torch.Tensor, ctx: ContextIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the indexed slots. kv_layer: [N, 2, B, KV, D] -> two [..., S, KV, D]."""
    return kv_layer[:, 0][ctx.blocks, ctx.offsets], kv_layer[:, 1][ctx.blocks, ctx.offsets]
