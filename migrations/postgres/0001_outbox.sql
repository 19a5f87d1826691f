-- The outbox: every accepted event, and one row per (topic, key) that orders them.
CREATE TABLE outbox_events (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic           TEXT        NOT NULL,
    event_key       TEXT,                       -- NULL: unordered
    payload         BYTEA       NOT NULL,
    headers         JSONB       NOT NULL DEFAULT '{}'::jsonb,
    event_type      TEXT,
    idempotency_key TEXT,
    content_hash    BIGINT,                     -- fingerprint, compared on idempotent retries
    status          TEXT        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'completed', 'failed')),
    attempts        INTEGER     NOT NULL DEFAULT 0,
    max_attempts    INTEGER     NOT NULL,
    scheduled_at    TIMESTAMPTZ NOT NULL,       -- next attempt (or deliver_after)
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    published_at    TIMESTAMPTZ,
    last_error      TEXT,
    -- Claims of unkeyed events; keyed events are claimed through outbox_keys.
    claim_token     BIGINT,
    claimed_until   TIMESTAMPTZ
);

CREATE UNIQUE INDEX outbox_events_idempotency
    ON outbox_events (idempotency_key) WHERE idempotency_key IS NOT NULL;
-- A key's line, in acceptance order: the relay reads the front of it, the admin groups by it.
CREATE INDEX outbox_events_line
    ON outbox_events (topic, event_key, id) WHERE status = 'pending';
-- Due unkeyed events.
CREATE INDEX outbox_events_unkeyed_due
    ON outbox_events (scheduled_at, id) WHERE status = 'pending' AND event_key IS NULL;
-- Failed events, for the operator's requeue filters.
CREATE INDEX outbox_events_failed
    ON outbox_events (updated_at) WHERE status = 'failed';

CREATE TABLE outbox_keys (
    topic       TEXT        NOT NULL,
    event_key   TEXT        NOT NULL,
    -- Earliest time the key may have something to publish ('infinity' when idle).
    -- A lower bound: waking a key early costs one look, never a lost event.
    ready_at    TIMESTAMPTZ NOT NULL,
    lease_token BIGINT,
    lease_until TIMESTAMPTZ,
    PRIMARY KEY (topic, event_key)
);
CREATE INDEX outbox_keys_ready ON outbox_keys (ready_at);
