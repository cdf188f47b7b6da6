"""Paged attention against dense attention on random tensors (no model involved)."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker import attention, cpu_kernels
from services.worker.attention import build_metadata, paged_attention, slot_mapping, write_kv

NUM_BLOCKS, NUM_LAYERS, BLOCK, KV, GROUP, D = 40, 2, 4, 2, 3, 8
H = KV * GROUP


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """q: [n, H, D] at positions num_cached.., k, v: [num_cached + n, KV, D] -> [n, H, D]."""
    n, total = q.shape[0], k.shape[0]
    kr = k.repeat_interleave(GROUP, dim=1).transpose(0, 1)  # [H, total, D]
    vr = v.repeat_interleave(GROUP, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ kr.transpose(1, 2) / D**0.5  # [H, n, total]
    allowed = torch.arange(total)[None, :] <= torch.arange(n)[:, None] + num_cached
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vr).transpose(0, 1)


@pytest.fixture(params=["kernel", "sdpa"])
def native_path(request, monkeypatch):
    """Attention through the native CPU kernels, and through the torch path they replace elsewhere."""
    if request.param == "sdpa":
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    return request.param


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_step_matches_dense(seed, kv_dtype, native_path):
    """Decodes with ragged contexts, a fresh prefill and a chunk after cached tokens, in one
    step, over a pool full of NaN: only written slots may ever be read. A bfloat16 pool: every
    query, a fresh prefill's too, sees the keys and values rounded as the pool holds them."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.full((NUM_BLOCKS, NUM_LAYERS, 2, BLOCK, KV, D), float("nan"), dtype=kv_dtype)
    layer = pool[:, 1]
    cached = [0, 4, 16, 9, 0, 13]  # tokens already in the cache
    new = [1, 1, 1, 1, 6, 11]  # the first four are decodes
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK))] for c, n in zip(cached, new)]
    history_k = [torch.randn(c + n, KV, D, generator=gen) for c, n in zip(cached, new)]
    history_v = [torch.randn(c + n, KV, D, generator=gen) for c, n in zip(cached, new)]
    stored_k = [k.to(kv_dtype).float() for k in history_k]  # what the pool returns
    stored_v = [v.to(kv_dtype).float() for v in history_v]
    # Earlier steps wrote the cached part.
    blocks, offsets = slot_mapping([0] * len(cached), cached, tables, BLOCK)
    layer[torch.tensor(blocks, dtype=torch.long), 0, torch.tensor(offsets, dtype=torch.long)] = torch.cat(
        [k[:c] for k, c in zip(history_k, cached)]
    ).to(kv_dtype)
    layer[torch.tensor(blocks, dtype=torch.long), 1, torch.tensor(offsets, dtype=torch.long)] = torch.cat(
        [v[:c] for v, c in zip(history_v, cached)]
    ).to(kv_dtype)

    meta = build_metadata(cached, new, tables, BLOCK, "cpu")
    k_new = torch.cat([k[c:] for k, c in zip(history_k, cached)])  # [T, KV, D]
    v_new = torch.cat([v[c:] for v, c in zip(history_v, cached)])
    q = torch.randn(k_new.shape[0], H, D, generator=gen)  # [T, H, D]
    write_kv(layer, k_new, v_new, meta)
    out = paged_attention(q, k_new, v_new, layer, meta)

    assert meta.num_decodes == 4 and len(meta.prefills) == 2
    assert not torch.isnan(out).any()
    native = cpu_kernels.kernels()
    bf16_products = kv_dtype == torch.bfloat16 and native is not None and native.prefill_bf16
    row = 0
    for k, v, c, n in zip(stored_k, stored_v, cached, new):
        if n > 1 and bf16_products:  # a prefill over a bfloat16 pool: Q and P rounded to bfloat16
            want = dense_attention(q[row : row + n].to(torch.bfloat16).float(), k, v, c)
            torch.testing.assert_close(out[row : row + n], want, atol=1e-2, rtol=1e-2)
        else:
            want = dense_attention(q[row : row + n], k, v, c)
            torch.testing.assert_close(out[row : row + n], want, atol=1e-5, rtol=1e-5)
        row += n
    assert torch.isnan(pool[:, 0]).all(), "another layer was written"


def test_write_kv_hits_the_right_slots():
    pool = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK, KV, D)
    meta = build_metadata([3], [6], [[7, 2, 5]], BLOCK, "cpu")  # positions 3..8
    k = torch.arange(6.0)[:, None, None].expand(6, KV, D)
    write_kv(pool[:, 0], k, -k, meta)
    # position p -> block [7, 2, 5][p // 4], offset p % 4
    assert pool[7, 0, 0, 3, 0, 0] == 0 and pool[2, 0, 0, 0, 0, 0] == 1 and pool[2, 0, 0, 3, 0, 0] == 4
    assert pool[5, 0, 0, 0, 0, 0] == 5 and pool[5, 0, 1, 0, 0, 0] == -5
    assert pool[:, 1].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kv_store_equals_torchs(dtype, monkeypatch):
    """K and V as the model hands them (views into one qkv projection, rows apart by its width)
    land in the same slots with the same values, rounded as torch rounds into a bfloat16 pool."""
    if cpu_kernels.kernels() is None:
        pytest.skip("native CPU kernels not built here")
    meta = build_metadata([3, 0], [6, 5], [[7, 2, 5], [0, 1]], BLOCK, "cpu")
    qkv = torch.randn(11, (9 + 2 * KV) * D, generator=torch.Generator().manual_seed(0))
    k = qkv[:, 9 * D : (9 + KV) * D].view(11, KV, D)
    v = qkv[:, (9 + KV) * D :].view(11, KV, D)
    pools = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
        pool = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK, KV, D, dtype=dtype)
        write_kv(pool[:, 1], k, v, meta)
        pools.append(pool)
    assert pools[0].abs().sum() > 0 and torch.equal(pools[0], pools[1])


def test_single_token_requests_must_lead():
    with pytest.raises(ValueError, match="first"):
        build_metadata([0, 5], [4, 1], [[0, 1], [2, 3]], BLOCK, "cpu")


def test_short_block_table_is_rejected():
    with pytest.raises(ValueError, match="cannot hold"):
        build_metadata([7], [2], [[0, 1]], BLOCK, "cpu")


def test_cpu_kernel_builds_here():
    """This machine has a C compiler, so serving must not fall back to the slower torch path."""
    assert cpu_kernels.kernels() is not None


@pytest.mark.parametrize(
    "block_size, num_kv, group, head_dim, context",
    [
        (16, 3, 3, 64, [1, 16, 17, 77]),  # SmolLM2
        (32, 3, 3, 64, [1, 20, 32, 33, 95]),  # SmolLM2 in 32-token blocks: 16 keys scored at a time, and a rest
        (32, 1, 8, 128, [1, 32, 33, 157]),  # MQA
        (4, 2, 1, 8, [1, 4, 5, 17]),  # MHA
        (64, 8, 5, 128, [1, 64, 65, 317]),  # Qwen2.5-32B
        (16, 3, 3, 64, [2000]),  # one long context: split over the threads, the parts merged
    ],
)
def test_cpu_kernel_matches_sdpa_path(block_size, num_kv, group, head_dim, context):
    """Model shapes the kernel meets: same output as the padded SDPA path, contexts ragged and
    ending anywhere in a block, blocks scattered, the query a strided view (as the model's is)."""
    gen = torch.Generator().manual_seed(block_size)
    num_layers, num_heads = 3, num_kv * group
    num_blocks = max(64, sum(-(-(c + 1) // block_size) for c in context))
    pool = torch.randn(num_blocks, num_layers, 2, block_size, num_kv, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-(c + 1) // block_size))] for c in context]
    meta = build_metadata(context, [1] * len(context), tables, block_size, "cpu")
    qk = torch.randn(len(context), num_heads + num_kv, head_dim, generator=gen)
    q, layer = qk[:, :num_heads], pool[:, 1]  # [R, H, D] with a row stride of H + KV heads
    got = cpu_kernels.kernels().decode_attention(q, layer, meta.decodes.block_ids, meta.decodes.context_lens)
    torch.testing.assert_close(got, attention._decode_sdpa(q, layer, meta.decodes), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_decode_attention_depends_on_the_row_alone(kv_dtype):
    """Spans cut by each row's own length (the GGUF's attention, where a recomputed token must see
    what its decode saw): a row's output is the same to the bit alone, beside rows of other lengths
    in either order, and on one thread or two; for contexts of one span, of two (one request shared
    by two threads) and of four. And it is the attention the SDPA path computes."""
    native = cpu_kernels.kernels()
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv, group, head_dim = 16, 3, 3, 64  # SmolLM2
    cached = [0, 99, 128, 299, 600, 1100]
    num_blocks = sum(-(-(c + 1) // block_size) for c in cached) + 8
    pool = torch.randn(num_blocks, 2, 2, block_size, num_kv, head_dim, generator=gen).to(kv_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-(c + 1) // block_size))] for c in cached]
    q, layer = torch.randn(len(cached), num_kv * group, head_dim, generator=gen), pool[:, 1]

    def attend(rows: list[int], threads: int) -> dict[int, torch.Tensor]:
        meta = build_metadata([cached[r] for r in rows], [1] * len(rows), [tables[r] for r in rows], block_size, "cpu")
        batch, before = meta.decodes, torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = native.decode_attention(q[rows], layer, batch.block_ids, batch.context_lens, invariant=True)
        finally:
            torch.set_num_threads(before)
        return dict(zip(rows, out))

    rows = list(range(len(cached)))
    together, backwards = attend(rows, 2), attend(rows[::-1], 2)
    for r in rows:
        for other in (backwards, attend([r], 2), attend([r], 1)):
            assert torch.equal(together[r], other[r]), f"row of {cached[r] + 1} keys"
    meta = build_metadata(cached, [1] * len(cached), tables, block_size, "cpu")
    want = attention._decode_sdpa(q, layer.float(), meta.decodes)
    torch.testing.assert_close(torch.stack([together[r] for r in rows]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "block_size, num_kv, group, head_dim, cached, q_len",
    [
        (16, 3, 3, 64, 0, 512),  # SmolLM2, a whole prompt: 16 positions x 3 heads per tile
        (16, 3, 3, 64, 37, 70),  # a later chunk starting mid-block; a part tile at the end
        (32, 1, 8, 128, 0, 13),  # MQA-like groups of 8: 6 positions per tile
        (64, 8, 5, 128, 100, 9),  # Qwen2.5-32B's groups of 5: 48 rows hold 9 positions, 3 lanes spare
        (4, 2, 1, 8, 5, 50),  # MHA, tiny blocks: chunks of 4 keys (a score pass of one key at a time)
    ],
)
@pytest.mark.skipif(
    cpu_kernels.kernels() is None or not cpu_kernels.kernels().has_prefill,
    reason="the native prefill kernel is built where the CPU has AVX-512",
)
def test_cpu_prefill_kernel_matches_sdpa_path(block_size, num_kv, group, head_dim, cached, q_len):
    """The native prefill kernel reads every key from the pool, the chunk's own included: the
    same output as the SDPA path (fresh K/V, or the gathered context with a mask)."""
    native = cpu_kernels.kernels()
    gen = torch.Generator().manual_seed(q_len)
    num_layers, num_heads, total = 2, num_kv * group, cached + q_len
    num_blocks = max(64, -(-total // block_size) + 8)
    pool = torch.randn(num_blocks, num_layers, 2, block_size, num_kv, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: -(-total // block_size)].tolist()
    meta = build_metadata([cached], [q_len], [table], block_size, "cpu")
    layer = pool[:, 0]
    qkv = torch.randn(q_len, num_heads + 2 * num_kv, head_dim, generator=gen)  # strided views, as the model's
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv], qkv[:, num_heads + num_kv :]
    write_kv(layer, k, v, meta)
    (seg,) = meta.prefills
    assert native.supports_prefill(q, layer)
    got = native.prefill_attention(q, layer, seg.block_ids, cached)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "kernels", lambda: None)
        want = attention._prefill_attention(q, k, v, layer, seg)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the two unrolled sizes, and the generic loop
def test_cpu_kernels_read_a_bfloat16_pool_exactly(head_dim):
    """Over a bfloat16 pool the kernels give, to the bit, what they give over the same values in
    a float32 pool: widening is exact, and nothing else about the arithmetic changes (the generic
    loop of other head sizes: to float32's rounding, as the compiler may vectorise its sums
    differently for the two element types)."""
    native = cpu_kernels.kernels()
    gen = torch.Generator().manual_seed(head_dim)
    block_size, num_kv, group, context = 16, 2, 4, [1, 16, 45, 300]
    num_heads = num_kv * group
    pool = torch.randn(64, 2, 2, block_size, num_kv, head_dim, generator=gen).to(torch.bfloat16)
    wide = pool.float()
    tables = [torch.randperm(64, generator=gen)[: -(-(c + 1) // block_size)].tolist() for c in context]
    meta = build_metadata(context, [1] * len(context), tables, block_size, "cpu")
    q = torch.randn(len(context), num_heads, head_dim, generator=gen)
    args = (meta.decodes.block_ids, meta.decodes.context_lens)
    assert native.supports_decode(q, pool[:, 1])
    got, want = native.decode_attention(q, pool[:, 1], *args), native.decode_attention(q, wide[:, 1], *args)
    if head_dim in (64, 128) and native.has_prefill:  # the AVX-512 build's unrolled sizes
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if head_dim % native.pf_keys == 0 and native.has_prefill:
        q = torch.randn(70, num_heads, head_dim, generator=gen)
        (seg,) = build_metadata([37], [70], [tables[-1][:7]], block_size, "cpu").prefills
        assert native.supports_prefill(q, pool[:, 0])
        got = native.prefill_attention(q, pool[:, 0], seg.block_ids, 37, bf16_products=False)
        assert torch.equal(got, native.prefill_attention(q, wide[:, 0], seg.block_ids, 37))


@pytest.mark.parametrize(
    "block_size, num_kv, group, head_dim, cached, q_len",
    [
        (16, 3, 3, 64, 0, 512),  # SmolLM2, a whole prompt
        (16, 3, 3, 64, 37, 70),  # chunks of odd length (keys 32-36, 37-47): a key paired with zero
        (64, 8, 5, 128, 100, 9),  # Qwen2.5-32B's groups
        (4, 2, 1, 40, 5, 50),  # a head of 40: the values' last 8 elements a masked group
    ],
)
def test_prefill_over_a_bfloat16_pool_on_bf16_products(block_size, num_kv, group, head_dim, cached, q_len):
    """Over a bfloat16 pool the prefill kernel multiplies in bfloat16 (vdpbf16ps): its output is
    causal attention over the pool's keys and values with the queries rounded to bfloat16, to the
    rounding of the softmax's probabilities (float64 reference)."""
    native = cpu_kernels.kernels()
    if not native.prefill_bf16:
        pytest.skip("no AVX512-BF16 here: a bfloat16 pool's prefill runs in float32")
    gen = torch.Generator().manual_seed(q_len + head_dim)
    num_heads, total = num_kv * group, cached + q_len
    table = torch.randperm(64, generator=gen)[: -(-total // block_size)].tolist()
    layer = torch.randn(64, 2, 2, block_size, num_kv, head_dim, generator=gen).to(torch.bfloat16)[:, 1]
    meta = build_metadata([cached], [q_len], [table], block_size, "cpu")
    qkv = torch.randn(q_len, num_heads + 2 * num_kv, head_dim, generator=gen)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv], qkv[:, num_heads + num_kv :]
    write_kv(layer, k, v, meta)
    (seg,) = meta.prefills
    got = native.prefill_attention(q, layer, seg.block_ids, cached)
    keys, values = (layer[seg.block_ids, side].flatten(0, 1)[:total].double() for side in (0, 1))  # [total, KV, D]
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.bfloat16).double(), keys.repeat_interleave(group, 1))
    late = torch.arange(total)[None, :] > cached + torch.arange(q_len)[:, None]
    probs = (scores * head_dim**-0.5).masked_fill(late, -torch.inf).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(group, 1))
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
    exact = native.prefill_attention(q, layer, seg.block_ids, cached, bf16_products=False)
    assert not torch.equal(got, exact)  # the products did run in bfloat16
