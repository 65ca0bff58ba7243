#!/usr/bin/env bash
# Linters CI runs (.ci/run): ruff over the repository and mypy --strict over epp/.
# Any finding fails. Settings are in pyproject.toml ([tool.ruff], [tool.mypy]).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup-venv.sh"
cd "$root"
"$root/.venv/bin/ruff" check .
"$root/.venv/bin/mypy" epp
