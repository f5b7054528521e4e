#!/usr/bin/env bash
# Renders the architecture picture from its text source: docs/architecture.dot ->
# docs/img/architecture.svg (committed; README.md and docs/index.md show it).
# Needs Graphviz's `dot` (apt-get install graphviz).
set -euo pipefail
cd "$(dirname "$0")/.."
dot -Tsvg docs/architecture.dot -o docs/img/architecture.svg
echo "wrote docs/img/architecture.svg"
