from __future__ import annotations

import pytest

from services.gateway.tokenizer import ModelTokenizer, load_tokenizer
from shared.modelfile import default_model_path


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path) -> ModelTokenizer:
    return load_tokenizer(model_path)
