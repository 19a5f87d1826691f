#!/usr/bin/env bash
# What a partial index on the keys with a backlog (outbox_keys WHERE pending > 0) would
# cost the enqueue's key upsert (issue 46, item 1: why mailroom finds the backlog through
# the `ready_at` index instead, `Shape::backlog`). An index whose predicate names
# `pending` makes every update of `pending` a non-HOT update; this measures the enqueue's
# own key statement
# (100 keys of 1,000 per transaction, every key already ready with a backlog, so the
# statement changes only `pending`) with pgbench, with and without the index, in
# alternating rounds on a scratch database. Prints each round's transactions per second.
#
# Usage: bench/backlog_index_cost.sh [postgres admin URL] [seconds per round] [rounds]
set -euo pipefail
URL="${1:-postgres://postgres@127.0.0.1:5432/postgres}"
SECS="${2:-15}"
ROUNDS="${3:-3}"
DB="mailroom_bench_backlog_index"
PGBENCH="$(command -v pgbench || ls /usr/lib/postgresql/*/bin/pgbench | sort -V | tail -n1)"
db_url="${URL%/*}/$DB"
psql "$URL" -qc "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
trap 'psql "$URL" -qc "DROP DATABASE IF EXISTS $DB"' EXIT
psql "$db_url" -q <<'SQL'
CREATE TABLE outbox_keys (
    topic TEXT NOT NULL, event_key TEXT NOT NULL, ready_at TIMESTAMPTZ NOT NULL,
    lease_token BIGINT, lease_until TIMESTAMPTZ, pending BIGINT NOT NULL DEFAULT 0,
    published_through BIGINT NOT NULL DEFAULT 0, PRIMARY KEY (topic, event_key));
CREATE INDEX outbox_keys_ready ON outbox_keys (ready_at);
INSERT INTO outbox_keys (topic, event_key, ready_at, pending)
SELECT 'orders', 'key-' || i, now() - interval '1 minute', 5 FROM generate_series(0, 999) i;
VACUUM ANALYZE outbox_keys;
SQL
script="$(mktemp)"
cat > "$script" <<'SQL'
\set first random(0, 899)
INSERT INTO outbox_keys (topic, event_key, ready_at, pending)
SELECT 'orders', 'key-' || (:first + i), now(), 1 FROM generate_series(0, 99) i
ON CONFLICT (topic, event_key)
DO UPDATE SET ready_at = LEAST(outbox_keys.ready_at, EXCLUDED.ready_at),
              pending = outbox_keys.pending + EXCLUDED.pending;
SQL
for round in $(seq 1 "$ROUNDS"); do
  for variant in without with; do
    if [ "$variant" = with ]; then
      psql "$db_url" -qc "CREATE INDEX IF NOT EXISTS outbox_keys_backlog ON outbox_keys (topic, event_key) WHERE pending > 0"
    else
      psql "$db_url" -qc "DROP INDEX IF EXISTS outbox_keys_backlog"
    fi
    psql "$db_url" -qc "VACUUM outbox_keys" -c "SELECT pg_stat_reset()" >/dev/null
    tps="$("$PGBENCH" -n -f "$script" -c 4 -j 2 -T "$SECS" "$db_url" 2>/dev/null | awk '/^tps/ {print $3; exit}')"
    sleep 1
    hot="$(psql "$db_url" -qAtc "SELECT round(100.0 * n_tup_hot_upd / greatest(n_tup_upd, 1)) FROM pg_stat_user_tables WHERE relname = 'outbox_keys'")"
    echo "round $round, $variant the backlog index: $tps transactions/s (100 keys each), HOT updates $hot %"
  done
done
rm -f "$script"
