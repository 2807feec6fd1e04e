"""A built-in byte-level tokenizer for the embedded tiny models (no download).

Token ``i`` is byte ``i`` (``encode("Hi") == [72, 105]``), so its 256 tokens are exactly
the tiny models' vocabulary (``kvrows.app.models.tiny_model``). It is a Hugging Face fast
tokenizer built in memory (GPT-2's byte-to-character map, no merges; ``transformers`` and
``tokenizers`` come with mlx-lm), wrapped as mlx-lm's ``load`` wraps a checkpoint's
tokenizer (``mlx_lm.tokenizer_utils.TokenizerWrapper``), so ``generate``,
``stream_generate`` and ``batch_generate`` take it as they take a loaded one. Its
streaming detokenizer is mlx-lm's naive one, which decodes with the tokenizer itself, so
the streamed text is exactly ``decode`` of the tokens (mlx-lm's byte-level one drops the
first text's leading space and misreads byte 0). It has no special tokens: no
end-of-sequence token, so generation runs to ``max_tokens``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BYTE_VOCAB", "tiny_tokenizer"]

#: Tokens in the vocabulary: one per byte value.
BYTE_VOCAB = 256


def _char_of_byte() -> dict[int, str]:
    """GPT-2's byte-to-character map (the alphabet of byte-level BPE): printable Latin-1
    bytes stand for themselves, the others for the characters from U+0100 on, in order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, str] = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(BYTE_VOCAB):
        if byte not in chars:
            chars[byte] = chr(BYTE_VOCAB + shifted)
            shifted += 1
    return chars


def tiny_tokenizer() -> Any:
    """A fresh byte-level tokenizer as mlx-lm's ``TokenizerWrapper`` (token id = byte)."""
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _char_of_byte().items()}
    byte_level = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: every byte of the text is one token, as it is.
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_level.decoder = decoders.ByteLevel()
    fast_class: Any = PreTrainedTokenizerFast  # untyped in some transformers versions
    fast = fast_class(tokenizer_object=byte_level, clean_up_tokenization_spaces=False)
    return TokenizerWrapper(fast, NaiveStreamingDetokenizer)
