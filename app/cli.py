"""The ``kvrows`` command line: ``demo``, ``conform``, ``bench``, ``example`` and ``classes``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvrows.app.bench import FAMILIES

__all__ = ["BENCH_FAMILIES", "main"]

#: What ``kvrows bench --family`` accepts.
BENCH_FAMILIES = (*FAMILIES, "all")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrows", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    conform = commands.add_parser("conform", help="run the conformance state machines")
    conform.add_argument(
        "--profile",
        choices=("ci", "deep"),
        default=None,
        help="Hypothesis profile (default: $KVROWS_PROFILE or ci)",
    )
    conform.add_argument(
        "--family",
        action="append",
        default=None,
        help="storage family to run (repeatable; default: all)",
    )
    conform.add_argument("--seed", type=int, default=None, help="Hypothesis seed")

    bench = commands.add_parser("bench", help="time row operations against mlx-lm and a copy")
    bench.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    bench.add_argument("--repeats", type=int, default=None, help="timed repeats per operation")
    bench.add_argument(
        "--family",
        choices=BENCH_FAMILIES,
        default="plain",
        help="plain (default), affine, rotating, engine (throughput against mlx-lm's "
        "BatchGenerator), speculative (the engine with a draft model, against mlx-lm's "
        "speculative generation), delayed (per-row against whole-cache conversion at each "
        "--kv-start), turbo (TurboQuant quality against the paper and plain, bytes per "
        "token, decode attention time) or all of them",
    )
    bench.add_argument(
        "--kv-start",
        type=int,
        action="append",
        default=None,
        metavar="N",
        help="the delayed family's quantized_kv_start (repeatable; default 0, 64 and 512)",
    )

    bench.add_argument(
        "--contexts",
        default=None,
        metavar="LO-HI",
        help="the engine family's serving trace: document lengths in tokens (default 2048-8192)",
    )
    bench.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="the engine family's serving trace: also write its latency distributions as a "
        "PNG (only if matplotlib is installed; the text histograms are always printed)",
    )

    demo = commands.add_parser("demo", help="continuous batching on the embedded models")
    demo.add_argument(
        "--model",
        default=None,
        help="a local mlx-lm checkpoint directory, a built-in tiny architecture (llama, "
        "gemma3, qwen3_next, mamba2), or hybrid (the two recurrent ones; default: llama "
        "and gemma3)",
    )
    demo.add_argument(
        "--scheme",
        action="append",
        default=None,
        help="plain, affine8, affine4, affine<bits>:<group>, turbo (TurboQuant k8v3) or "
        "turbo:k<bits>v<bits> (turbo:k4v3), with per-layer codecs "
        "(affine4:32,0=plain,-1=plain: a negative layer counts from the last) and an "
        "optional bf16-first start (@N) (repeatable)",
    )
    demo.add_argument(
        "--kv-start",
        type=int,
        default=None,
        metavar="N",
        help="keep the first N tokens of every row in plain precision and quantize from "
        "there, each row at its own offset (sets every scheme's quantized_kv_start, like "
        "mlx-lm's --quantized-kv-start)",
    )
    demo.add_argument("--requests", type=int, default=12, help="requests in the first wave")
    demo.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="most rows in flight at once (prefilling and decoding)",
    )
    demo.add_argument("--kv-budget", type=int, default=None, help="KV byte budget")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--prefix-store",
        default=None,
        metavar="DIR",
        help="also save published rows to an on-disk prefix store in DIR and load prefixes "
        "from it (run twice with the same DIR: the second run reports disk hits and the "
        "prefill time saved)",
    )
    demo.add_argument(
        "--prefix-store-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="byte budget of the prefix store directory (least recently used rows are "
        "evicted; default 256 MiB)",
    )

    demo.add_argument(
        "--speculative",
        action="store_true",
        help="run the trace with and without a draft model (the target's first layers) and "
        "check that speculative decoding gives the same greedy tokens",
    )
    demo.add_argument(
        "--draft-tokens", type=int, default=3, help="draft tokens per round (--speculative)"
    )
    demo.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="target layers the draft keeps (--speculative; default: the fewest that keep "
        "every kind of layer)",
    )

    demo.add_argument(
        "--paged",
        action="store_true",
        help="the engine's paged option (one block pool per layer, rows by block table, "
        "prefix blocks shared by hash): the trace with the invariance check, and a "
        "shared-prefix trace's peak KV bytes and tokens/s against the contiguous layouts "
        "(schemes: plain, affine8, turbo)",
    )
    demo.add_argument(
        "--mla",
        action="store_true",
        help="the tiny MLA models (deepseek_v32, glm_moe_dsa) on latent caches, with the "
        "batch-invariance check (schemes: plain, affine8, affine4, turbo-v4)",
    )

    commands.add_parser(
        "example", help="merge, decode, filter and extract rows, and say what happened"
    )
    commands.add_parser(
        "classes", help="every seed class: its axes, status, conformance family and spec page"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; a refused argument (a ``KvRowsError``) is one line on stderr, exit 2."""
    from kvrows.errors import KvRowsError

    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except KvRowsError as error:
        print(f"kvrows {args.command}: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "conform":
        from kvrows.conformance.runner import run_conformance

        return int(run_conformance(profile=args.profile, families=args.family, seed=args.seed))
    if args.command == "bench":
        from kvrows.app.bench import run

        return run(
            args.family,
            quick=args.quick,
            repeats=args.repeats,
            kv_starts=args.kv_start,
            plot=args.plot,
            contexts=args.contexts,
        )
    if args.command == "demo" and args.mla:
        from kvrows.app.latent_demo import run_latent_demo

        return int(
            run_latent_demo(
                schemes=args.scheme,
                requests=args.requests,
                max_batch=args.max_batch,
                kv_start=args.kv_start,
            )
        )
    if args.command == "demo" and args.paged:
        from kvrows.app.paged_demo import run_paged_demo

        return int(
            run_paged_demo(
                model_path=args.model,
                schemes=args.scheme,
                requests=args.requests,
                max_batch=args.max_batch,
                kv_budget=args.kv_budget,
                progress=not args.quiet,
            )
        )
    if args.command == "demo" and args.speculative:
        from kvrows.app.demo import run_speculative_demo

        return int(
            run_speculative_demo(
                model_path=args.model,
                schemes=args.scheme,
                requests=args.requests,
                max_batch=args.max_batch,
                draft_tokens=args.draft_tokens,
                draft_layers=args.draft_layers,
                progress=not args.quiet,
                kv_start=args.kv_start,
            )
        )
    if args.command == "demo":
        from kvrows.app.demo import PREFIX_STORE_BYTES, run_demo

        return int(
            run_demo(
                model_path=args.model,
                schemes=args.scheme,
                requests=args.requests,
                max_batch=args.max_batch,
                kv_budget=args.kv_budget,
                progress=not args.quiet,
                kv_start=args.kv_start,
                prefix_store=args.prefix_store,
                prefix_store_bytes=(
                    PREFIX_STORE_BYTES
                    if args.prefix_store_bytes is None
                    else args.prefix_store_bytes
                ),
            )
        )
    if args.command == "classes":
        from kvrows.app.classes import run_classes

        return run_classes()
    from kvrows.app.example import run_example

    return int(run_example())


if __name__ == "__main__":
    sys.exit(main())
