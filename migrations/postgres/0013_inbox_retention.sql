-- Retention of the inbox (src/store/postgres/retention.rs): completed messages are deleted
-- oldest first by when they were handled, as the outbox's are (0004). Additive: an older
-- binary ignores the index.
CREATE INDEX IF NOT EXISTS inbox_events_completed
    ON inbox_events (published_at) WHERE status = 'completed';
