"""The broker's Java side: find a recent enough ``java`` and fetch the Kafka jars pinned in
``infra/local/pom.xml`` from Maven Central once, into ``<state>/kafka/libs/<version>``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from cli.stack.layout import DevStackError, StackLayout
from cli.stack.processes import last_problem, log

INFRA_DIR = Path(__file__).resolve().parents[2] / "infra" / "local"
POM = INFRA_DIR / "pom.xml"

MIN_JAVA = 11
JAVA_HINT = "install a JDK 17+ (apt-get install openjdk-17-jre-headless)"
MAVEN_HINT = "install Maven (apt-get install maven); it fetches the Kafka jars once"


def infra_file(path: Path) -> Path:
    """``path`` under ``infra/local``, or a one-line error when this is not a source checkout."""
    if not path.exists():
        raise DevStackError(f"{path} not found: the dev stack runs from a source checkout (pip install -e .)")
    return path


def find_java() -> str:
    """``$JAVA_HOME/bin/java`` or ``java`` on the PATH, checked to be at least ``MIN_JAVA``."""
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home, "bin", "java") if java_home else None
    java = str(candidate) if candidate is not None and candidate.exists() else shutil.which("java")
    if java is None:
        raise DevStackError(f"java not found: {JAVA_HINT}")
    result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if match is None:
        raise DevStackError(f"cannot tell the version of {java}: {JAVA_HINT}")
    major = int(match.group(2) or 0) if match.group(1) == "1" else int(match.group(1))
    if major < MIN_JAVA:
        raise DevStackError(f"java {major} at {java} is too old for Kafka: {JAVA_HINT}")
    return java


def kafka_version() -> str:
    """The Kafka version pinned in ``infra/local/pom.xml`` (the jar cache is keyed by it)."""
    match = re.search(r"<kafka\.version>\s*([^<\s]+)\s*</kafka\.version>", infra_file(POM).read_text())
    if match is None:
        raise DevStackError(f"{POM} does not pin <kafka.version>")
    return match.group(1)


def ensure_jars(layout: StackLayout) -> Path:
    """The folder of the pinned broker jars, fetched with Maven unless cached (the caller holds the lock)."""
    pom_bytes = infra_file(POM).read_bytes()
    version = kafka_version()
    # The marker holds the pom's digest: a changed pom (say, another logging binding) refetches.
    digest = hashlib.sha256(pom_bytes).hexdigest()[:16]
    libs = layout.libs_root / version
    marker = libs / ".fetched"
    if marker.exists() and marker.read_text().strip() == digest:
        return libs

    mvn = shutil.which("mvn")
    if mvn is None:
        raise DevStackError(f"mvn not found: {MAVEN_HINT}")
    layout.libs_root.mkdir(parents=True, exist_ok=True)
    staging = layout.libs_root / f".{version}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    fetch_log = layout.libs_root / f"fetch-{version}.log"
    started = time.monotonic()
    log.info("devstack.fetch_jars version=%s dest=%s", version, libs)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={staging}",
        "-DincludeScope=runtime",
    ]
    with open(fetch_log, "wb") as out:
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=900, check=False)
    core = staging / f"kafka_2.13-{version}.jar"
    if result.returncode != 0 or not core.exists():
        shutil.rmtree(staging, ignore_errors=True)
        raise DevStackError(
            f"fetching Kafka {version} jars with Maven failed (exit {result.returncode}): "
            f"{last_problem(fetch_log)} (full output: {fetch_log})"
        )
    (staging / ".fetched").write_text(digest + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    os.replace(staging, libs)
    log.info(
        "devstack.jars_fetched version=%s jars=%d elapsed_s=%.1f",
        version,
        len(list(libs.glob("*.jar"))),
        time.monotonic() - started,
    )
    return libs
