"""Every Kafka client of the project is built by ``sluicegate/kafka.py`` (and the bare connection of the readiness
check by ``sluicegate/kafka_security.py``), so none can connect without the TLS and SASL options the settings ask
for. Reads every module's syntax tree: a direct ``AIOKafkaProducer(...)``, ``AIOKafkaConsumer(...)``,
``AIOKafkaAdminClient(...)`` or ``create_conn(...)`` anywhere else fails here, however it was imported."""

from __future__ import annotations

import ast

from test_import_arrows import PROJECT, ROOT

CONSTRUCTORS = frozenset({"AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient", "create_conn"})
#: The homes of client construction, and what each may build.
ALLOWED = {
    "sluicegate/kafka.py": {"AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"},
    "sluicegate/kafka_security.py": {"create_conn"},
}


def constructions(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each call of a Kafka client constructor: ``X(...)``, ``aiokafka.X(...)``, or a name
    imported ``as`` something else."""
    aliases = {
        alias.asname: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname and alias.name in CONSTRUCTORS
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        name = aliases.get(name, name)
        if name in CONSTRUCTORS:
            found.append((node.lineno, name))
    return found


def test_the_check_sees_every_spelling_of_a_construction() -> None:
    source = (
        "import aiokafka\nfrom aiokafka import AIOKafkaProducer as P\n"
        "a = aiokafka.AIOKafkaConsumer('t')\nb = P()\nc = AIOKafkaAdminClient()\nd = create_producer()\n"
    )
    assert constructions(ast.parse(source)) == [
        (3, "AIOKafkaConsumer"),
        (4, "AIOKafkaProducer"),
        (5, "AIOKafkaAdminClient"),
    ]


def test_only_the_kafka_factories_build_kafka_clients() -> None:
    offenders = []
    seen = 0
    for package in PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for line, name in constructions(ast.parse(path.read_text(), filename=relative)):
                seen += 1
                if name not in ALLOWED.get(relative, set()):
                    offenders.append(f"{relative}:{line} builds {name}: use sluicegate.kafka's factories")
    assert not offenders, "\n".join(offenders)
    assert seen >= 4  # the factories themselves were found: the walk reads the right files
