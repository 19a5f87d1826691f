#!/usr/bin/env bash
# vendor/sqlx-core must be sqlx-core 0.9.0 from crates.io with exactly the documented patch
# (Cargo.toml, [patch.crates-io]: TCP_NODELAY in src/net/socket/mod.rs). Downloads the
# release from crates.io, compares it with the vendored copy, and fails on any other
# difference, so the patched crate cannot drift unseen (issue 25, item 5).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$here/vendor/sqlx-core/Cargo.toml" | head -1)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
curl -sSfL --retry 3 -o "$tmp/c.crate" "https://static.crates.io/crates/sqlx-core/sqlx-core-$version.crate"
tar xzf "$tmp/c.crate" -C "$tmp"
upstream="$tmp/sqlx-core-$version"
# Packaging files crates.io adds are not vendored.
rm -f "$upstream/.cargo_vcs_info.json" "$upstream/Cargo.lock" "$upstream/Cargo.toml.orig"
changed="$(diff -rq "$upstream" "$here/vendor/sqlx-core" | sed "s|$upstream|upstream|; s|$here/||" || true)"
expected="Files upstream/src/net/socket/mod.rs and vendor/sqlx-core/src/net/socket/mod.rs differ"
if [ "$changed" != "$expected" ]; then
  echo "vendor/sqlx-core differs from sqlx-core $version beyond the documented patch:" >&2
  echo "$changed" >&2
  exit 1
fi
# The one changed file: only the nodelay lines and their comment.
added="$(diff "$upstream/src/net/socket/mod.rs" "$here/vendor/sqlx-core/src/net/socket/mod.rs" | grep '^>' || true)"
if ! grep -q 'set_nodelay(true)' <<<"$added" || [ "$(wc -l <<<"$added")" -gt 5 ]; then
  echo "vendor/sqlx-core/src/net/socket/mod.rs: the change is not the documented nodelay patch:" >&2
  echo "$added" >&2
  exit 1
fi
echo "vendor/sqlx-core = sqlx-core $version + the documented nodelay patch"
