-- Paused topics (issue 28, item 1; docs/admin.md, "Pausing a topic"). While a topic has a
-- row here, relays claim none of its outbox events: they stay pending, spend no attempt,
-- and go out in order after the resume. Enqueues are still accepted and stored.
--
-- Requires this schema of every binary (min_binary_schema 17): an older binary does not
-- read this table and would go on publishing a paused topic, so during a rolling upgrade
-- the older replicas stop relaying (they keep storing enqueues) until they are replaced.
CREATE TABLE outbox_paused_topics (
    topic     TEXT        PRIMARY KEY,
    reason    TEXT        NOT NULL,
    actor     TEXT        NOT NULL,
    principal TEXT,
    paused_at TIMESTAMPTZ NOT NULL
);

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (17, 17);
