"""The application above the kvrows contract and its implementations.

:mod:`.engine` (continuous batching built only on the contract), :mod:`.models`
(kvrows caches inside unmodified mlx-lm models, the embedded tiny models),
:mod:`.demo`, :mod:`.example`, :mod:`.cli` (the ``kvrows`` command) and
:mod:`.bench` (every family's benchmarks through one runner). Nothing in the
contract package ``kvrows`` imports this package.
"""
