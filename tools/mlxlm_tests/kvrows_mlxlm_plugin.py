"""A pytest plugin that runs mlx-lm's own tests offline, on mlx-lm's cache classes or, with
``--kvrows-rebind``, on kvrows' drop-ins (``spec/mlx-lm-drop-in.md`` §5).

Load it with ``-p kvrows_mlxlm_plugin`` (this folder on ``PYTHONPATH``); ``make
mlxlm-tests`` (``tools/mlxlm_tests/run.py``) does, twice. Always: mlx-lm's ``load`` (the
tests download a Qwen model) is replaced by the embedded ``tiny_model("llama")`` and a
byte-level tokenizer built in memory, so nothing is downloaded. With ``--kvrows-rebind``:
every mlx-lm cache class with a kvrows counterpart (:data:`REBOUND`, and ``ArraysCache`` of
every size, with or without ``left_padding``, :class:`ArraysCache`) is rebound to ``kvrows.optimized``'s wherever mlx-lm or
a test reads it by name: ``mlx_lm.models.cache`` (so ``make_prompt_cache`` and
``load_prompt_cache`` build kvrows classes), ``mlx_lm.generate``, every loaded
``mlx_lm.*`` module and the test modules, as a user monkeypatching mlx-lm would.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import mlx_lm.generate
import mlx_lm.models.cache as peer
import mlx_lm.utils
import pytest

#: mlx-lm's cache classes that kvrows serves under the same name.
REBOUND = ("KVCache", "RotatingKVCache", "QuantizedKVCache", "BatchKVCache", "BatchRotatingKVCache")
_ORIGINALS: dict[str, Any] = {name: getattr(peer, name) for name in (*REBOUND, "ArraysCache")}
_DOWNLOAD = mlx_lm.utils.load
#: Modules that keep mlx-lm's class under a rebound name: longcat_flash_ngram keeps the
#: last token ids (int64, up to n-1 columns) in an ``ArraysCache(1)``, which kvrows'
#: float planes of a fixed shape do not take (spec/mlx-lm-drop-in.md §5).
KEPT = {"mlx_lm.models.longcat_flash_ngram": frozenset({"ArraysCache"})}


def _tiny_load(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """The embedded tiny llama and a byte-level tokenizer instead of a download."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvrows.app.models import tiny_model

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    # the generation tests format their prompts with a chat template
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tiny_model("llama"), TokenizerWrapper(fast)


class _ArraysCacheType(type):
    """``ArraysCache(size, left_padding=None)``: kvrows' ``SSMCache(size)``, or with a
    non-empty ``left_padding`` (a batch's) ``BatchedSSMCache(size, left_padding=...)``;
    every size is served (spec/mlx-lm-drop-in.md §3), baichuan_m1's included; mlx-lm's own
    class in the :data:`KEPT` modules."""

    def __call__(cls, size: int, left_padding: Any = None) -> Any:
        import kvrows.optimized as kv

        # a model module imported inside a test reads the rebound name: ask who builds it
        caller = str(sys._getframe(1).f_globals.get("__name__", ""))
        if "ArraysCache" in KEPT.get(caller, ()):
            return _ORIGINALS["ArraysCache"](size, left_padding=left_padding)
        if left_padding is not None and len(left_padding) > 0:
            return kv.BatchedSSMCache(size, left_padding=left_padding)
        return kv.SSMCache(size)

    def __instancecheck__(cls, instance: object) -> bool:
        import kvrows.optimized as kv

        served = (kv.SSMCache, kv.BatchedSSMCache, _ORIGINALS["ArraysCache"])
        return isinstance(instance, served)


class ArraysCache(metaclass=_ArraysCacheType):
    """The rebound ``ArraysCache`` name (see :class:`_ArraysCacheType`)."""

    @classmethod
    def merge(cls, caches: Any) -> Any:
        import kvrows.optimized as kv

        first = caches[0]
        target = kv.SSMCache if isinstance(first, kv.SSMCache | kv.BatchedSSMCache) else None
        return (target or _ORIGINALS["ArraysCache"]).merge(caches)

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None) -> Any:
        return _ORIGINALS["ArraysCache"].from_state(state, meta_state)


def _replacements() -> dict[str, Any]:
    import kvrows.optimized as kv

    classes: dict[str, Any] = {name: getattr(kv, name) for name in REBOUND}
    classes["ArraysCache"] = ArraysCache
    return classes


def _rebind_everywhere() -> None:
    import kvrows.optimized as kv

    classes = _replacements()
    originals = {id(cls): name for name, cls in _ORIGINALS.items()}
    for module in list(sys.modules.values()):
        if not isinstance(module, ModuleType) or module.__name__.startswith("kvrows"):
            continue
        kept = KEPT.get(module.__name__, frozenset())
        for attribute, value in list(vars(module).items()):
            name = originals.get(id(value))
            if name is not None and _ORIGINALS[name] is value and name not in kept:
                setattr(module, attribute, classes[name])
    # load_prompt_cache finds a saved class by its name in mlx_lm.models.cache
    for name in kv.__all__:
        if not hasattr(peer, name):
            setattr(peer, name, getattr(kv, name))


def _offline(module: ModuleType | None) -> None:
    if module is not None and getattr(module, "load", None) is _DOWNLOAD:
        module.load = _tiny_load  # type: ignore[attr-defined]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kvrows-rebind",
        action="store_true",
        help="run on kvrows' drop-in cache classes instead of mlx-lm's",
    )


def pytest_configure(config: pytest.Config) -> None:
    mlx_lm.utils.load = _tiny_load
    _offline(sys.modules["mlx_lm.generate"])  # the package's ``generate`` is the function
    if config.getoption("--kvrows-rebind"):
        _rebind_everywhere()  # before the test modules import the names


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    for item in items:
        _offline(getattr(item, "module", None))
    if config.getoption("--kvrows-rebind"):
        _rebind_everywhere()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.config.getoption("--kvrows-rebind"):
        _rebind_everywhere()  # model modules an earlier test imported
