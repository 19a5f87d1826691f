-- Retention (issue 7): completed events are deleted in batches, oldest publication first.
-- A plain CREATE INDEX, in the migration's transaction: CREATE INDEX CONCURRENTLY cannot
-- run while other replicas wait for the migration lock (it waits for their snapshots and
-- they wait for it: a deadlock when replicas start together). To add it to a large
-- existing outbox without blocking enqueues, create it CONCURRENTLY by hand before the
-- upgrade; IF NOT EXISTS then makes this a no-op.
CREATE INDEX IF NOT EXISTS outbox_events_completed
    ON outbox_events (published_at) WHERE status = 'completed';
