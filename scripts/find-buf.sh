#!/usr/bin/env bash
# Prints the path of a buf binary: $BUF, else buf on PATH, else the one npm installs into
# .work/buf (installed here when missing). Used by scripts/test.sh and scripts/gen-stubs.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${BUF:-}" ]; then echo "$BUF"; exit 0; fi
if command -v buf >/dev/null 2>&1; then command -v buf; exit 0; fi
if [ ! -x .work/buf/node_modules/.bin/buf ]; then
  mkdir -p .work/buf
  (cd .work/buf && npm install --silent --no-audit --no-fund @bufbuild/buf >/dev/null)
fi
echo "$PWD/.work/buf/node_modules/.bin/buf"
