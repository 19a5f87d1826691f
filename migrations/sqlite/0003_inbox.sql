-- The inbox (embedded engine); see migrations/postgres/0003_inbox.sql.
CREATE TABLE inbox_events (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    subscription    TEXT    NOT NULL,
    message_id      TEXT    NOT NULL,
    topic           TEXT    NOT NULL,
    event_key       TEXT,
    payload         BLOB    NOT NULL,
    headers         TEXT    NOT NULL DEFAULT '{}',
    event_type      TEXT,
    idempotency_key TEXT,
    content_hash    INTEGER,
    status          TEXT    NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'completed', 'failed')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    max_attempts    INTEGER NOT NULL,
    scheduled_at    INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    published_at    INTEGER,
    last_error      TEXT,
    claim_token     INTEGER,
    claimed_until   INTEGER
);
CREATE UNIQUE INDEX inbox_events_dedup ON inbox_events (subscription, message_id);
CREATE INDEX inbox_events_line
    ON inbox_events (subscription, topic, event_key, id) WHERE status = 'pending';
CREATE INDEX inbox_events_unkeyed_due
    ON inbox_events (subscription, scheduled_at, id) WHERE status = 'pending' AND event_key IS NULL;
CREATE INDEX inbox_events_failed ON inbox_events (updated_at) WHERE status = 'failed';

CREATE TABLE inbox_keys (
    subscription TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    event_key    TEXT    NOT NULL,
    ready_at     INTEGER NOT NULL,
    lease_token  INTEGER,
    lease_until  INTEGER,
    pending      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription, topic, event_key)
);
CREATE INDEX inbox_keys_ready ON inbox_keys (subscription, ready_at);

CREATE TRIGGER inbox_events_count_insert AFTER INSERT ON inbox_events
    WHEN NEW.status = 'pending' AND NEW.event_key IS NOT NULL
BEGIN
    UPDATE inbox_keys SET pending = pending + 1
    WHERE subscription = NEW.subscription AND topic = NEW.topic AND event_key = NEW.event_key;
END;

CREATE TRIGGER inbox_events_count_update AFTER UPDATE OF status ON inbox_events
    WHEN NEW.event_key IS NOT NULL AND (OLD.status = 'pending') <> (NEW.status = 'pending')
BEGIN
    UPDATE inbox_keys SET pending = pending + (CASE WHEN NEW.status = 'pending' THEN 1 ELSE -1 END)
    WHERE subscription = NEW.subscription AND topic = NEW.topic AND event_key = NEW.event_key;
END;

CREATE TRIGGER inbox_events_count_delete AFTER DELETE ON inbox_events
    WHEN OLD.status = 'pending' AND OLD.event_key IS NOT NULL
BEGIN
    UPDATE inbox_keys SET pending = pending - 1
    WHERE subscription = OLD.subscription AND topic = OLD.topic AND event_key = OLD.event_key;
END;
