#!/usr/bin/env bash
# Stubs for callers in other languages: installs the local protoc plugins buf.gen.yaml
# names (when they are missing) and runs `buf generate`.
#
#   scripts/gen-stubs.sh                 install what is missing, generate into gen/
#   scripts/gen-stubs.sh OUT_DIR         ... generate into OUT_DIR/gen/ instead
#   scripts/gen-stubs.sh --install-only  install what is missing, generate nothing
#
# Plugins: protoc and grpc_python_plugin, grpc_java_plugin, protoc-gen-go,
# protoc-gen-go-grpc from Debian (apt-get); ts-proto and typescript from npm, pinned by
# scripts/protoc-plugins/package-lock.json, into .work/stubs; buf from npm into
# .work/buf unless BUF names one or buf is on PATH (as scripts/test.sh finds it).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

install_only=0
out=""
for arg in "$@"; do
  case "$arg" in
    --install-only) install_only=1 ;;
    -*) echo "unknown option: $arg" >&2; exit 64 ;;
    *) out="$arg" ;;
  esac
done

# Debian packages, by the command each provides.
missing=()
declare -A provider=(
  [protoc]=protobuf-compiler
  [grpc_python_plugin]=protobuf-compiler-grpc
  [grpc_java_plugin]=protobuf-compiler-grpc-java-plugin
  [protoc-gen-go]=protoc-gen-go
  [protoc-gen-go-grpc]=protoc-gen-go-grpc
)
for cmd in "${!provider[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${provider[$cmd]}")
done
if [ "${#missing[@]}" -gt 0 ]; then
  scripts/need-debs.sh "${missing[@]}"
fi

# npm plugins: reinstalled when the committed lock file changes.
stubs="$root/.work/stubs"
if [ ! -x "$stubs/node_modules/.bin/protoc-gen-ts_proto" ] \
  || ! cmp -s scripts/protoc-plugins/package-lock.json "$stubs/package-lock.json"; then
  echo "installing: ts-proto, typescript (npm, into .work/stubs)" >&2
  mkdir -p "$stubs"
  cp scripts/protoc-plugins/package.json scripts/protoc-plugins/package-lock.json "$stubs/"
  (cd "$stubs" && npm ci --silent --no-audit --no-fund --prefer-offline >/dev/null)
fi

BUF="$("$root/scripts/find-buf.sh")"

[ "$install_only" -eq 1 ] && exit 0

export PATH="$stubs/node_modules/.bin:$PATH"
if [ -n "$out" ]; then
  mkdir -p "$out"
  "$BUF" generate --template buf.gen.yaml -o "$out"
  echo "generated: $out/gen/{python,go,java,ts}" >&2
else
  "$BUF" generate --template buf.gen.yaml
  echo "generated: gen/{python,go,java,ts}" >&2
fi
