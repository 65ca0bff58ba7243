"""Fixtures shared by the KV-cache tests."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.tokenizer_util import byte_level_bpe


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A byte-level BPE trained at test time (``tests.tokenizer_util.byte_level_bpe``)."""
    tok: Tokenizer = byte_level_bpe()
    return tok
