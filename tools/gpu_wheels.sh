#!/usr/bin/env bash
# Wheels for a lent GPU machine that reaches no package registry (Python 3.12,
# x86-64 manylinux): what undercurrent and the benchmarks need beyond that
# machine's image (torch, transformers, numpy, pandas, PyYAML, pytest and
# hypothesis are there). Run here, in the repository's root; the wheels land in
# .whl/, which git is told to ignore in this clone only (.git/info/exclude).
# On the machine, before tools/gpu_check.sh (name .whl in what travels):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#     --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -eu
PY=${PYTHON:-python3}
WHEELS=(
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  nnsight==0.8.1 greenlet==3.5.6 websocket-client==1.9.2 zstandard==0.25.0
)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
  platforms+=(--platform "$tag")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}"
ls .whl
