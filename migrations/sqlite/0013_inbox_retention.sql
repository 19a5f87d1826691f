-- Retention of the inbox; see migrations/postgres/0013_inbox_retention.sql.
CREATE INDEX IF NOT EXISTS inbox_events_completed
    ON inbox_events (published_at) WHERE status = 'completed';
