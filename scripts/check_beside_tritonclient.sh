#!/usr/bin/env bash
# ipuserve installs beside the newest tritonclient, and its gateway starts under both
# protobuf runtime majors its gencode allows (pyproject.toml says why 6.30 to 7.x):
#
#   1. `pip install .` in a fresh venv (protobuf: the newest, 7.x): the gateway starts;
#   2. then `pip install "tritonclient[http,grpc]"` (which holds protobuf below 7, so
#      pip moves it back to 6.x): tritonclient is at least the floor, and the gateway
#      still starts and imports next to tritonclient's own modules.
#
# "Starts": `ipuserve gateway` prints its start line (its doors bound, the gRPC
# messages loaded) with a broker that need not exist. ~1 minute (two installs).
# Usage: scripts/check_beside_tritonclient.sh   (.ci/run runs it)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
floor="$(cat "$root/.ci/tritonclient-floor")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"

starts() {  # the gateway's start line within 60 s, then SIGTERM
    local line
    line="$(timeout 60 "$py" - <<'PY'
import subprocess, sys
argv = [sys.executable, "-m", "ipuserve", "gateway", "--broker", "tcp://127.0.0.1:9",
        "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]
with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
    for line in p.stdout:
        if line.startswith("ipuserve gateway: "):
            print(line.strip())
            p.terminate()
            break
    else:
        sys.exit(f"no start line; exit {p.wait()}")
    sys.exit(p.wait())
PY
)"
    echo "protobuf $("$py" -c 'import google.protobuf as p; print(p.__version__)'): $line"
}

"$py" -m pip install --quiet "$root"
starts
"$py" -m pip install --quiet "tritonclient[http,grpc]"
"$py" - "$floor" <<'PY'
import sys
from importlib.metadata import version
import tritonclient.grpc, tritonclient.http  # noqa: F401  next to ipuserve's modules
from ipuserve.gateway.proto import inference_pb2  # noqa: F401
got, floor = version("tritonclient"), sys.argv[1]
if tuple(map(int, got.split(".")[:2])) < tuple(map(int, floor.split(".")[:2])):
    sys.exit(f"pip picked tritonclient {got}, older than {floor} (.ci/tritonclient-floor)")
print(f"tritonclient {got} (floor {floor})")
PY
starts
