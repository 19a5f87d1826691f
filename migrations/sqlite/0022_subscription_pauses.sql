-- Paused inbox subscriptions; see migrations/postgres/0022_subscription_pauses.sql. Times
-- are microseconds since the Unix epoch.
CREATE TABLE inbox_paused_subscriptions (
    subscription TEXT    PRIMARY KEY,
    reason       TEXT    NOT NULL,
    actor        TEXT    NOT NULL,
    principal    TEXT,
    paused_at    INTEGER NOT NULL
);

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (22, 22);
