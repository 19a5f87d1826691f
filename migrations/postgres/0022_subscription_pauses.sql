-- Paused inbox subscriptions (issue 44, item 2; docs/admin.md, "Pausing a subscription").
-- While a subscription has a row here, its dispatchers claim none of its messages: they
-- stay pending, spend no attempt, and are handed to the handler in key order after the
-- resume. The consumer goes on storing what the broker delivers (up to the inbox limits).
--
-- Requires this schema of every binary (min_binary_schema 22), as 0017 did for topics: an
-- older binary does not read this table and would go on dispatching a paused
-- subscription, so during a rolling upgrade the older replicas stop relaying and
-- dispatching (they keep storing) until they are replaced.
CREATE TABLE inbox_paused_subscriptions (
    subscription TEXT        PRIMARY KEY,
    reason       TEXT        NOT NULL,
    actor        TEXT        NOT NULL,
    principal    TEXT,
    paused_at    TIMESTAMPTZ NOT NULL
);

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (22, 22);
