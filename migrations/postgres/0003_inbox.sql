-- The inbox: messages consumed from Kafka (or pushed with InboxService.Receive) for a
-- subscription, deduplicated by (subscription, message_id), handed to the subscriber's
-- handler with the outbox's ordering and retry rules. Same columns as the outbox, so the
-- relay engine and the admin queries run on both, plus the subscription and message id.
CREATE TABLE inbox_events (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription    TEXT        NOT NULL,
    message_id      TEXT        NOT NULL,
    topic           TEXT        NOT NULL,
    event_key       TEXT,
    payload         BYTEA       NOT NULL,
    headers         JSONB       NOT NULL DEFAULT '{}'::jsonb,
    event_type      TEXT,
    idempotency_key TEXT,                       -- the message id again, so StoredEvent carries it
    content_hash    BIGINT,
    status          TEXT        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'completed', 'failed')),
    attempts        INTEGER     NOT NULL DEFAULT 0,
    max_attempts    INTEGER     NOT NULL,
    scheduled_at    TIMESTAMPTZ NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    published_at    TIMESTAMPTZ,                -- handled at
    last_error      TEXT,
    claim_token     BIGINT,
    claimed_until   TIMESTAMPTZ
);
CREATE UNIQUE INDEX inbox_events_dedup ON inbox_events (subscription, message_id);
CREATE INDEX inbox_events_line
    ON inbox_events (subscription, topic, event_key, id) WHERE status = 'pending';
CREATE INDEX inbox_events_unkeyed_due
    ON inbox_events (subscription, scheduled_at, id) WHERE status = 'pending' AND event_key IS NULL;
CREATE INDEX inbox_events_failed ON inbox_events (updated_at) WHERE status = 'failed';

CREATE TABLE inbox_keys (
    subscription TEXT        NOT NULL,
    topic        TEXT        NOT NULL,
    event_key    TEXT        NOT NULL,
    ready_at     TIMESTAMPTZ NOT NULL,
    lease_token  BIGINT,
    lease_until  TIMESTAMPTZ,
    pending      BIGINT      NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription, topic, event_key)
);
CREATE INDEX inbox_keys_ready ON inbox_keys (subscription, ready_at);

-- Pending counts per key, as for the outbox (0002): statement-level, on rows the writing
-- transaction has already locked.
CREATE FUNCTION inbox_keys_count_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE inbox_keys k SET pending = k.pending + d.n
    FROM (SELECT subscription, topic, event_key, count(*) AS n FROM new_rows
          WHERE status = 'pending' AND event_key IS NOT NULL
          GROUP BY subscription, topic, event_key) d
    WHERE k.subscription = d.subscription AND k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;

CREATE FUNCTION inbox_keys_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE inbox_keys k SET pending = k.pending + d.n
    FROM (SELECT n.subscription, n.topic, n.event_key,
                 sum(CASE WHEN n.status = 'pending' THEN 1 ELSE -1 END) AS n
          FROM old_rows o JOIN new_rows n ON n.id = o.id
          WHERE n.event_key IS NOT NULL AND (o.status = 'pending') <> (n.status = 'pending')
          GROUP BY n.subscription, n.topic, n.event_key) d
    WHERE k.subscription = d.subscription AND k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;

CREATE FUNCTION inbox_keys_count_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE inbox_keys k SET pending = k.pending - d.n
    FROM (SELECT subscription, topic, event_key, count(*) AS n FROM old_rows
          WHERE status = 'pending' AND event_key IS NOT NULL
          GROUP BY subscription, topic, event_key) d
    WHERE k.subscription = d.subscription AND k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;

CREATE TRIGGER inbox_events_count_insert AFTER INSERT ON inbox_events
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION inbox_keys_count_insert();
CREATE TRIGGER inbox_events_count_update AFTER UPDATE ON inbox_events
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION inbox_keys_count_update();
CREATE TRIGGER inbox_events_count_delete AFTER DELETE ON inbox_events
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION inbox_keys_count_delete();
