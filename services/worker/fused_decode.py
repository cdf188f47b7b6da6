"""A decode step through the whole model in one native call (csrc/decode_step.c).

At batch 1 a layer's kernels take tens of microseconds and the trips to them from Python (a
ctypes call, an output tensor and a module dispatch for each of ten ops) about as long again;
after a step has streamed the weights through the caches, each small torch op around the
layers (the embedding, the rotary angles, the final norm) costs 25-50 us more, and building the
step's metadata and tensors ~0.5 ms. `FusedDecode.run` takes the step's rows as the runner's
lists, puts its integers in one array, and hands the embedding, every layer, the final norm and
the head to one C function that calls the same kernels in the same order with the same arguments
as the model's forward, so the logits and the pool come out the same to the bit
(tests/worker/test_fused_decode.py); the logits land in a buffer kept across steps, and the
greedy tokens are picked in the same call.

It applies on the CPU with the native kernels built, a float32 embedding and residual stream, a
float32 or bfloat16 KV pool, no tensor parallelism, and every matmul, the head's included, one
the kernels run for that many rows (quantized, bf16, float32 panels or AMX tiles); elsewhere
`LlamaModel.decode` runs the model op by op. The arguments cross as one `Step`, the mirror of
csrc/kernels.h's `struct decode_step`.
"""

from __future__ import annotations

import array
import collections
import ctypes
import itertools
import statistics
import time
import weakref

import torch

from services.worker import cpu_kernels
from services.worker.attention import padded_tables, slot_mapping

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class LinearArgs(ctypes.Structure):
    """csrc/kernels.h: struct linear."""

    _fields_ = [("kernel", _ptr), ("flags", _i64), ("weight", _ptr), ("bias", _ptr)]


GATED, TEAM = 1, 2  # csrc/kernels.h: LINEAR_GATED, LINEAR_TEAM


class LayerArgs(ctypes.Structure):
    """csrc/kernels.h: struct decode_layer."""

    _fields_ = [("in_norm", _ptr), ("post_norm", _ptr)] + [(m, LinearArgs) for m in ("qkv", "o", "gate_up", "down")]


class Step(ctypes.Structure):
    """csrc/kernels.h: struct decode_step (shapes there)."""

    _fields_ = [
        ("layers", ctypes.POINTER(LayerArgs)),
        *[(f, _i64) for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate")],
        ("embed", _ptr), ("embed_rows", _i64), ("inv_freq", _ptr), ("final_norm", _ptr),
        ("head", LinearArgs), ("vocab", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("kv", _ptr),
        *[(f, _i64) for f in ("kv_bf16", "num_blocks", "block_size", "layer_stride", "block_stride", "side_stride")],
        *[(f, _i64) for f in ("num_rows", "num_samples", "max_blocks")],
        *[(f, _ptr) for f in ("token_ids", "positions", "sample_rows", "slot_blocks", "slot_offsets")],
        ("block_ids", _ptr), ("ctx_lens", _ptr), ("logits", _ptr), ("picked", _ptr),
        ("span_threads", _i64), ("threads", _i64),
    ]  # fmt: skip


class FusedDecode:
    """A model's decode steps over one KV pool: what the two fix for every step, checked once
    (after a step has streamed the weights through the caches, each check in Python costs a few
    cold microseconds), and the step's call."""

    def __init__(self, model, native, kv_pool: torch.Tensor):
        cfg, first = model.cfg, model.layers[0]
        self.model = model  # not the pool: for_pool keeps a step per live pool (a weak reference)
        self._entry = native.lib.decode_step_f32
        self._entry.restype, self._entry.argtypes = ctypes.c_int, [ctypes.POINTER(Step)]
        num_blocks, _, _, block_size, _, _ = kv_pool.shape
        self.step = Step(
            num_layers=len(model.layers), hidden=cfg.hidden_size, num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, intermediate=cfg.intermediate_size,
            embed=model.embed.data_ptr(), embed_rows=model.embed.shape[0],
            inv_freq=model._rope_inv_freq(torch.device("cpu")).data_ptr(), final_norm=model.norm.data_ptr(),
            vocab=model.lm_head.out_features, eps=first.eps, scale=first.head_dim**-0.5,
            kv=kv_pool.data_ptr(), kv_bf16=cpu_kernels.is_bf16(kv_pool), num_blocks=num_blocks, block_size=block_size,
            layer_stride=kv_pool.stride(1), block_stride=kv_pool.stride(0), side_stride=kv_pool.stride(2),
        )  # fmt: skip
        self.batch_invariant = first.batch_invariant
        self._layers: dict[int, ctypes.Array | None] = {}  # rows -> every layer's LayerArgs
        self._heads: dict[int, LinearArgs | None] = {}  # sampled rows -> the head's matmul
        self._logits = torch.empty(0, 0)
        self._views: dict[int, torch.Tensor] = {}  # rows -> the buffer's first rows (a slice is a torch op)

    def run(
        self, token_ids: list[int], positions: list[int], tables: list[list[int]], sample_rows: list[int], pick: bool
    ) -> tuple[torch.Tensor, list[int] | None] | None:
        """A step of single-token rows: row i is token_ids[i] at positions[i] of a request whose
        block table is tables[i]. Returns (the logits of `sample_rows` [S, vocab], a view of a
        buffer that the next step overwrites; where `pick`, each of those rows' argmax, else None),
        or None (nothing touched) where a matmul would run in torch. A table too short for its
        position raises ValueError, an index outside the pool or the vocabulary IndexError."""
        num_rows, num_samples, size = len(token_ids), len(sample_rows), self.step.block_size
        layers, head = self._layer_args(num_rows), self._head_args(num_samples)
        if layers is None or head is None:
            return None
        contexts = [p + 1 for p in positions]  # keys per row, the new one included
        slot_blocks, slot_offsets = slot_mapping(positions, [1] * num_rows, tables, size)
        rows = padded_tables(contexts, tables, size)
        width = len(rows[0])
        words = array.array("q", token_ids)
        for part in (positions, sample_rows, slot_blocks, slot_offsets, itertools.chain(*rows), contexts):
            words.extend(part)
        base = words.buffer_info()[0]
        logits = self._buffer(num_samples)
        picked = (_i64 * num_samples)() if pick else None
        s = self.step
        s.layers, s.head, s.num_rows, s.num_samples, s.max_blocks = layers, head, num_rows, num_samples, width
        # token_ids, positions, sample_rows, slot blocks and offsets, the tables [rows, width], contexts
        slots = base + 8 * (2 * num_rows + num_samples)
        s.token_ids, s.positions, s.sample_rows = base, base + 8 * num_rows, base + 16 * num_rows
        s.slot_blocks, s.slot_offsets, s.block_ids = slots, slots + 8 * num_rows, slots + 16 * num_rows
        s.ctx_lens = slots + 8 * (2 + width) * num_rows
        s.logits, s.picked = logits.data_ptr(), ctypes.addressof(picked) if pick else None
        torch_threads = torch.get_num_threads()
        s.span_threads = 0 if self.batch_invariant else torch_threads  # as the forward's (0: fixed spans)
        chooser = self.model.__dict__.setdefault("_decode_threads", ThreadChoice())
        s.threads = chooser.pick(num_rows, torch_threads)
        start = time.perf_counter()
        status = self._entry(s)
        chooser.record(num_rows, s.threads, time.perf_counter() - start)
        if status == -2:
            raise IndexError(f"a token id, position, block id or sample row out of range in a {num_rows}-row step")
        if status:
            raise MemoryError(f"no memory for the scratch of a {num_rows}-row decode step")
        return logits, list(picked) if pick else None

    def _layer_args(self, num_rows: int):
        """Every layer's norms and matmuls for `num_rows` rows (the weights never move); None where
        a matmul would run in torch."""
        if num_rows not in self._layers:
            args = []
            for layer in self.model.layers:
                mms = [m.native(num_rows) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
                if any(m is None for m in mms):
                    break
                norms = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
                args.append(LayerArgs(*norms, *(LinearArgs(*m) for m in mms)))
            self._layers[num_rows] = (LayerArgs * len(args))(*args) if len(args) == len(self.model.layers) else None
        return self._layers[num_rows]

    def _head_args(self, num_samples: int) -> LinearArgs | None:
        if num_samples not in self._heads:
            head = self.model.lm_head.native(num_samples)
            self._heads[num_samples] = head and LinearArgs(*head)
        return self._heads[num_samples]

    def _buffer(self, rows: int) -> torch.Tensor:
        view = self._views.get(rows)
        if view is None:
            if rows > self._logits.shape[0]:
                self._logits, self._views = torch.empty(rows, self.model.lm_head.out_features), {}
            view = self._views[rows] = self._logits[:rows]
        return view


def for_pool(model, kv_pool: torch.Tensor) -> FusedDecode | None:
    """The model's fused steps over `kv_pool` (cached for the last pool seen); None where the
    fused call never applies to them."""
    cached = model.__dict__.get("_fused")
    if cached is None or cached[0]() is not kv_pool:
        native = cpu_kernels.kernels() if kv_pool.device.type == "cpu" else None
        fused = native and _qualifies(model, native, kv_pool) and FusedDecode(model, native, kv_pool) or None
        cached = model._fused = (weakref.ref(kv_pool), fused)
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
    norms = [n for layer in model.layers for n in (layer.input_norm, layer.post_norm)]
    floats = (model.embed, model.norm, model._rope_inv_freq(kv_pool.device), *norms)
    return (
        kv_pool.stride()[3:] == (num_kv * head_dim, head_dim, 1)
        and num_kv == first.num_kv_heads
        and head_dim == first.head_dim
        and first.num_heads <= native.max_heads
        and head_dim <= native.max_head_dim
        and all(native.applies(t) and t.is_contiguous() for t in floats)
    )
