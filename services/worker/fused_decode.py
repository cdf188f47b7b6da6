"""A decode step through the whole model in one native call (csrc/decode_step.c).

At batch 1 a layer's kernels take tens of microseconds and the trips to them from Python (a
ctypes call, an output tensor and a module dispatch for each of ten ops) about as long again;
after a step has streamed the weights through the caches, each small torch op around the
layers (the embedding, the rotary angles, the final norm) costs 25-50 us more. `run` hands the
embedding, every layer, the final norm and the head to one C function that calls the same
kernels in the same order with the same arguments as the model's forward, so the logits and
the pool come out the same to the bit (tests/worker/test_fused_decode.py).

It applies on the CPU with the native kernels built, a float32 embedding and residual stream, a
float32 or bfloat16 KV pool, no tensor parallelism, a step whose rows are all decodes, and every
matmul, the head's included, one the kernels run for that many rows (quantized, bf16, float32
panels or AMX tiles); elsewhere `run` returns None and the model runs op by op.
"""

from __future__ import annotations

import array
import collections
import ctypes
import statistics
import time
import weakref

import torch

from services.worker import cpu_kernels

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
LAYER_WORDS = 18  # csrc/decode_step.c: in_norm, post_norm, then 4 words per matmul (qkv, o, gate_up, down)


def run(model, token_ids: torch.Tensor, positions: torch.Tensor, meta, kv_pool: torch.Tensor, sample_rows: torch.Tensor):
    """The model's forward for a step of decodes: logits [S, vocab] float32 of `sample_rows`,
    this step's K/V written into kv_pool; None (nothing touched) where the fused call does not
    apply. A token id out of the embedding's range raises IndexError, as the forward's lookup does."""
    plan = _plan(model, kv_pool)
    num_rows, num_samples, batch = token_ids.shape[0], sample_rows.shape[0], meta.decodes
    if plan is None or meta.prefills or meta.num_decodes != num_rows or batch is None:
        return None
    step = (token_ids, positions, sample_rows, meta.slot_blocks, meta.slot_offsets, batch.block_ids, batch.context_lens)
    if positions.shape != (num_rows,) or not all(t.dtype is torch.long and t.is_cpu and t.is_contiguous() for t in step):
        return None
    logits = torch.empty(num_samples, model.lm_head.out_features)
    inputs = [t.data_ptr() for t in step]
    ok = _launch(plan, model, kv_pool, num_rows, batch.block_ids.shape[1], num_samples, inputs, logits.data_ptr(), None)
    return logits if ok else None


class Decodes:
    """A runner's steps of decodes straight from its own lists (runner.py), the common step.

    `run` above takes tensors and AttentionMetadata, as the model's forward does. After a step has
    streamed the weights through the caches each torch op is cold, ~10-60 us (an empty tensor, a
    context manager, a module call): a served one-request gguf step spent ~0.55 ms around its
    ~2.9 ms call, building the metadata, the inputs and the logits and picking the token. Here the
    step's integers go into one array, the logits into a buffer kept across steps, and the greedy
    tokens are picked in the same native call: the same call on the same values, so the same
    logits and tokens to the bit (tests/worker/test_fused_decode.py)."""

    def __init__(self, model, kv_pool: torch.Tensor, block_size: int):
        self.model, self.kv_pool, self.block_size = model, kv_pool, block_size
        self._logits = torch.empty(0, 0)
        self._views: dict[int, torch.Tensor] = {}  # rows -> the buffer's first rows (a slice is a torch op)

    def run(
        self, token_ids: list[int], positions: list[int], tables: list[list[int]], sample_rows: list[int], pick: bool
    ) -> tuple[torch.Tensor, list[int] | None] | None:
        """A step of single-token rows: row i is token_ids[i] at positions[i] of a request whose
        block table is tables[i]. Returns (the logits of `sample_rows` [S, vocab], a view of a
        buffer that the next step overwrites; where `pick`, each of those rows' argmax, else None),
        or None (nothing touched) where the fused call does not apply."""
        plan = _plan(self.model, self.kv_pool)
        if plan is None:
            return None
        num_rows, num_samples, size = len(token_ids), len(sample_rows), self.block_size
        contexts = [p + 1 for p in positions]  # keys per row, the new one included
        used = [-(-c // size) for c in contexts]  # blocks per row
        for table, c, u in zip(tables, contexts, used):
            if len(table) < u:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {c} tokens")
        width = max(used)
        words = array.array("q", token_ids)
        words.extend(positions)
        words.extend(sample_rows)
        words.extend([t[p // size] for t, p in zip(tables, positions)])  # the slots' blocks and offsets
        words.extend([p % size for p in positions])
        for table, u in zip(tables, used):  # the tables, each padded to the widest with its first block
            words.extend(table[:u])
            words.extend(table[:1] * (width - u))
        words.extend(contexts)
        base = words.buffer_info()[0]
        # token_ids, positions, sample_rows, slot blocks, slot offsets, the tables, contexts: as `run`
        starts = (0, num_rows, 2 * num_rows, 2 * num_rows + num_samples, 3 * num_rows + num_samples)
        starts += (4 * num_rows + num_samples, (4 + width) * num_rows + num_samples)
        inputs = [base + 8 * i for i in starts]
        logits = self._buffer(num_samples)
        picked = (_i64 * num_samples)() if pick else None
        if not _launch(plan, self.model, self.kv_pool, num_rows, width, num_samples, inputs, logits.data_ptr(), picked):
            return None
        return logits, list(picked) if pick else None

    def _buffer(self, rows: int) -> torch.Tensor:
        view = self._views.get(rows)
        if view is None:
            if rows > self._logits.shape[0]:
                self._logits, self._views = torch.empty(rows, self.model.lm_head.out_features), {}
            view = self._views[rows] = self._logits[:rows]
        return view


def _launch(plan, model, kv_pool, num_rows, width, num_samples, inputs, logits, picked) -> bool:
    """csrc/decode_step.c's call: `inputs` the addresses of token_ids, positions, sample_rows, the
    slot blocks and offsets, the block tables [rows, width] and the contexts, all int64; False
    (nothing touched) where a matmul would run in torch."""
    layers, ends = _descriptors(model, num_rows), _ends(model, num_samples)
    if layers is None or ends is None:
        return False
    plan.dims[0], plan.dims[10] = num_rows, width
    torch_threads = torch.get_num_threads()
    span_threads = 0 if plan.batch_invariant else torch_threads  # as the forward's (0: fixed spans)
    chooser = model.__dict__.setdefault("_decode_threads", ThreadChoice())
    threads = chooser.pick(num_rows, torch_threads)
    token_ids, positions, sample_rows, slot_blocks, slot_offsets, tables, contexts = inputs
    start = time.perf_counter()
    status = plan.entry(
        layers, plan.num_layers, plan.dims, ends, token_ids, positions, sample_rows, num_samples, logits, picked,
        kv_pool.data_ptr(), slot_blocks, slot_offsets, tables, contexts, plan.eps, plan.scale, span_threads, threads,
    )  # fmt: skip
    chooser.record(num_rows, threads, time.perf_counter() - start)
    if status == -2:
        raise IndexError(f"a token id or sample row out of range in a {num_rows}-row decode step")
    if status:
        raise MemoryError(f"no memory for the scratch of a {num_rows}-row decode step")
    return True


class _Plan:
    """What a model and a KV pool fix for every step: checked once, not per step (after a step has
    streamed the weights through the caches, each check in Python costs a few cold microseconds)."""

    def __init__(self, model, native, kv_pool: torch.Tensor):
        cfg, first = model.cfg, model.layers[0]
        self.entry = _entry(native)
        self.num_layers = len(model.layers)
        # csrc/decode_step.c's dims; [0] (rows) and [10] (table width) are each step's
        self.dims = (_i64 * 12)(
            0, cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim, cfg.intermediate_size,
            kv_pool.shape[3], kv_pool.stride(1), kv_pool.stride(0), kv_pool.stride(2), 0, cpu_kernels.is_bf16(kv_pool),
        )  # fmt: skip
        self.eps, self.scale, self.batch_invariant = first.eps, first.head_dim**-0.5, first.batch_invariant


def _plan(model, kv_pool: torch.Tensor) -> _Plan | None:
    """The model's plan for steps over `kv_pool` (cached for the last pool seen); None where the
    fused call never applies to them."""
    cached = model.__dict__.get("_fused_plan")
    if cached is None or cached[0]() is not kv_pool:
        native = cpu_kernels.kernels() if kv_pool.device.type == "cpu" else None
        plan = _Plan(model, native, kv_pool) if native is not None and _qualifies(model, native, kv_pool) else None
        cached = model._fused_plan = (weakref.ref(kv_pool), plan)
    return cached[1]


class ThreadChoice:
    """How many threads run a decode step of a few rows: torch's count, or one.

    A one-row step streams the weights once (memory-bound: with the two cores sharing a cache one
    reads nearly as fast as two) and meets six times a layer. Where the cores are shared (the
    gateway, the scheduler and the client run beside the step; other work on the host), a barrier
    waits for a thread that lost its core, and two threads take longer than one. Which is faster
    depends on the moment, so both are timed: each step of up to `MAX_ROWS` rows runs on the count
    with the lower median over its last `WINDOW` steps of that many rows, and now and then on the
    other: `EXPLORE_EVERY` steps after the choice, then twice as far apart after each try that was
    slower than the chosen count's median, up to `EXPLORE_MAX`; a try that was faster brings them
    back to every `EXPLORE_EVERY`-th. With the cores apart a one-row gguf step takes ~4.4 ms on one
    thread against ~2.9 on two: a try every 10th step cost 5% of the mean. The medians are taken
    at the tries only: after a step has streamed the weights, taking them cost ~25 us of a 3.5 ms
    step. The result is the same on either count (the attention's spans are cut for torch's
    count), so the choice changes only the time. `fixed` pins a count instead.
    """

    MAX_ROWS = 4
    WINDOW = 15
    EXPLORE_EVERY = 10
    EXPLORE_MAX = 160

    def __init__(self, fixed: int | None = None):
        self.fixed = fixed
        self._times: dict[tuple[int, int], collections.deque] = {}
        # per (rows, torch's count): the count to run, the steps from one try of the other to the
        # next, and the step of the next try
        self._best: dict[tuple[int, int], int] = {}
        self._gap: dict[tuple[int, int], int] = {}
        self._next: dict[tuple[int, int], int] = {}
        self._trying: tuple[tuple[int, int], float] | None = None  # a try's key and the chosen count's median
        self._steps = 0

    def pick(self, num_rows: int, threads: int) -> int:
        if self.fixed is not None:
            return min(self.fixed, threads)
        if threads == 1 or num_rows > self.MAX_ROWS:
            return threads
        self._steps += 1
        key = (num_rows, threads)
        best = self._best.get(key)
        if best is not None and self._steps < self._next[key]:
            return best
        times = {n: self._times.get((num_rows, n), ()) for n in (1, threads)}
        unmeasured = [n for n, t in times.items() if len(t) < 3]
        if unmeasured:
            return unmeasured[0]
        medians = {n: statistics.median(t) for n, t in times.items()}
        self._best[key] = min(medians, key=medians.__getitem__)
        if best is None:  # the first choice: the first try EXPLORE_EVERY steps on
            self._gap[key] = self.EXPLORE_EVERY
            self._next[key] = self._steps + self.EXPLORE_EVERY
            return self._best[key]
        self._trying = (key, medians[self._best[key]])
        return threads if self._best[key] == 1 else 1

    def record(self, num_rows: int, threads: int, seconds: float) -> None:
        if num_rows > self.MAX_ROWS:
            return
        self._times.setdefault((num_rows, threads), collections.deque(maxlen=self.WINDOW)).append(seconds)
        if self._trying is not None:
            key, chosen = self._trying
            self._trying = None
            self._gap[key] = self.EXPLORE_EVERY if seconds < chosen else min(2 * self._gap[key], self.EXPLORE_MAX)
            self._next[key] = self._steps + self._gap[key]


def _qualifies(model, native, kv_pool: torch.Tensor) -> bool:
    first = model.layers[0]
    if first.all_reduce is not None or model.lm_head is None or not native.applies_kv(kv_pool) or kv_pool.dim() != 6:
        return False
    _, _, _, block_size, num_kv, head_dim = kv_pool.shape
    floats = (model.embed, model.norm, model._rope_inv_freq(kv_pool.device))
    return (
        kv_pool.stride()[3:] == (num_kv * head_dim, head_dim, 1)
        and num_kv == first.num_kv_heads
        and head_dim == first.head_dim
        and first.num_heads <= native.max_heads
        and head_dim <= native.max_head_dim
        and all(native.applies(t) and t.is_contiguous() for t in floats)
    )


def _descriptors(model, num_rows: int):
    """Every layer's norms and matmuls as csrc/decode_step.c reads them, for `num_rows` rows (cached
    on the model per row count; the weights never move); None where a matmul would run in torch."""
    cache = model.__dict__.setdefault("_fused_layers", {})
    if num_rows not in cache:
        words = []
        for layer in model.layers:
            mms = [m.native(num_rows) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            norms = (layer.input_norm, layer.post_norm)
            if any(m is None for m in mms) or not all(n.dtype == torch.float32 and n.is_contiguous() for n in norms):
                cache[num_rows] = None
                break
            words += [norms[0].data_ptr(), norms[1].data_ptr()] + [w for m in mms for w in m]
        else:
            cache[num_rows] = (_i64 * len(words))(*words)
    return cache[num_rows]


def _ends(model, num_samples: int):
    """The words around the layers (csrc/decode_step.c's `ends`) for a head of `num_samples` rows
    (cached per count); None where the head's matmul would run in torch."""
    cache = model.__dict__.setdefault("_fused_ends", {})
    if num_samples not in cache:
        head = model.lm_head.native(num_samples)
        inv_freq = model._rope_inv_freq(torch.device("cpu"))
        cache[num_samples] = head and (_i64 * 9)(
            model.embed.data_ptr(), model.embed.shape[0], inv_freq.data_ptr(), model.norm.data_ptr(),
            model.lm_head.out_features, *head,
        )  # fmt: skip
    return cache[num_samples]


def _entry(native):
    fn = native.lib.decode_step_f32
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64] + [_ptr] * 7
        fn.argtypes += [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return fn
