"""The bundled model's tokenizer, loaded once (reading the GGUF takes seconds)."""

from __future__ import annotations

import pytest

from shared.modelfile import resolve_model_path
from shared.tokenizer import ModelTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> ModelTokenizer:
    return load_tokenizer(resolve_model_path(None))
