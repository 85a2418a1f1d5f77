#!/usr/bin/env bash
# The wheels a lent GPU device lacks for bench/gpu_check.py, into one folder that travels with the working tree.
#
#   bash bench/gpu_bundle.sh [DIR]          # default DIR: gpu_wheels (git-ignored; pass it in the device call's carry)
#
# The device runs Python 3.12 with its own torch, transformers and peft, reaches no index, and has no DeepSpeed.
# DeepSpeed ships only an sdist, which builds to a py3-none-any wheel here (no ops are compiled at install time);
# pydantic-core is the one compiled dependency, so its cp312 manylinux wheel is fetched for the device's platform.
# The versions are those installed here, so the device runs what the CPU tests ran.
set -euo pipefail
DIR="${1:-gpu_wheels}"
mkdir -p "$DIR"
ver() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
python -m pip wheel --no-deps "deepspeed==$(ver deepspeed)" -w "$DIR"
python -m pip download --no-deps -d "$DIR" "hjson==$(ver hjson)" "pydantic==$(ver pydantic)" "annotated-types==$(ver annotated-types)" \
  "typing-inspection==$(ver typing-inspection)" "typing-extensions==$(ver typing-extensions)"
python -m pip download --no-deps -d "$DIR" --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 "pydantic-core==$(ver pydantic-core)"
du -sh "$DIR"
echo "on the device: python -m pip install --no-deps --no-index $DIR/*.whl && python -m pip install --no-deps --no-build-isolation -e . && python bench/gpu_check.py"
