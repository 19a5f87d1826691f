-- Retention (issue 7): completed events are deleted in batches, oldest publication first.
CREATE INDEX IF NOT EXISTS outbox_events_completed
    ON outbox_events (published_at) WHERE status = 'completed';
