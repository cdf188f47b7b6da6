"""KV pools and the transfer engine: layout, sizing, each mode's copies, the ordering rules.

The random-plan and stress tests live in test_transfer_sim.py; helpers here are shared.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from services.worker import kv_pool
from services.worker.kv_pool import MODEL_KV_SPECS, KVPools, KVSpec, num_dram_blocks, num_hbm_blocks
from services.worker.transfer import MODES, BlockConflict, FutureDone, Transfer, TransferEngine, dependencies
from services.worker.transfer_cuda import MemcpyBatch, cudart_candidates

NO_CUDA = "no CUDA device here: the CUDA backend runs in bench/gpu_check.sh on a GPU machine"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[cuda_only, pytest.mark.gpu])]
# (mode, copy_impl) pairs each device runs; the CUDA-only copy implementations skip on CPU.
ENGINES = [(m, "auto") for m in MODES] + [("duplex", "per_block"), ("duplex", "cupy"), ("batched", "memcpy_batch")]

# 2 layers × K/V × 4 tokens × 2 heads × 4 dims × fp16 = 256 bytes a block.
SMALL = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float16)
# 1 × 2 × 1 × 1 × 1 × fp16 = 4 bytes: not a multiple of 16, so no wide-row view.
ODD = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype=torch.float16)


# ---------------------------------------------------------------- helpers (shared)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs included): KV is compared bit for bit, never by value."""
    assert dtype.itemsize == 2
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int16)


def make_pools(spec: KVSpec, num_hbm: int, num_dram: int, device: str, seed: int = 0) -> KVPools:
    """Pools full of random bits, so a copy that never happened cannot pass for one."""
    pools = KVPools(spec, num_hbm, num_dram, device)
    gen = torch.Generator().manual_seed(seed)
    pools.hbm.copy_(random_bits(tuple(pools.hbm.shape), spec.dtype, gen))
    pools.dram.copy_(random_bits(tuple(pools.dram.shape), spec.dtype, gen))
    if pools.is_cuda:
        torch.cuda.synchronize()
    return pools


def make_engine(pools: KVPools, mode: str, copy_impl: str) -> TransferEngine:
    """The engine, or a skip where this device or runtime lacks the copy implementation."""
    if not pools.is_cuda and copy_impl != "auto":
        pytest.skip(f"{copy_impl} is a CUDA copy implementation")
    if copy_impl == "cupy":
        pytest.importorskip("cupy")
    try:
        return TransferEngine(pools, mode, copy_impl)
    except RuntimeError as e:  # e.g. a CUDA runtime older than 12.8 for memcpy_batch
        pytest.skip(str(e))


def expect_copies(before_src: torch.Tensor, after_dst: torch.Tensor, pairs) -> None:
    for s, d in pairs:
        assert torch.equal(bits(after_dst[d]), bits(before_src[s])), f"block {s} -> {d}"


# ---------------------------------------------------------------- the pools


def test_block_first_layout_one_block_is_one_region():
    pools = KVPools(SMALL, 3, 2, "cpu")
    block = pools.hbm[1]
    assert block.is_contiguous()
    assert pools.hbm[2].data_ptr() - pools.hbm[1].data_ptr() == SMALL.block_bytes
    k, v = pools.layer_kv(1)  # [num_blocks, block_size, heads, dim]
    assert k.shape == (3, SMALL.block_size, SMALL.num_kv_heads, SMALL.head_dim)
    k[2].fill_(1.5)
    v[2].fill_(-2.0)
    assert (pools.hbm[2, 1, 0] == 1.5).all() and (pools.hbm[2, 1, 1] == -2.0).all()
    assert pools.dram.shape == (2, *SMALL.block_shape) and not pools.dram.is_pinned()


def test_model_block_shapes_and_sizes():
    assert MODEL_KV_SPECS["smollm2"].block_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert MODEL_KV_SPECS["llama3-8b"].block_bytes == 2 << 20
    assert MODEL_KV_SPECS["qwen2.5-32b"].block_bytes == 4 << 20
    assert MODEL_KV_SPECS["llama3-8b"].segment_bytes == 16 * 8 * 128 * 2


def test_spec_from_model_config():
    modelfile = pytest.importorskip("shared.modelfile")
    cfg = modelfile.ModelConfig(
        name="SmolLM2-135M-Instruct", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5,
        max_position=8192, tie_embeddings=True,
    )  # fmt: skip
    assert KVSpec.from_model(cfg) == MODEL_KV_SPECS["smollm2"]
    assert KVSpec.from_model(cfg, 32, torch.float32).block_bytes == 4 * MODEL_KV_SPECS["smollm2"].block_bytes


def test_sizing_from_flags():
    spec = MODEL_KV_SPECS["llama3-8b"]  # 2 MiB blocks
    assert num_dram_blocks(spec, 1.0) == 512
    assert num_dram_blocks(spec, 0.001) == 0
    assert num_hbm_blocks(spec, "cpu", hbm_blocks=7) == 7
    ram = kv_pool.available_ram_bytes()
    assert num_hbm_blocks(spec, "cpu", memory_fraction=0.01) == int(0.01 * ram) // spec.block_bytes > 0


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("copy_impl", ["auto", "per_block", "memcpy_batch", "cupy"])
def test_large_dram_pool_is_registered_with_the_cuda_runtime(monkeypatch, copy_impl):
    """Registered (not allocated-pinned) host memory: the cupy kernel reaches it through
    its mapped device address, the copy engines through its host address."""
    monkeypatch.setattr(kv_pool, "PIN_DIRECT_MAX_BYTES", 1024)
    pools = make_pools(SMALL, 8, 16, "cuda")  # 4 KiB of DRAM: over the patched limit
    assert pools._registered and pools.dram.is_pinned()
    engine = make_engine(pools, "duplex", copy_impl)
    before_dram, before_hbm = pools.dram.clone(), pools.hbm.clone()
    t = engine.submit(swap_in=[(3, 0), (9, 5)], swap_out=[(1, 2), (4, 12)])
    t.wait()
    expect_copies(before_dram, pools.hbm, [(3, 0), (9, 5)])
    expect_copies(before_hbm, pools.dram, [(1, 2), (4, 12)])
    engine.close()
    pools.close()


def test_every_cuda_runtime_candidate_is_tried():
    """A library without cudaMemcpyBatchAsync (or missing) does not end the search."""
    assert MemcpyBatch.load(["libc.so.6", "libsuperinfer-missing.so"]) is None
    names = cudart_candidates()
    assert len(names) == len(set(names)) and names[-3:] == ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]


# ---------------------------------------------------------------- each mode's copies


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,copy_impl", ENGINES)
@pytest.mark.parametrize("spec", [SMALL, ODD], ids=["small", "odd"])
def test_one_step_copies_every_pattern(device, mode, copy_impl, spec):
    """Scattered ids, a run of destinations, a run of sources: each batched code path."""
    if spec is ODD and copy_impl == "cupy":
        pytest.skip("the CuPy copy needs blocks in 16-byte multiples")
    pools = make_pools(spec, 16, 24, device)
    engine = make_engine(pools, mode, copy_impl)
    plans = [
        ([(20, 3), (2, 11), (7, 0)], [(5, 1), (9, 17)], [(12, 4)]),  # scattered both sides
        ([(1, 6), (8, 7), (0, 8)], [(13, 10), (14, 11)], []),  # destinations in a run
        ([(10, 2), (11, 12), (12, 9)], [(5, 20), (6, 0), (15, 3)], [(4, 23)]),  # sources in a run
    ]
    for swap_in, swap_out, eager in plans:
        hbm, dram = pools.hbm.clone(), pools.dram.clone()
        engine.submit(swap_in, swap_out, eager).wait()
        expect_copies(dram, pools.hbm, swap_in)
        expect_copies(hbm, pools.dram, swap_out + eager)
        untouched = set(range(16)) - {d for _, d in swap_in}
        expect_copies(hbm, pools.hbm, [(b, b) for b in untouched])
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_out_copy_into_a_dram_block_this_step_swaps_in_waits_for_it(device, mode):
    """A DRAM block read by a swap-in and written by a swap-out of the same step: the
    swap-in reads the old contents."""
    pools = make_pools(SMALL, 64, 64, device)
    engine = TransferEngine(pools, mode)
    for trial in range(20):
        hbm, dram = pools.hbm.clone(), pools.dram.clone()
        swap_in = [(d, d) for d in range(32)]  # DRAM 0..31 -> HBM 0..31
        swap_out = [(32 + d, d) for d in range(32)]  # HBM 32..63 -> DRAM 0..31
        engine.submit(swap_in, swap_out).wait()
        expect_copies(dram, pools.hbm, swap_in)
        expect_copies(hbm, pools.dram, swap_out)
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_submit_is_done_at_once(device):
    engine = TransferEngine(make_pools(SMALL, 4, 4, device))
    t = engine.submit()
    assert t.done() and t.in_event is None and engine.num_in_flight() == 0
    t.wait_in()
    t.fence_in()
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_a_pool_with_no_blocks_is_fine(device, mode):
    """--dram-gb 0: no rotation at all, but the engine still starts and runs empty steps."""
    pools = make_pools(SMALL, 4, 0, device)
    engine = TransferEngine(pools, mode)
    engine.submit().wait()
    with pytest.raises(ValueError, match="out of range"):
        engine.submit(swap_out=[(0, 0)])
    engine.close()
    pools.close()


def test_bad_plans_are_refused():
    engine = TransferEngine(make_pools(SMALL, 4, 8, "cpu"))
    with pytest.raises(ValueError, match="out of range"):
        engine.submit(swap_in=[(8, 0)])
    with pytest.raises(ValueError, match="out of range"):
        engine.submit(swap_out=[(0, -1)])
    with pytest.raises(ValueError, match="two copies"):
        engine.submit(swap_out=[(0, 5)], eager=[(1, 5)])
    with pytest.raises(BlockConflict):
        engine.submit(swap_in=[(0, 2)], swap_out=[(2, 3)])
    with pytest.raises(ValueError, match="unknown transfer mode"):
        TransferEngine(engine.pools, "fast")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TransferEngine(engine.pools, "duplex", "cupy")
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(swap_in=[(0, 0)])


# ---------------------------------------------------------------- ordering rules


def pending_transfer(in_pairs, out_pairs) -> tuple[Transfer, Future, Future]:
    """A transfer whose directions finish only when the test says so."""
    fin, fout = Future(), Future()
    return Transfer(in_pairs, out_pairs, FutureDone(fin), FutureDone(fout)), fin, fout


def test_dependencies_follow_the_hazards():
    live, fin, fout = pending_transfer(in_pairs=[(3, 7)], out_pairs=[(5, 9)])  # in: DRAM3->HBM7; out: HBM5->DRAM9
    with pytest.raises(BlockConflict):  # swap-in into HBM 5 while it is read
        dependencies([(0, 5)], [], [live])
    in_deps, out_deps, after = dependencies([(9, 1)], [], [live])  # reads DRAM 9 being written
    assert in_deps == [live._out] and out_deps == [] and not after
    in_deps, out_deps, _ = dependencies([], [(7, 2)], [live])  # reads HBM 7 being written
    assert out_deps == [live._in]
    _, out_deps, _ = dependencies([], [(1, 3)], [live])  # overwrites DRAM 3 being read
    assert out_deps == [live._in]
    assert dependencies([(4, 1)], [(2, 4)], []) == ([], [], True)  # same step: out after in
    assert dependencies([(1, 1)], [(2, 2)], [live]) == ([], [], False)
    fout.set_result(None)
    fin.set_result(None)
    assert dependencies([(0, 5)], [(7, 3)], [live]) == ([], [], False)  # all finished


@pytest.mark.parametrize("mode", MODES)
def test_duplex_runs_the_directions_at_once_and_the_rest_in_series(mode):
    """The swap-in waits on an unfinished earlier copy into its DRAM source; the out
    direction is free to go in duplex mode only."""
    pools = make_pools(SMALL, 8, 8, "cpu")
    engine = TransferEngine(pools, mode)
    blocker, fin, fout = pending_transfer(in_pairs=[], out_pairs=[(7, 0)])
    fin.set_result(None)
    engine._live.append(blocker)
    t = engine.submit(swap_in=[(0, 1)], swap_out=[(2, 3)])
    if mode == "duplex":
        t.wait_out()  # would hang if the out copy queued behind the blocked swap-in
    assert not t.in_done()
    assert t.out_done() == (mode == "duplex")
    fout.set_result(None)
    t.wait()
    assert t.done()
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_in_flight_swap_out_source_cannot_be_swapped_into(device):
    pools = make_pools(SMALL, 8, 8, device)
    engine = TransferEngine(pools)
    blocker, fin, fout = pending_transfer(in_pairs=[], out_pairs=[(4, 6)])
    fin.set_result(None)
    engine._live.append(blocker)
    with pytest.raises(BlockConflict):
        engine.submit(swap_in=[(1, 4)])
    fout.set_result(None)
    engine.submit(swap_in=[(1, 4)]).wait()
    engine.close()


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("copy_impl", ["auto", "per_block", "cupy"])
def test_cuda_compute_waits_on_the_swap_in_event(copy_impl):
    pools = make_pools(MODEL_KV_SPECS["smollm2"], 64, 64, "cuda")
    engine = make_engine(pools, "duplex", copy_impl)
    assert engine.copy_impl != "auto"
    dram = pools.dram.clone()
    pairs = [(63 - b, b) for b in range(48)]
    t = engine.submit(swap_in=pairs, swap_out=[(60, 1)], eager=[(61, 2)])
    assert isinstance(t.in_event, torch.cuda.Event) and isinstance(t.out_event, torch.cuda.Event)
    t.fence_in()  # the reads below are queued after the swap-ins, host not blocked
    got = pools.hbm[:48].view(torch.int16).sum(dim=(1, 2, 3, 4, 5), dtype=torch.int64)
    want = torch.stack([dram[s].view(torch.int16).sum(dtype=torch.int64) for s, _ in pairs])
    assert torch.equal(got.cpu(), want)
    engine.close()
