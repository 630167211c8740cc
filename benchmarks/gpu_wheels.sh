#!/usr/bin/env bash
# Fills .whl/ with what benchmarks/gpu_run.sh needs on the lent GPU machine and its image lacks.
#
# That image (Python 3.12, torch, triton, transformers; nothing can be fetched there) has no pydantic
# (the tests' conftest imports the settings), jsonschema and xgrammar (two engine test modules import
# them), gguf (the engine's GGUF loader) or bitsandbytes. Wheels for CPython 3.12 / manylinux x86-64 go
# to .whl/ (gpu_run.sh installs them with --no-deps into a temporary folder); bitsandbytes is unpacked
# into .whl/site/ with only its CPU and CUDA 13 libraries, 8 MB instead of a 43 MB wheel, because the
# working tree that travels is capped at 64 MiB. Run here, then name .whl in the device call's carry.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo "/.whl/" >>.git/info/exclude; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$1" "${@:2}"
}
rm -rf .whl && mkdir -p .whl/site
# One version of each: two versions of a package stop the whole install there.
download .whl "pydantic==2.13.4" "pydantic_core==2.46.4" "pydantic-settings==2.14.1" annotated-types \
    typing-inspection python-dotenv pytest-asyncio jsonschema jsonschema-specifications referencing rpds-py \
    "xgrammar==0.2.8" apache-tvm-ffi "gguf==0.19.0"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download "$tmp" "bitsandbytes==0.50.2"
(cd .whl/site && python3 -m zipfile -e "$tmp"/bitsandbytes-*.whl . \
    && find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda13*.so' -delete)
du -sh .whl
