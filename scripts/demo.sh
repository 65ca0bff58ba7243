#!/usr/bin/env bash
# The local stack: real Envoy + simulated model servers + the EPP, with a short demo load.
# Extra arguments go to `epp demo` (see `epp demo --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-venv.sh"
exec "$root/.venv/bin/epp" demo "$@"
