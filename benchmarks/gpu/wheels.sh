#!/usr/bin/env bash
# Fetches into .whl the wheels a GPU machine without a package index needs beside its image's
# torch, triton and transformers, at the versions this checkout's .venv runs (CPython 3.12,
# x86-64 Linux): the serving stack's packages the image lacks, and grpcio and protobuf, whose
# versions the generated gRPC code checks. checks.sh installs them to /tmp/site there.
#
#   bash benchmarks/gpu/wheels.sh        # after `make install`; .whl is ignored by git here
set -eu
cd "$(dirname "$0")/../.."
NAMES="annotated-types apache-tvm-ffi asgiref cffi cryptography fastapi gguf
googleapis-common-protos grpcio grpcio-health-checking grpcio-tools importlib-resources jiter
jsonschema jsonschema-specifications openai opentelemetry-api opentelemetry-exporter-otlp-common
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
opentelemetry-instrumentation opentelemetry-instrumentation-asgi
opentelemetry-instrumentation-fastapi opentelemetry-instrumentation-grpc opentelemetry-proto
opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-util-http protobuf pycparser
pydantic pydantic-core referencing rpds-py sniffio starlette typing-inspection uvicorn xgrammar"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
pins=$(.venv/bin/python -m pip freeze --disable-pip-version-check | tr '_' '-' | tr 'A-Z' 'a-z')
for name in $NAMES; do
  pin=$(grep -m1 "^$name==" <<< "$pins") || { echo "$name is not installed in .venv" >&2; exit 1; }
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp -d .whl \
    $(printf -- '--platform manylinux_2_%s_x86_64 ' 17 24 27 28 31 34 35) \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$pin"
done
ls .whl | wc -l
