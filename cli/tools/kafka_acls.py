"""``sluicegate kafka acls``: the Kafka ACLs of this deployment (:mod:`sluicegate.kafka_acls`) as
``kafka-acls.sh`` commands, or JSON with ``--json``; the tenants and models from the options or the settings."""

from __future__ import annotations

import argparse
import json

from sluicegate.kafka_acls import deployment_acls, render
from sluicegate.settings import comma_separated, get_settings


def _run(args: argparse.Namespace) -> int:
    settings = get_settings()
    if args.tenant_topics is not None:
        settings = settings.model_copy(update={"tenant_topics": args.tenant_topics})
    tenants = comma_separated(args.tenants) if args.tenants is not None else list(settings.tenant_names)
    models = args.model or sorted(settings.served_model_names)
    acls = deployment_acls(
        settings.names,
        models=models,
        tenants=tenants,
        router_group=settings.router_group,
        usage_group=settings.usage_group,
        usage_rollup=settings.usage_rollup,
    )
    if args.json:
        print(json.dumps([acl.as_json() for acl in acls], indent=2))
    else:
        print(render(acls, args.bootstrap_server or settings.kafka_bootstrap, apart=settings.tenant_topics))
    return 0


def add_kafka_command(sub: argparse._SubParsersAction) -> None:
    """Register ``sluicegate kafka acls`` on the top-level subparsers."""
    kafka = sub.add_parser("kafka", help="Kafka administration").add_subparsers(dest="action", required=True)
    acls = kafka.add_parser("acls", help="print the ACLs of every service and tenant principal (kafka-acls.sh lines)")
    acls.add_argument("--tenants", help="comma-separated tenants (default: SLUICEGATE_TENANTS)")
    acls.add_argument("--model", action="append", help="a served model, repeatable (default: SLUICEGATE_SERVED_MODELS)")
    mode = acls.add_mutually_exclusive_group()
    mode.add_argument(
        "--tenant-topics", dest="tenant_topics", action="store_true", default=None, help="tenants apart (own topics)"
    )
    mode.add_argument("--shared-topics", dest="tenant_topics", action="store_false", help="the shared topics")
    acls.add_argument("--bootstrap-server", help="for the printed commands (default: SLUICEGATE_KAFKA_BOOTSTRAP)")
    acls.add_argument("--json", action="store_true", help="the ACLs as JSON")
    acls.set_defaults(handler=_run)
