"""Weight loading: GGUF (dequantized, q/k rows un-permuted) and HF directories (safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.attention import build_metadata
from services.worker.runner import allocate_kv_pool, load_model
from services.worker import model as model_module
from services.worker.weights import expected_names, gguf_to_hf_name, unpermute_rope_rows

BLOCK = 4


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's HF->GGUF converter does to q/k rows (its `permute`)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("num_heads, head_dim", [(9, 64), (3, 64), (8, 128), (2, 4)])
def test_unpermute_inverts_llama_cpp_permute(num_heads, head_dim):
    w = torch.randn(num_heads * head_dim, 5)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(w, num_heads), num_heads), w)
    bias = torch.randn(num_heads * head_dim)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_gguf_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_bundled_gguf_loads_complete_in_hf_layout(weights, cfg):
    assert weights.keys() == expected_names(cfg)  # tied: no lm_head
    assert weights["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    k_proj = weights["model.layers.0.self_attn.k_proj.weight"]
    assert k_proj.shape == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    assert weights["model.layers.29.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.intermediate_size)
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())


def tiny_checkpoint(tmp_path, arch: str):
    """A small random transformers model saved as an HF directory (config.json + safetensors)."""
    import transformers

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50000.0,
    )
    if arch == "llama":  # untied, head_dim not hidden / heads (as in some Llama-3 / Qwen3 shapes)
        config = transformers.LlamaConfig(**common, head_dim=32, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "llama3":  # Llama-3.1/3.2 rope scaling; an original context of 64 puts all three bands in use
        llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
        common["rope_parameters"] = dict(rope_type="llama3", rope_theta=common.pop("rope_theta"), **llama3)
        config = transformers.LlamaConfig(**common, head_dim=32, max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(config)
    else:  # Qwen2.5 shape: q/k/v biases, tied embeddings
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # make biases and norms non-trivial so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(tmp_path)
    # Published checkpoints carry rope_theta at the top level of config.json.
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_theta"] = 50000.0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return model.eval()


@pytest.mark.parametrize(
    "arch, layout",
    [("llama", "tiles"), ("qwen2", "tiles"), ("llama", "panels"), ("qwen2", "panels"), ("llama3", "panels"),
     ("llama", "onednn"), ("qwen2", "onednn"), ("llama", "plain"), ("qwen2", "plain")],
)  # fmt: skip
def test_hf_directory_model_matches_transformers(tmp_path, monkeypatch, arch, layout):
    """Both families, with weights in the AMX kernel's bf16x3 tiles (prefill) beside the panels
    (decode), in the native kernel's panels beside a oneDNN copy (AVX-512 machines), packed for
    oneDNN alone, and in the plain [in, out] layout (the path GPUs and torch builds without
    oneDNN take)."""
    if layout == "tiles" and model_module._tiles_pack(torch.eye(32)) is None:
        pytest.skip("no AMX matmul kernel on this machine")
    if layout == "panels" and model_module._panel_pack(torch.eye(16)) is None:
        pytest.skip("no native matmul kernel on this machine (it needs AVX-512)")
    if layout == "onednn" and model_module._onednn_pack(torch.eye(4)) is None:
        pytest.skip("this torch build has no oneDNN linear")
    if layout != "tiles":
        monkeypatch.setattr(model_module, "_tiles_pack", lambda weight: None)
    if layout not in ("tiles", "panels"):
        monkeypatch.setattr(model_module, "_panel_pack", lambda weight: None)
    if layout == "plain":
        monkeypatch.setattr(model_module, "_onednn_pack", lambda weight: None)
    theirs_model = tiny_checkpoint(tmp_path, arch)
    ours_model, cfg = load_model(tmp_path, "cpu")
    qkv = ours_model.layers[0].qkv
    held = {"tiles": qkv.tiles is not None, "panels": qkv.panels is not None, "onednn": qkv.packed is not None}
    assert held == {
        "tiles": layout == "tiles",
        "panels": layout in ("tiles", "panels"),
        "onednn": layout in ("panels", "onednn"),
    }
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.tie_embeddings == (arch == "qwen2")
    assert cfg.rope_theta == 50000.0
    assert (cfg.rope_scaling is not None) == (arch == "llama3")
    n = 23
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    table = [5, 1, 4, 0, 3, 2]
    pool = allocate_kv_pool(cfg, len(table), BLOCK, torch.float32, "cpu")
    with torch.inference_mode():
        theirs = theirs_model(ids[None]).logits[0]  # [n, V]
        meta = build_metadata([0], [n - 1], [table], BLOCK, "cpu")
        ours = ours_model(ids[:-1], torch.arange(n - 1), meta, pool, torch.arange(n - 1))
        torch.testing.assert_close(ours, theirs[:-1], atol=1e-5, rtol=1e-4)
        meta = build_metadata([n - 1], [1], [table], BLOCK, "cpu")
        last = ours_model(ids[-1:], torch.tensor([n - 1]), meta, pool, torch.tensor([0]))
        torch.testing.assert_close(last[0], theirs[-1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "model_type, architecture",
    [("qwen3", "Qwen3ForCausalLM"), ("gemma", "GemmaForCausalLM"), ("llama", "LlavaForConditionalGeneration")],
)
def test_unimplemented_architecture_is_refused_by_name(tmp_path, model_type, architecture):
    """A folder the model code does not implement would load and produce garbage."""
    tiny_checkpoint(tmp_path, "llama")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(model_type=model_type, architectures=[architecture])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"unsupported architecture {architecture}.*LlamaForCausalLM"):
        load_model(tmp_path, "cpu")


def test_unknown_rope_scaling_is_refused(tmp_path):
    tiny_checkpoint(tmp_path, "llama")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        load_model(tmp_path, "cpu")


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_checkpoint(tmp_path, "llama")
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_model(tmp_path, "cpu")


def test_bfloat16_model_stays_close_to_float32(tmp_path):
    """dtype is a load-time choice; rope angles stay float32 whatever the weights are."""
    tiny_checkpoint(tmp_path, "qwen2")
    ref, cfg = load_model(tmp_path, "cpu")
    half, _ = load_model(tmp_path, "cpu", dtype=torch.bfloat16)
    n = 40
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(2))
    logits = []
    for model, dtype in ((ref, torch.float32), (half, torch.bfloat16)):
        pool = allocate_kv_pool(cfg, 10, BLOCK, dtype, "cpu")
        meta = build_metadata([0], [n], [list(range(10))], BLOCK, "cpu")
        with torch.inference_mode():
            logits.append(model(ids, torch.arange(n), meta, pool, torch.arange(n)))
    assert logits[1].dtype == torch.float32
    assert (logits[1] - logits[0]).abs().max() < 0.1 * logits[0].abs().max()
    assert half._rope_inv_freq(torch.device("cpu")).dtype == torch.float32


def _huge_page_kb(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds `address`."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_streamed_matrices_lie_together_in_huge_pages(model):
    """A decode step streams every matrix once: they lie side by side, each on a 64-byte line,
    in one region that Linux backs with 2 MB pages where its THP setting allows (host_memory.py)."""
    linears = [m for m in model.modules() if isinstance(m, model_module.Linear)]
    assert len(linears) == 4 * model.cfg.num_layers + 1 and all(m.streamed() for m in linears)  # the head too
    held = [getattr(m, name) for m in linears for name in m.streamed()]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in held)
    assert all(start % 64 == 0 for start, _ in spans)
    assert spans[-1][1] - spans[0][0] < sum(end - start + 64 for start, end in spans)  # no gaps beyond alignment
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off here")
    assert _huge_page_kb(spans[0][0] + (2 << 20)) > 0
