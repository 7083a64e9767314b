#!/usr/bin/env bash
# Fetch the wheels of benchmarks/device_wheels.txt for the lent GPU machine (Python 3.12, x86-64 manylinux) into
# .whl/ (git-ignored; a device call carries it: `carry: [".whl"]`). Run here, from anywhere in the repo.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -v '^\s*#' benchmarks/device_wheels.txt | sed 's/#.*//; /^\s*$/d' > /tmp/device_wheels.$$
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r /tmp/device_wheels.$$
rm -f /tmp/device_wheels.$$
ls -la .whl
