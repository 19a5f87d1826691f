#!/usr/bin/env bash
# Prints the path of a buf binary: $BUF, else buf on PATH, else the one npm installs into
# .work/buf (installed here when missing). Used by scripts/test.sh and scripts/gen-stubs.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${BUF:-}" ]; then echo "$BUF"; exit 0; fi
if command -v buf >/dev/null 2>&1; then command -v buf; exit 0; fi
# Pinned (issue 26, item 10); reinstalled when another version is there.
BUF_VERSION=1.75.0
if [ ! -x .work/buf/node_modules/.bin/buf ] \
   || ! grep -q "\"version\": \"$BUF_VERSION\"" .work/buf/node_modules/@bufbuild/buf/package.json 2>/dev/null; then
  mkdir -p .work/buf
  (cd .work/buf && npm install --silent --no-audit --no-fund "@bufbuild/buf@$BUF_VERSION" >/dev/null)
fi
echo "$PWD/.work/buf/node_modules/.bin/buf"
