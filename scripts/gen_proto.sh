#!/usr/bin/env bash
# Regenerate gateway/proto/inference_pb2.py and .pyi from gateway/proto/inference.proto.
#
# The output is checked in, so `pip install .` needs no protobuf compiler; only a
# change to the .proto calls for this script (grpcio-tools is in the `dev` extra).
# Its version decides the gencode's protobuf version, which is the floor of the protobuf
# runtimes the modules load under: grpcio-tools 1.72 emits 6.30.0, which protobuf 6.30+
# and 7.x both accept (pyproject.toml's bound says why that floor).
# tests/gateway/test_proto.py runs it into a temporary folder and fails when the
# checked-in output differs.
#
# The .proto is compiled as `ipuserve/oip/inference.proto`, the name it is registered
# under in protobuf's process-wide descriptor pool: a bare `inference.proto` could
# collide with another library's file of that name.
#
# Usage: scripts/gen_proto.sh [OUTPUT_DIR]   (default: gateway/proto)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/gateway/proto}"
python="${PYTHON:-python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src/ipuserve/oip" "$work/out"
cp "$root/gateway/proto/inference.proto" "$work/src/ipuserve/oip/inference.proto"
"$python" -m grpc_tools.protoc -I "$work/src" \
    --python_out="$work/out" --pyi_out="$work/out" \
    "$work/src/ipuserve/oip/inference.proto"
mkdir -p "$out"
cp "$work/out/ipuserve/oip/inference_pb2.py" "$work/out/ipuserve/oip/inference_pb2.pyi" "$out/"
