-- The outbox (embedded engine). Times are microseconds since the Unix epoch.
CREATE TABLE outbox_events (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
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

CREATE UNIQUE INDEX outbox_events_idempotency
    ON outbox_events (idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX outbox_events_line
    ON outbox_events (topic, event_key, id) WHERE status = 'pending';
CREATE INDEX outbox_events_unkeyed_due
    ON outbox_events (scheduled_at, id) WHERE status = 'pending' AND event_key IS NULL;
CREATE INDEX outbox_events_failed
    ON outbox_events (updated_at) WHERE status = 'failed';

CREATE TABLE outbox_keys (
    topic       TEXT    NOT NULL,
    event_key   TEXT    NOT NULL,
    ready_at    INTEGER NOT NULL,
    lease_token INTEGER,
    lease_until INTEGER,
    PRIMARY KEY (topic, event_key)
);
CREATE INDEX outbox_keys_ready ON outbox_keys (ready_at);
