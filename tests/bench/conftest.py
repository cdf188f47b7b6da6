"""The bundled model's tokenizer, loaded once (reading the GGUF takes seconds)."""

from __future__ import annotations

import pytest

from services.gateway.tokenizer import ModelTokenizer, load_tokenizer
from shared.modelfile import resolve_model_path


@pytest.fixture(scope="session")
def tokenizer() -> ModelTokenizer:
    return load_tokenizer(resolve_model_path(None))
