#!/usr/bin/env bash
# Run the whole test suite (unit + integration with real Envoy). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-venv.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
