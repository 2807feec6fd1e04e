"""kvrows.conformance: Hypothesis state machines that drive both implementations and compare.

Modules (imported as needed; nothing heavy runs at package import):

* ``families``: the implementations (``reference_impl``, ``optimized_impl``,
  mutants via ``Impl.with_classes``) and the storage families ``FAMILIES``, derived from
  the composition table (``derive()``);
* ``hooks``: the per-axis hook tables the families are derived with (``CODEC_HOOKS``,
  ``GEOMETRY_HOOKS``, ``PLACEMENT_HOOKS``, ``WRITERS``, ``MODIFIER_RULES``: each value's
  draw as data, its rules by name), ``compose`` (a machine from rule mixins) and mlx-lm's peers;
* ``machines``: the one state machine (the root), the K/V writer's rules (``KvRules``)
  and ``machine_class(family, layout, ...)``;
* ``rules``: the rule mixins the rows compose: the affine and TurboQuant codecs' rules,
  the ring's and the paged placement's (pools, their invariants, byte limits), the
  speculative modifier's verify rounds (solo replay of accepted tokens, mlx-lm's
  rollback, round misuse) and what rounds add on a ring;
* ``paged``: the block pools' helpers (accounting, byte limits, the collector);
* ``delayed``, ``latent``, ``recurrent``: the delayed modifier's rules and the latent and
  recurrent writers' rules, each composed over the root in place of ``KvRules``;
  ``delayed``: rows that convert to affine, or to TurboQuant in ``delayed-turbo``, at
  their own ``start`` (solo legos per row, the position record, mixed reads, prefill
  maintenance, rounds, deferred vs eager V);
* ``strategies``: Hypothesis strategies (geometries, ring windows and sinks, prompts,
  chunks, keep lists);
* ``tolerances``: the one tolerance table (``spec/tolerances.md``);
* ``parity``: where kvrows and mlx-lm knowingly differ (the skips' reasons);
* ``profiles``: the ``ci`` / ``deep`` / ``teeth`` Hypothesis profiles and the CI
  machines' seeds (``machine_seed``);
* ``runner``: ``run_conformance`` behind ``kvrows conform``;
* ``calibrate``: re-measures the errors behind the tolerance table;
* ``roles``: every role of the row-layout table, for every registered storage;
* ``arrays``, ``stats``: exact conversions, counters.
"""
