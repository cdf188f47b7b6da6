"""The quantized matmul (Q8_0, Q4_0, Q4_1 kept packed, csrc/quant_matmul.c) against a
dequantize-then-matmul reference, on each of its paths (AVX512-VNNI and AVX2 where the CPU has
them, the portable C loop everywhere), the paths against each other, and the bundled GGUF loaded
packed."""

from __future__ import annotations

import functools

import pytest
import torch

from services.worker import cpu_kernels, cpu_quant, model
from services.worker.cpu_quant import QuantWeight
from services.worker.weights import gguf_quantization, load_weights

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C compiler for the native kernels")

# The activations are rounded to int8 per block of 32 (as llama.cpp's quantized dot products do):
# each product is off by up to half a step of 1/127 of its block's largest value, so a sum is
# ~0.5% of the output's scale away from the float reference; an outlier of 40x in a short row
# (3 blocks) takes the largest error to 1.9%.
REL_TOL = 0.025


@functools.cache
def quantized(kind: str, num_out: int, num_in: int) -> tuple[QuantWeight, cpu_quant.PackedQuant]:
    gen = torch.Generator().manual_seed(num_out + num_in)
    weight = QuantWeight.quantize(torch.randn(num_out, num_in, generator=gen) * 0.05, kind)
    return weight, cpu_quant.pack(weight)


@pytest.fixture(params=["vnni", "avx2", "portable", "float"])
def path(request):
    runs = cpu_quant.limit_path("vnni" if request.param == "float" else request.param)
    if request.param == "float" and not cpu_quant.set_float_rows(4):
        pytest.skip("this CPU has no AVX512-VBMI")
    if request.param in ("vnni", "avx2") and runs != request.param:
        cpu_quant.limit_path("vnni")
        pytest.skip(f"this CPU has no {request.param.upper()} path")
    yield request.param
    cpu_quant.limit_path("vnni")
    cpu_quant.set_float_rows(0)


@pytest.mark.parametrize("kind", cpu_quant.FORMATS)
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 8, 9, 16, 33])
@pytest.mark.parametrize(("num_out", "num_in"), [(48, 96), (576, 1536)])
def test_quant_matmul_matches_dequantized_reference(kind, rows, num_out, num_in, path):
    """Every row count a step can have (none, one, a tile of 8, one past it, several tiles, a
    short last tile), with and without a bias, rows read with a stride (a view)."""
    gen = torch.Generator().manual_seed(rows * 7 + num_in)
    weight, packed = quantized(kind, num_out, num_in)
    x = torch.randn(rows, num_in + 32, generator=gen)[:, 16 : 16 + num_in]  # rows further apart
    x[:, 3] *= 40  # an outlier, as the residual stream has: only its own block's scale grows
    bias = torch.randn(num_out, generator=gen)
    reference = x @ weight.dequantize().T
    for b in (None, bias):
        got = cpu_quant.linear(x, packed, b)
        want = reference if b is None else reference + b
        assert got.shape == (rows, num_out) and got.dtype == torch.float32
        if rows and path == "float" and rows <= 4:  # float32 products: the reference's own, reordered
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        elif rows:
            scale = want.abs().max()
            assert (got - want).abs().max() <= REL_TOL * scale
            assert (got - want).abs().mean() <= REL_TOL / 3 * scale  # not one lucky element


def _on(path: str, x: torch.Tensor, packed, bias) -> torch.Tensor:
    """cpu_quant.linear on `path` (or the fastest below it the CPU has)."""
    cpu_quant.limit_path(path)
    try:
        return cpu_quant.linear(x, packed, bias)
    finally:
        cpu_quant.limit_path("vnni")


def _vector_path(path: str):
    if cpu_quant.limit_path(path) != path:
        cpu_quant.limit_path("vnni")
        pytest.skip(f"this CPU has no {path.upper()} path")
    cpu_quant.limit_path("vnni")


@pytest.mark.parametrize("path", ["vnni", "avx2"])
@pytest.mark.parametrize("kind", cpu_quant.FORMATS)
def test_both_paths_compute_the_same_sums(kind, path):
    """The integer sums are exact on every path; only the float scaling's order differs from the
    portable loop's."""
    _vector_path(path)
    gen = torch.Generator().manual_seed(1)
    packed = cpu_quant.pack(QuantWeight.quantize(torch.randn(64, 256, generator=gen), kind))
    x = torch.randn(11, 256, generator=gen)
    torch.testing.assert_close(_on(path, x, packed, None), _on("portable", x, packed, None), rtol=1e-5, atol=1e-4)


def _exact_weight(kind: str, num_out: int, num_in: int, gen: torch.Generator) -> QuantWeight:
    """GGUF blocks of random q (the whole range: Q8_0 from -128) whose scales are powers of two
    from 1/8 to 1 and minimums (Q4_1) multiples of 1/8: every product and sum below is exact."""
    blocks = num_out * num_in // 32
    d = (2.0 ** -torch.randint(0, 4, (blocks, 1), generator=gen)).half().view(torch.uint8)
    q = torch.randint(0, 256, (blocks, 32 if kind == "q8_0" else 16), generator=gen).to(torch.uint8)
    parts = [d, (torch.randint(-64, 65, (blocks, 1), generator=gen) / 8).half().view(torch.uint8)] if kind == "q4_1" else [d]
    raw = torch.cat([*parts, q], dim=1).reshape(num_out, -1)
    return QuantWeight(kind, raw.contiguous(), (num_out, num_in))


@pytest.mark.parametrize("kind", cpu_quant.FORMATS)
@pytest.mark.parametrize(("num_out", "num_in"), [(16, 32), (48, 96), (80, 224), (32, 160)])
def test_vector_paths_give_the_portable_loops_bits(kind, num_out, num_in):
    """Activations that int8 holds as they are (integers, each block's largest 127: a scale of
    exactly 1) and weights of dyadic scales (_exact_weight): every path's result is then the exact
    product, so AVX2, AVX512-VNNI and the portable loop agree to the bit, and with the float64
    reference, iff their integer sums are exact. Odd block counts (K not a multiple of 64: the
    unpaired last block of Q8_0/Q4_0), odd panel counts, 1 to 9 rows (AVX2's tiles of 4, a short
    last tile, VNNI's 8 and one past), a bias."""
    gen = torch.Generator().manual_seed(num_out * 1000 + num_in)
    weight = _exact_weight(kind, num_out, num_in, gen)
    packed = cpu_quant.pack(weight)
    bias = torch.randint(-800, 800, (num_out,), generator=gen) / 8
    paths = [p for p in cpu_quant.QUANT_PATHS if cpu_quant.limit_path(p) == p]
    cpu_quant.limit_path("vnni")
    assert "avx2" in paths or not cpu_quant.quant_fast()  # the vector path of every x86 CPU with AVX2
    for rows in range(1, 10):
        x = torch.randint(-127, 128, (rows, num_in // 32, 32), generator=gen).float()
        at = torch.randint(0, 32, (rows, num_in // 32, 1), generator=gen)
        x.scatter_(2, at, 127.0 * torch.where(torch.rand(at.shape, generator=gen) < 0.5, -1.0, 1.0))
        x = x.reshape(rows, num_in)
        want = (x.double() @ weight.dequantize().double().T + bias.double()).float()
        for b, w in ((None, want - bias), (bias, want)):
            for path in paths:
                assert torch.equal(_on(path, x, packed, b), w), (path, rows, b is None)


@pytest.mark.parametrize("kind", cpu_quant.FORMATS)
def test_avx2_gives_the_vnni_bits(kind):
    """On a CPU with both, any activations: the AVX2 path scales the same integer sums in the
    VNNI path's order, so a model's output does not depend on which one ran."""
    _vector_path("vnni")
    _vector_path("avx2")
    gen = torch.Generator().manual_seed(2)
    packed = cpu_quant.pack(QuantWeight.quantize(torch.randn(80, 352, generator=gen), kind))
    x, bias = torch.randn(13, 352, generator=gen), torch.randn(80, generator=gen)
    for rows in (1, 4, 5, 8, 13):
        assert torch.equal(_on("avx2", x[:rows], packed, bias), _on("vnni", x[:rows], packed, bias))


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_weights_cut_per_thread_give_the_uncut_results(parts, rows, path):
    """Matrices cut per thread (each thread's parts of all of them end to end) multiply to the
    same bits as uncut on any thread count, panel counts that do not divide included."""
    packs = [quantized(kind, n, k)[1] for kind, n, k in (("q4_1", 48, 96), ("q8_0", 80, 64), ("q4_0", 16, 96))]
    cut = cpu_quant.thread_major(packs, parts)
    gen = torch.Generator().manual_seed(rows)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, parts):
            torch.set_num_threads(threads)
            for whole, part in zip(packs, cut):
                x = torch.randn(rows, whole.num_in, generator=gen)
                assert torch.equal(cpu_quant.linear(x, part, None), cpu_quant.linear(x, whole, None))
    finally:
        torch.set_num_threads(before)
    assert [c.nbytes for c in cut] == [p.nbytes for p in packs]
    # Thread t's part of each matrix is followed by its part of the next: a layout line later,
    # and as many panels as the part is short of the others (a count that does not divide).
    run = int(cut[0].data[8:16].view(torch.int64))
    for t in range(parts):
        for a, b in zip(cut, cut[1:]):
            panels, per = a.num_out // 16, -(-(a.num_out // 16) // parts)
            held = max(0, min(per, panels - t * per))
            end = a.data.data_ptr() + cpu_quant.LAYOUT + t * run + held * a.panel_bytes
            begin = b.data.data_ptr() + cpu_quant.LAYOUT + t * run
            assert begin - end == cpu_quant.LAYOUT + (per - held) * a.panel_bytes


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 4, 5, 12, 13, 30])
@pytest.mark.parametrize(("num_out", "num_in"), [(48, 96), (64, 320)])
def test_bf16_matmul_matches_the_rounded_product(rows, num_out, num_in, portable):
    """bfloat16 matrices (csrc/bf16_matmul.c) on AVX512-BF16 and on the portable loop: each row
    rounded to bfloat16 times the bfloat16 weights, products exact in float32, so only the order
    of the sums differs from the reference. An odd number of panels (48 columns: a pair and one
    alone), row counts of one and two accumulation chains, a short last row group, a bias."""
    if not cpu_quant.bf16_fast():
        pytest.skip("this CPU has no AVX512-BF16 (the worker then keeps float32)")
    gen = torch.Generator().manual_seed(rows + num_out)
    weight = QuantWeight.quantize(torch.randn(num_out, num_in, generator=gen), "bf16")
    packed = cpu_quant.pack(weight)
    x = torch.randn(rows, num_in + 32, generator=gen)[:, 16 : 16 + num_in]  # rows further apart
    bias = torch.randn(num_out, generator=gen)
    want = x.bfloat16().double() @ weight.dequantize().double().T + bias.double()
    native = cpu_kernels.kernels().lib
    assert native.bf16_matmul_path(int(portable)) == (not portable)
    try:
        got = cpu_quant.linear(x, packed, bias)
    finally:
        native.bf16_matmul_path(0)
    assert got.shape == (rows, num_out)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_gated_bf16_matmul_is_silu_of_gate_times_up(rows, portable):
    """An MLP's gate and up rows in one bfloat16 matmul that writes silu(gate) * up: what the plain
    matmul and silu_and_mul give, to float32 rounding, the bias paired as the rows are."""
    if not cpu_quant.bf16_fast():
        pytest.skip("this CPU has no AVX512-BF16 (the worker then keeps float32)")
    gen = torch.Generator().manual_seed(rows)
    weight = QuantWeight.quantize(torch.randn(2 * 48, 64, generator=gen), "bf16")  # I = 48: three pairs
    x, bias = torch.randn(rows, 64, generator=gen), torch.randn(2 * 48, generator=gen)
    gated = model.Linear(weight, bias, gated=True)
    assert gated.quant.gated
    native = cpu_kernels.kernels().lib
    assert native.bf16_matmul_path(int(portable)) == (not portable)
    try:
        got = gated(x)
        want = model.silu_and_mul(cpu_quant.linear(x, cpu_quant.pack(weight), bias))
    finally:
        native.bf16_matmul_path(0)
    assert got.shape == (rows, 48)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pack_refuses_what_the_kernel_cannot_take():
    weight = QuantWeight.quantize(torch.randn(40, 64), "q8_0")  # 40 output rows: not whole panels
    assert cpu_quant.pack(weight) is None


@pytest.mark.slow
def test_bundled_gguf_loads_packed_with_the_float_loaders_values(model_path, cfg, weights):
    """Kept packed ("gguf"), every matrix dequantizes to exactly what the float32 loader made
    of it (q/k rows unpermuted alike); the bundled file is Q4_1 with a Q8_0 embedding."""
    assert gguf_quantization(model_path) == "q4_1"
    packed = load_weights(model_path, cfg, "gguf")
    kinds = {name: w.kind for name, w in packed.items() if isinstance(w, QuantWeight)}
    assert kinds["model.embed_tokens.weight"] == "q8_0"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "q4_1"
    assert len(kinds) == 1 + 7 * cfg.num_layers
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight"):  # fmt: skip
        assert torch.equal(packed[name].dequantize(), weights[name]), name
    assert torch.equal(packed["model.norm.weight"], weights["model.norm.weight"])
