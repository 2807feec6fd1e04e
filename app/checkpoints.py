"""Small mlx-lm checkpoints built on disk, with a real tokenizer and a chat template (no
download).

``write_checkpoint(directory, arch)`` saves one of the embedded tiny models
(:data:`kvrows.app.models.TINY_MODELS`: random float32 weights) in mlx-lm's format
(``config.json``, ``model.safetensors`` and its index, as ``mlx_lm.utils.save_model`` and
``save_config`` write them) beside a tokenizer saved as Hugging Face's fast tokenizers are
(``tokenizer.json``, ``tokenizer_config.json`` with its chat template), so
``mlx_lm.load(directory)`` runs the path a downloaded checkpoint takes: config → model
class → weights (through the model's ``sanitize``) → tokenizer and template.

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on
:data:`CORPUS` (a few paragraphs written for it): every byte has a token, so any text
encodes; the merges make common English words one or two tokens. Its special tokens open
and close chat turns (``<|user|>`` ... ``<|end|>``); ``<|end|>`` is the end of sequence.
Training is deterministic, so every build has the same vocabulary and merges.

``tiny_model_with_tokenizer(arch)`` is the same model and tokenizer in memory (what
``kvrows serve --model tiny:<arch>`` serves): loading a written checkpoint gives the same
weights, so the same tokens.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvrows.app.models import TINY_MODELS, record_recurrent_layers, tiny_model
from kvrows.errors import InvalidInputError

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "CORPUS",
    "EOS",
    "NO_CHECKPOINT",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "tiny_model_with_tokenizer",
    "train_tokenizer",
    "write_checkpoint",
]

#: Text the tokenizer is trained on: plain English about what this project does, written
#: for it (a few common words' merges is all a tiny model needs).
CORPUS = """\
A language model reads a prompt and writes one token at a time. Each new token looks back
at every token before it, so the model keeps the keys and values of the tokens it has read:
the cache. The cache grows with every token, and when many people talk to the same server
at once, the caches of all their conversations share the memory of one machine.
A server that batches requests keeps one row per conversation. Rows join the batch when
there is room and leave when their answer is done. A row that starts with the same words
as an earlier one can reuse the earlier row's cache instead of reading those words again:
the first token then comes sooner. The same system prompt, sent by every client, is read
once and shared by all of them.
To hold more rows in the same memory, the cache can be stored in fewer bits: eight bits,
four bits, or a rotation followed by a small codebook. The first tokens of a row may stay
in full precision while the rest is quantized. Old tokens of a sliding window are dropped
as new ones arrive. A recurrent layer keeps a fixed state instead of a growing cache.
Hello! How are you today? I am fine, thank you. What would you like to know? Tell me a
short story about a cat who lives in a library and reads the books at night. Once upon a
time there was a small grey cat. She read about the sea, the stars and the mountains, and
in the morning she slept on the warm pages in the sun.
Write a list of three colours: red, green and blue. Count from one to ten: one, two, three,
four, five, six, seven, eight, nine, ten. The answer is yes. The answer is no. Thank you
for your question; here is the answer you asked for.
"""

BOS = "<|bos|>"
EOS = "<|end|>"
#: The special tokens, in id order after the byte alphabet's merges are learnt (the
#: trainer puts them first: ids 0..4).
SPECIAL_TOKENS = (BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>")
#: The vocabulary the trainer is asked for (the byte alphabet, the specials, merges).
VOCAB_SIZE = 384

#: The chat template (Jinja, as Hugging Face tokenizers carry one): each message is its
#: role's token, its content and ``<|end|>``; the generation prompt is ``<|assistant|>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer() -> Any:
    """The byte-level BPE trained on :data:`CORPUS`, as a ``transformers``
    ``PreTrainedTokenizerFast`` carrying the chat template and the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    fast_class: Any = PreTrainedTokenizerFast  # untyped in some transformers versions
    return fast_class(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


def _wrapped(tokenizer: Any) -> Any:
    """``tokenizer`` as mlx-lm's ``load`` returns one (its ``TokenizerWrapper``)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(tokenizer)


def _config(
    arch: str, vocab: int, eos: int, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` of ``tiny_model(arch, vocab=vocab, overrides=overrides)``: what
    ``tiny_model`` gives its ``ModelArgs`` (a multimodal model's language part nested in
    ``text_config``)."""
    row = TINY_MODELS[arch]
    config: dict[str, Any] = {
        "model_type": row.module,
        **row.config,
        **(overrides or {}),
        "vocab_size": vocab,
    }
    module: Any = importlib.import_module(f"mlx_lm.models.{row.module}")
    nested = "text_config" in module.ModelArgs.__dataclass_fields__
    taken = (module.TextArgs if nested else module.ModelArgs).__dataclass_fields__
    # transformers reads config.json too (AutoTokenizer) and checks its types: a None that
    # is the args' default (or that they do not take) is left out, Llama4's flag is a bool.
    config = {
        key: value
        for key, value in config.items()
        if value is not None or (key in taken and taken[key].default is not None)
    }
    if "attn_temperature_tuning" in config:
        config["attn_temperature_tuning"] = bool(config["attn_temperature_tuning"])
    if nested:
        config = {"model_type": row.module, "text_config": config}
    config["eos_token_id"] = eos
    return config


#: Tiny architectures whose config cannot be written so that both mlx-lm and transformers
#: read it, and why (they are still served from memory: ``--model tiny:<arch>``).
NO_CHECKPOINT = {
    "glm_moe_dsa": "mlx-lm's ModelArgs needs n_shared_experts (None in the tiny config) and "
    "transformers' config (read by AutoTokenizer) refuses a None there",
}


def _check_arch(arch: str, *, on_disk: bool = False) -> None:
    if arch not in TINY_MODELS:
        raise InvalidInputError(
            f"unknown architecture {arch!r}: expected one of {', '.join(TINY_MODELS)}"
        )
    if on_disk and arch in NO_CHECKPOINT:
        raise InvalidInputError(f"no checkpoint of {arch} on disk: {NO_CHECKPOINT[arch]}")


def _saved_form(model: Any) -> Any:
    """``model`` with its weights as ``mlx_lm.load`` leaves them: passed once through the
    model's ``sanitize`` (baichuan_m1 normalizes its head there)."""
    if hasattr(model, "sanitize"):
        from mlx.utils import tree_flatten

        weights = model.sanitize(dict(tree_flatten(model.parameters())))
        model.load_weights(list(weights.items()))
        mx.eval(model.parameters())
    return model


def tiny_model_with_tokenizer(arch: str, *, seed: int = 0) -> tuple[Any, Any]:
    """``tiny_model(arch)`` over the trained tokenizer's vocabulary, and that tokenizer as
    mlx-lm's ``TokenizerWrapper`` (with its chat template): what ``mlx_lm.load`` returns
    for ``write_checkpoint(directory, arch, seed=seed)``."""
    _check_arch(arch)
    tokenizer = train_tokenizer()
    model = _saved_form(tiny_model(arch, seed=seed, vocab=len(tokenizer), record=False))
    record_recurrent_layers(model)
    return model, _wrapped(tokenizer)


def write_checkpoint(
    directory: str | os.PathLike[str],
    arch: str,
    *,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``tiny_model(arch, overrides=config)`` (over the trained tokenizer's vocabulary) and the
    tokenizer to ``directory`` in mlx-lm's format; returns the directory. Loading it with
    ``mlx_lm.load`` gives :func:`tiny_model_with_tokenizer`'s model and tokenizer."""
    from mlx_lm.utils import save_config, save_model

    _check_arch(arch, on_disk=True)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    model = tiny_model(arch, seed=seed, vocab=len(tokenizer), record=False, overrides=config)
    save_model(path, model)
    save_config(
        _config(arch, len(tokenizer), tokenizer.convert_tokens_to_ids(EOS), config),
        config_path=path / "config.json",
    )
    tokenizer.save_pretrained(str(path))
    # transformers may keep the template in chat_template.jinja; older readers look in
    # tokenizer_config.json: write it there too.
    config_file = path / "tokenizer_config.json"
    saved = json.loads(config_file.read_text())
    saved["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(saved, indent=2))
    return path
