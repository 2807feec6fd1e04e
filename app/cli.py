"""The ``kvrows`` command line: ``demo``, ``serve``, ``conform``, ``bench``, ``example`` and
``classes``.

Every option is checked when the command line is parsed, before any work, and a refusal
names the option; whatever escapes a command as an exception is one line on stderr.
Exit status: 0 done, 1 a check failed (a wrong result, or work not done: rejected
requests), 2 refused or broken (a bad option, a model that cannot load, an I/O error).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from kvrows.app.bench import FAMILIES
from kvrows.codecs import kv_codecs

__all__ = ["BENCH_FAMILIES", "main"]

#: What ``kvrows bench --family`` accepts.
BENCH_FAMILIES = (*FAMILIES, "all")

#: Set to show the traceback of an unexpected error instead of its one line.
TRACEBACK_VARIABLE = "KVROWS_TRACEBACK"


class CommandLineError(Exception):
    """A refused command line (a bad value, an unsupported combination): one line, exit 2.
    ``prog``: the (sub)command it belongs to, where the parser knows it before ``main``."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, but a refusal is raised (``main`` prints it as one line) instead of usage
    and ``sys.exit``, so a caller in-process gets an exit status back."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(f"{message} (see {self.prog} --help)", prog=self.prog)


def _integer(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= low``; argparse prefixes the option's name."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvrows", description=__doc__)
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
    bench.add_argument(
        "--repeats", type=_integer(1), default=None, help="timed repeats per operation"
    )
    bench.add_argument(
        "--family",
        choices=BENCH_FAMILIES,
        default="plain",
        help="plain (default), affine, rotating, engine (throughput against mlx-lm's "
        "BatchGenerator), speculative (the engine with a draft model, against mlx-lm's "
        "speculative generation), delayed (per-row against whole-cache conversion at each "
        "--kv-start), turbo (TurboQuant quality against the paper and plain, bytes per "
        "token, decode attention time), paged, serve (kvrows serve against mlx_lm.server "
        "over HTTP: starts both servers, needs the serve extra), distributed (rows and "
        "decisions between two processes of one mlx.launch) or all of them (serve and "
        "distributed excepted)",
    )
    bench.add_argument(
        "--kv-start",
        type=_integer(0),
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
        help="the engine and serve families' traces: also write their latency distributions as a "
        "PNG (needs matplotlib: pip install 'kvrows[plot]'; the text histograms are always "
        "printed)",
    )

    demo = commands.add_parser("demo", help="continuous batching on the embedded models")
    _engine_options(demo, serving=False)
    demo.add_argument("--requests", type=_integer(1), default=12, help="requests in the first wave")
    demo.add_argument(
        "--quiet",
        action="store_true",
        help="no per-request progress bar (a line per model and scheme still goes to stderr)",
    )
    demo.add_argument(
        "--mla",
        action="store_true",
        help="the tiny MLA models (deepseek_v32, glm_moe_dsa) on latent caches through the engine, with the "
        "batch-invariance check (schemes: plain, affine8, affine4, turbo-v4); with --paged, "
        "through the paged engine (one latent block pool per layer)",
    )

    demo.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="shard the model over the processes of an mlx.launch (mlx.launch -n 2 --backend "
        "ring -- kvrows demo --tensor-parallel): each rank's caches hold its KV heads; the "
        "batch-invariance check, every rank's tokens alike and equal to one process's; with "
        "--paged, a block pool per layer and rank",
    )

    demo.add_argument(
        "--disaggregated",
        action="store_true",
        help="disaggregated prefill over the processes of an mlx.launch (mlx.launch -n 2 "
        "--backend ring -- kvrows demo --disaggregated): prefill ranks compute prompts and "
        "hand the rows to decode ranks, which decode them in their running batch; the "
        "batch-invariance check and tokens equal to one process's (schemes: plain, affine4, "
        "turbo); with --paged, rows arrive in the decode ranks' pools",
    )
    demo.add_argument(
        "--roles",
        default=None,
        metavar="ROLE,...",
        help="--disaggregated: each rank's role in rank order, prefill or decode (default: "
        "rank 0 prefill, the others decode)",
    )

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the engine (needs kvrows[serve])",
        description="Serve one model over OpenAI's chat and completion API "
        "(spec/server.md): POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
        "GET /health, GET /metrics. SIGTERM drains: new requests get 503, those in flight "
        "finish, the prefix store is written, exit 0.",
    )
    _engine_options(serve, serving=True)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port", type=_integer(0), default=8000, help="port (default 8000; 0: any free one)"
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model's name in the API (default: --model as given)",
    )
    serve.add_argument(
        "--context-length",
        type=_integer(2),
        default=None,
        metavar="N",
        help="prompt and completion tokens a request may have together (default: the "
        "model config's max_position_embeddings, else 4096)",
    )
    serve.add_argument(
        "--max-waiting",
        type=_integer(1),
        default=64,
        metavar="N",
        help="requests that may wait for admission; more get 429 with Retry-After (default 64)",
    )
    serve.add_argument(
        "--queue-timeout",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="a request waiting longer for admission ends with an error (default: no limit)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may run on before they are cut off "
        "(default 30)",
    )
    serve.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="shard the model over the processes of an mlx.launch (mlx.launch -n 2 --backend "
        "ring -- kvrows serve --tensor-parallel ...): rank 0 serves HTTP and decides for "
        "every rank; each rank's caches hold its KV heads (not with --queue-timeout)",
    )
    serve.add_argument(
        "--step-timeout",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="--tensor-parallel: a step or a wait for the other ranks longer than this stops "
        "the rank, naming the one that does not answer (default 120)",
    )
    serve.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (default warning)",
    )

    commands.add_parser(
        "launch",
        help="mlx.launch with an exit status: the first rank's non-zero status, 0 when every "
        "rank returned 0 (its arguments follow: -n 2 --backend ring -- PROGRAM ...)",
        add_help=False,
    )
    commands.add_parser(
        "example", help="merge, decode, filter and extract rows, and say what happened"
    )
    commands.add_parser(
        "classes", help="every seed class: its axes, status, conformance family and spec page"
    )
    return parser


def _positive_seconds(text: str) -> float:
    """An argparse type: seconds, a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _engine_options(parser: argparse.ArgumentParser, *, serving: bool) -> None:
    """The engine's options, one definition for ``demo`` and ``serve`` (``serving``: one
    scheme, and a draft model serves instead of being compared)."""
    if serving:
        parser.add_argument(
            "--model",
            required=True,
            help="a local mlx-lm checkpoint directory (its tokenizer and chat template "
            "included), or tiny:ARCH: an embedded tiny model (random weights) with a "
            "built-in tokenizer and chat template (tiny:llama, tiny:gemma3, tiny:qwen3_next, "
            "...); nothing is downloaded",
        )
    else:
        parser.add_argument(
            "--model",
            default=None,
            help="a local mlx-lm checkpoint directory, a built-in tiny architecture (llama, "
            "gemma3, qwen3_next, mamba2, llama4: chunked-local attention), or hybrid (the two "
            "recurrent ones; default: llama and gemma3)",
        )
    schemes = f"{'; '.join(spec.syntax for spec in kv_codecs().values())} (the registered codecs), with per-layer codecs (affine4:32,0=plain,-1=plain: a negative layer counts from the last) and an optional bf16-first start (@N)"
    parser.add_argument(
        "--scheme",
        action="store" if serving else "append",
        default=None,
        help=f"{schemes} (default plain)" if serving else f"{schemes} (repeatable)",
    )
    parser.add_argument(
        "--kv-start",
        type=_integer(0),
        default=None,
        metavar="N",
        help="keep the first N tokens of every row in plain precision and quantize from "
        "there, each row at its own offset (sets every scheme's quantized_kv_start, like "
        "mlx-lm's --quantized-kv-start)",
    )
    parser.add_argument(
        "--max-batch",
        type=_integer(1),
        default=8,
        help="most rows in flight at once (prefilling and decoding)",
    )
    parser.add_argument(
        "--kv-budget",
        type=_integer(1),
        default=None,
        help="KV byte budget (a request that can never fit is refused: HTTP 400)"
        if serving
        else "KV byte budget (a request that can never fit is rejected: the run reports it "
        "and exits 1)",
    )
    parser.add_argument(
        "--prefix-store",
        default=None,
        metavar="DIR",
        help="also save published rows to an on-disk prefix store in DIR and load prefixes "
        "from it (a restart with the same DIR serves the earlier prefixes from disk)"
        if serving
        else "also save published rows to an on-disk prefix store in DIR and load prefixes "
        "from it (run twice with the same DIR: the second run reports disk hits and the "
        "prefill time saved)",
    )
    parser.add_argument(
        "--prefix-store-bytes",
        type=_integer(1),
        default=None,
        metavar="BYTES",
        help="byte budget of the prefix store directory (least recently used rows are "
        "evicted; default 256 MiB)",
    )
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="decode with a draft model (the target's first layers): the same greedy "
        "tokens, fewer target forwards"
        if serving
        else "run the trace with and without a draft model (the target's first layers) and "
        "check that speculative decoding gives the same greedy tokens",
    )
    parser.add_argument(
        "--draft-tokens",
        type=_integer(1),
        default=None,
        help="draft tokens per round (--speculative; default 3)",
    )
    parser.add_argument(
        "--draft-layers",
        type=_integer(1),
        default=None,
        help="target layers the draft keeps (--speculative; default: the fewest that keep "
        "every kind of layer)",
    )
    parser.add_argument(
        "--paged",
        action="store_true",
        help="the engine's paged option (one block pool per layer, rows by block table, "
        "prefix blocks shared by hash)"
        if serving
        else "the engine's paged option (one block pool per layer, rows by block table, "
        "prefix blocks shared by hash): the trace with the invariance check, and a "
        "shared-prefix trace's peak KV bytes and tokens/s against the contiguous layouts "
        "(schemes: plain, affine8, turbo)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command. A refused command line, a refused argument (a ``KvRowsError``) or any
    other error that escapes is one line on stderr and exit status 2 (set
    ``KVROWS_TRACEBACK=1`` for the traceback of an unexpected one); an interrupt is 130."""
    from kvrows.errors import KvRowsError

    command = "kvrows"
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        if arguments[:1] == ["launch"]:  # every argument after it is mlx.launch's
            command = "kvrows launch"
            from kvrows.app.launch import run_launch

            return run_launch(arguments[1:])
        args = _parser().parse_args(arguments)
        command = f"kvrows {args.command}"
        _check(args)
        return _run(args)
    except CommandLineError as error:
        print(f"{error.prog or command}: {error}", file=sys.stderr)
        return 2
    except KvRowsError as error:
        print(f"{command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get(TRACEBACK_VARIABLE):
            raise
        print(f"{command}: {_one_line(error)}", file=sys.stderr)
        return 1 if _failed_check(error) else 2


def _failed_check(error: BaseException) -> bool:
    """A benchmark's result check that failed (a wrong result: exit 1, not 2). The runner
    is looked up, not imported: it imports MLX, and a run that raised has loaded it."""
    runner = sys.modules.get("kvrows.app.bench.runner")
    return runner is not None and isinstance(error, runner.BenchCheckError)


def _one_line(error: BaseException) -> str:
    """``error`` as one line: its type, and its message's first line (an ``OSError``: the
    file and the OS's reason)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    kind = type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    return (
        f"{kind}: {text} (set {TRACEBACK_VARIABLE}=1 for the traceback)"
        if text
        else f"{kind} (set {TRACEBACK_VARIABLE}=1 for the traceback)"
    )


def _check(args: argparse.Namespace) -> None:
    """Refuse, before any work, what the parser's types cannot see: option combinations a
    command does not support, names only known at run time, missing optional packages."""
    if args.command == "conform":
        _check_conform(args)
    elif args.command == "bench":
        _check_bench(args)
    elif args.command == "demo":
        _check_demo(args)
    elif args.command == "serve":
        _check_serve(args)


def _check_serve(args: argparse.Namespace) -> None:
    """The server's packages are installed, the model and scheme parse, the options go
    together."""
    from kvrows.errors import KvRowsError

    missing = [
        name for name in ("starlette", "uvicorn", "prometheus_client")
        if importlib.util.find_spec(name) is None
    ]  # fmt: skip
    if missing:
        raise CommandLineError(
            f"needs {', '.join(missing)}, not installed: pip install 'kvrows[serve]'"
        )
    for option, value in (
        ("--draft-tokens", args.draft_tokens),
        ("--draft-layers", args.draft_layers),
    ):
        if value is not None and not args.speculative:
            raise CommandLineError(f"argument {option}: needs --speculative")
    if args.prefix_store_bytes is not None and args.prefix_store is None:
        raise CommandLineError("argument --prefix-store-bytes: needs --prefix-store DIR")
    if args.tensor_parallel and args.queue_timeout is not None:
        # Rank 0 decides every row operation; a wall-clock timeout would be a decision it
        # takes alone.
        raise CommandLineError("argument --queue-timeout: not with --tensor-parallel yet")
    if args.step_timeout is not None and not args.tensor_parallel:
        raise CommandLineError("argument --step-timeout: needs --tensor-parallel")
    store = args.prefix_store
    if store is not None and os.path.exists(store) and not os.path.isdir(store):
        raise CommandLineError(f"argument --prefix-store: {store} is a file, not a directory")
    from kvrows.app.server import check_model_name

    try:
        check_model_name(args.model)
    except KvRowsError as error:
        raise CommandLineError(f"argument --model: {error}") from error
    if args.scheme is not None:
        from kvrows.app.server import check_scheme_name

        try:
            check_scheme_name(args.scheme)
        except KvRowsError as error:
            raise CommandLineError(f"argument --scheme: {error}") from error


def _check_conform(args: argparse.Namespace) -> None:
    from kvrows.conformance.families import FAMILIES as CONFORMANCE_FAMILIES
    from kvrows.conformance.profiles import active_profile

    if args.profile is None:
        try:
            active_profile()
        except ValueError as error:
            raise CommandLineError(f"$KVROWS_PROFILE: {error}") from error

    unknown = [name for name in args.family or () if name not in CONFORMANCE_FAMILIES]
    if unknown:
        raise CommandLineError(
            f"argument --family: unknown {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(CONFORMANCE_FAMILIES))}"
        )


def _check_bench(args: argparse.Namespace) -> None:
    """Each family's own option needs that family (or ``all``) to run."""
    for option, value, owners in (
        ("--kv-start", args.kv_start, ("delayed",)),
        ("--contexts", args.contexts, ("engine",)),
        ("--plot", args.plot, ("engine", "serve")),
    ):
        if value is not None and args.family not in (*owners, "all"):
            raise CommandLineError(
                f"argument {option}: applies to --family {' or '.join(owners)} (or all), "
                f"not --family {args.family}"
            )
    if args.contexts is not None:
        from kvrows.app.bench import _span

        _span(args.contexts)
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise CommandLineError(
                "argument --plot: needs matplotlib, which is not installed: "
                "pip install 'kvrows[plot]'"
            )
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise CommandLineError(f"argument --plot: no such directory {folder}")


#: ``kvrows demo``'s modes (``--paged``, ...; ``main`` without one) and the function of
#: ``kvrows.app.demo`` that runs each.
_DEMOS = {
    "main": "run_demo",
    "paged": "run_paged_demo",
    "speculative": "run_speculative_demo",
    "mla": "run_latent_demo",
    "tensor-parallel": "run_tensor_parallel_demo",
    "disaggregated": "run_disaggregated_demo",
}

#: ``kvrows demo`` options that only some modes use: the option, its attribute, the
#: demo function's keyword, and the modes that take it (an option not given is left to
#: the function's default).
_DEMO_MODE_OPTIONS = (
    (
        "--model",
        "model",
        "model_path",
        ("main", "paged", "speculative", "tensor-parallel", "disaggregated"),
    ),
    ("--roles", "roles", "roles", ("disaggregated",)),
    ("--kv-budget", "kv_budget", "kv_budget", ("main", "paged")),
    ("--kv-start", "kv_start", "kv_start", ("main", "speculative", "mla", "tensor-parallel")),
    ("--prefix-store", "prefix_store", "prefix_store", ("main",)),
    ("--prefix-store-bytes", "prefix_store_bytes", "prefix_store_bytes", ("main",)),
    ("--draft-tokens", "draft_tokens", "draft_tokens", ("speculative", "tensor-parallel")),
    ("--draft-layers", "draft_layers", "draft_layers", ("speculative",)),
)


def _demo_mode(args: argparse.Namespace) -> str:
    flags = ("paged", "speculative", "mla", "tensor_parallel", "disaggregated")
    modes = [flag.replace("_", "-") for flag in flags if getattr(args, flag)]
    if args.paged and len(modes) == 2 and modes[1] in ("mla", "tensor-parallel", "disaggregated"):
        return modes[1]  # the MLA, sharded or disaggregated demo, paged
    if args.speculative and len(modes) == 2 and args.tensor_parallel:
        return "tensor-parallel"  # the sharded demo with a draft model
    if len(modes) > 1:
        raise CommandLineError(
            f"--{modes[0]} and --{modes[1]} are separate demos: choose one of them"
        )
    return modes[0] if modes else "main"


def _check_demo(args: argparse.Namespace) -> None:
    from kvrows.errors import KvRowsError

    mode = _demo_mode(args)
    for option, attribute, _, takes in _DEMO_MODE_OPTIONS:
        if getattr(args, attribute) is not None and mode not in takes:
            where = "the main demo" if mode == "main" else f"--{mode}"
            users = " or ".join("the main demo" if m == "main" else f"--{m}" for m in takes)
            raise CommandLineError(f"argument {option}: {where} does not take it (only {users})")
    if mode == "mla" and args.paged and args.kv_start is not None:
        raise CommandLineError(
            "argument --kv-start: --mla --paged does not take it (a bf16-first start has no "
            "paged layout)"
        )
    if args.prefix_store_bytes is not None and args.prefix_store is None:
        raise CommandLineError("argument --prefix-store-bytes: needs --prefix-store DIR")
    store = args.prefix_store
    if store is not None and os.path.exists(store) and not os.path.isdir(store):
        raise CommandLineError(f"argument --prefix-store: {store} is a file, not a directory")
    if args.model is not None:
        from kvrows.app.models import check_model

        try:
            check_model(args.model)
        except KvRowsError as error:
            raise CommandLineError(f"argument --model: {error}") from error
    for name in args.scheme or ():
        try:
            _check_scheme(name, mode)
        except KvRowsError as error:
            raise CommandLineError(f"argument --scheme: {error}") from error


def _check_scheme(name: str, mode: str) -> None:
    """``name`` parses as a scheme of ``mode`` (the model may still refuse it: a layer
    index past its last layer is known only once the model is)."""
    from kvrows.errors import InvalidInputError

    if mode == "mla":
        from kvrows.app.demo import latent_codec

        try:
            latent_codec(name)
        except InvalidInputError as refused:
            raise InvalidInputError(f"--mla: {refused}") from None
        return
    from kvrows.schemes import KvStorageScheme

    KvStorageScheme.parse(name)


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
    if args.command == "demo":
        from kvrows.app import demo

        mode = _demo_mode(args)
        options = {
            keyword: getattr(args, attribute)
            for _, attribute, keyword, takes in _DEMO_MODE_OPTIONS
            if mode in takes and getattr(args, attribute) is not None
        }
        if mode != "mla":  # the latent demo prints no progress
            options["progress"] = not args.quiet
        if mode in ("mla", "tensor-parallel", "disaggregated") and args.paged:
            options["paged"] = True
        if mode == "tensor-parallel" and args.speculative:
            options["speculative"] = True
        run_demo = getattr(demo, _DEMOS[mode])
        return int(
            run_demo(
                schemes=args.scheme, requests=args.requests, max_batch=args.max_batch, **options
            )
        )
    if args.command == "serve":
        from kvrows.app.server import serve_command

        return serve_command(args)
    if args.command == "classes":
        from kvrows.app.classes import run_classes

        return run_classes()
    from kvrows.app.example import run_example

    return int(run_example())


if __name__ == "__main__":
    sys.exit(main())
