-- no-transaction
-- Retention (issue 7): completed events are deleted in batches, oldest publication first.
-- Built CONCURRENTLY so that adding it to a large outbox does not block enqueues; the
-- file runs outside a transaction for that reason (and IF NOT EXISTS makes a retry after
-- an interrupted build harmless once the invalid index is dropped).
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_completed
    ON outbox_events (published_at) WHERE status = 'completed';
