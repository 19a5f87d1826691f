-- no-transaction
-- The keys with a backlog (issue 46, item 1): GetStats, ListPending and the readiness
-- lag check read `outbox_keys WHERE pending > 0`, which scanned every key row (47-50 ms
-- at 1,000,000 keys, toward the 5 s check limit under lease-update bloat). This index
-- holds only the keys with a backlog, so those reads follow the backlog, not the
-- history. Built CONCURRENTLY (docs/storage.md, "Writing a migration"); additive, so
-- it inserts no compatibility row (a no-transaction migration holds this one
-- statement).
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_keys_backlog
    ON outbox_keys (topic, event_key) WHERE pending > 0;
