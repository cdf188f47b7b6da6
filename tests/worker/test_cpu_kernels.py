"""The native CPU per-row ops against the eager torch ops they replace (same function, the
kernels switched off), on shapes the models meet: one row, a decode batch, a prefill chunk."""

from __future__ import annotations

import shutil

import pytest
import torch

from services.worker import cpu_kernels, kernel_build, model


@pytest.fixture
def torch_path(monkeypatch):
    """Run what follows on the eager torch path."""
    return lambda: monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_add_rms_norm_matches_torch(rows, torch_path):
    gen = torch.Generator().manual_seed(rows)
    x, delta, w = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen), torch.randn(576)
    x_native = x.clone()
    got_plain, got_added = model.add_rms_norm_(x_native.clone(), None, w, 1e-5), model.add_rms_norm_(x_native, delta, w, 1e-5)
    torch_path()
    x_torch = x.clone()
    want_plain, want_added = model.add_rms_norm_(x_torch.clone(), None, w, 1e-5), model.add_rms_norm_(x_torch, delta, w, 1e-5)
    torch.testing.assert_close(x_native, x_torch)  # the residual stream itself
    torch.testing.assert_close(got_plain, want_plain)
    torch.testing.assert_close(got_added, want_added)


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_rope_matches_torch(rows, torch_path):
    """In place on the q and k heads of a [T, (H + 2KV) * D] projection (v untouched)."""
    gen = torch.Generator().manual_seed(rows)
    heads, kv, d = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv) * d, generator=gen)
    angles = torch.randn(rows, d // 2, generator=gen) * 10
    cos, sin = angles.cos(), angles.sin()
    native = qkv.clone()
    model.rope_(native[:, : (heads + kv) * d].view(rows, heads + kv, d), cos, sin)
    torch_path()
    eager = qkv.clone()
    model.rope_(eager[:, : (heads + kv) * d].view(rows, heads + kv, d), cos, sin)
    torch.testing.assert_close(native, eager)
    assert torch.equal(native[:, (heads + kv) * d :], qkv[:, (heads + kv) * d :])


def test_rope_angles_match_torch():
    """The rotary angles of positions up to a long context, on frequencies from 1 to 1e-6 (large
    angles: cosf's range reduction), within an ulp or two of torch's cos and sin."""
    native = cpu_kernels.kernels()
    if native is None:
        pytest.skip("native CPU kernels not built here")
    positions = torch.tensor([0, 1, 7, 511, 4096, 32767, 131071])
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, 64, 2).float() / 64)
    got_cos, got_sin = native.rope_angles(positions, inv_freq)
    want_cos, want_sin = model.rope_cos_sin(positions, inv_freq, torch.float32)
    torch.testing.assert_close(got_cos, want_cos, rtol=0, atol=3e-7)
    torch.testing.assert_close(got_sin, want_sin, rtol=0, atol=3e-7)


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_silu_and_mul_matches_torch(rows, torch_path):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    got = model.silu_and_mul(gate_up.clone())
    torch_path()
    torch.testing.assert_close(got, model.silu_and_mul(gate_up.clone()))


def test_silu_and_mul_vector_lanes_give_the_scalar_bits():
    """Column 16 of a 17-wide row runs on the scalar loop, columns 0-15 on the vector one (8 or 16
    lanes): the same inputs in column 0 and column 16 give the same bits."""
    if cpu_kernels.kernels() is None:
        pytest.skip("native CPU kernels not built here")
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(4096, 17, generator=gen) * 8, torch.randn(4096, 17, generator=gen)
    gate[:, 16], up[:, 16] = gate[:, 0], up[:, 0]
    gate[:8, 0] = torch.tensor([0.0, -0.0, -87.5, 88.0, -200.0, 1e-30, float("inf"), float("-inf")])
    gate[:, 16] = gate[:, 0]
    out = model.silu_and_mul(torch.cat([gate, up], dim=1))
    assert torch.equal(out[:, 16], out[:, 0])


@pytest.mark.parametrize("rows", [0, 1, 5, 12, 13, 25, 64, 100])
@pytest.mark.parametrize(("num_out", "num_in"), [(48, 96), (576, 96), (48, 300)])
def test_panel_matmul_matches_torch(rows, num_out, num_in):
    """Every row count a step can have (none, one row group of up to 12, several, a last group
    shorter), an odd number of 16-column panels, several blocks of k (300 inputs), with and
    without a bias; rows read with a stride (a view)."""
    native = cpu_kernels.kernels()
    weight = torch.randn(num_out, num_in, generator=torch.Generator().manual_seed(rows))
    panels = native.pack_panels(weight) if native is not None else None
    if panels is None:
        pytest.skip("no native matmul kernel on this machine (it needs AVX-512)")
    x = torch.randn(rows, num_in + 32)[:, 16 : 16 + num_in]  # [rows, num_in], rows further apart
    bias = torch.randn(num_out)
    # float32 sums over 300 terms in another order: ~1e-5 apart on values of ~17
    close = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(native.linear(x, panels, None), x @ weight.T, **close)
    torch.testing.assert_close(native.linear(x, panels, bias), torch.addmm(bias, x, weight.T), **close)


@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 33, 64, 100])
@pytest.mark.parametrize(("num_out", "num_in"), [(48, 96), (64, 96), (576, 1536)])
def test_bf16x3_matmul_is_float32_accurate(rows, num_out, num_in):
    """The AMX kernel against float64: within a few parts in a million, as float32 is (a single
    bfloat16 product would be ~1e-3 off). Row counts below, at and across its 16- and 32-row
    tiles, an odd number of 16-column blocks (48), many blocks of 32 inputs (1536), with and
    without a bias, rows read with a stride."""
    native = cpu_kernels.kernels()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(num_out, num_in, generator=gen)
    tiles = native.pack_bf16x3(weight) if native is not None else None
    if tiles is None:
        pytest.skip("no AMX matmul kernel on this machine")
    x = torch.randn(rows, num_in + 32, generator=gen)[:, 16 : 16 + num_in]
    bias = torch.randn(num_out, generator=gen)
    for b in (None, bias):
        want = x.double() @ weight.double().T + (0 if b is None else b.double())
        got = native.linear_bf16x3(x, tiles, b)
        assert got.dtype == torch.float32 and got.shape == (rows, num_out)
        if rows:
            # relative to the output's scale (~sqrt(num_in)); float32 itself is ~5e-7 off here
            assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-5


def test_bf16x3_refuses_shapes_its_tiles_do_not_cover():
    native = cpu_kernels.kernels()
    if native is None or native.pack_bf16x3(torch.eye(32)) is None:
        pytest.skip("no AMX matmul kernel on this machine")
    assert native.pack_bf16x3(torch.randn(40, 64)) is None  # 40 outputs: not whole 16-column tiles
    assert native.pack_bf16x3(torch.randn(48, 80)) is None  # 80 inputs: not whole 32-input tiles


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_streaming_read_covers_every_byte_once(threads):
    """`bench quant`'s bandwidth read: every 64-bit word summed exactly once, whatever the split."""
    native = cpu_kernels.kernels()
    if native is None:
        pytest.skip("native CPU kernels not built here")
    from services.worker.host_memory import aligned_host_tensor

    words = aligned_host_tensor((8 * 1001,), torch.int64, 64)
    words.copy_(torch.randint(0, 1 << 40, words.shape, generator=torch.Generator().manual_seed(threads)))
    assert native.read(words, threads) == int(words.sum()) % (1 << 64)


needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@needs_compiler
def test_kernels_build_warning_free(tmp_path, monkeypatch):
    """The library builds from an empty cache under -Wall -Wextra with every warning an error
    (kernel_build.WARNINGS): CI fails where a change brings a warning."""
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", str(tmp_path))
    assert kernel_build.build().is_file()


@needs_compiler
def test_a_function_missing_from_the_header_fails_the_build(tmp_path, monkeypatch):
    """An exported function that kernels.h does not declare (a signature that could drift from its
    callers') is a build error, not a library."""
    src = tmp_path / "csrc"
    src.mkdir()
    shutil.copy(kernel_build.SOURCE_DIR / "kernels.h", src)
    (src / "extra.c").write_text('#include "kernels.h"\nint undeclared_kernel(int x) { return x; }\n')
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", src)
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(OSError, match="missing-prototypes"):
        kernel_build.build()
