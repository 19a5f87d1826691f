-- Paused topics; see migrations/postgres/0017_topic_pauses.sql. Times are microseconds
-- since the Unix epoch.
CREATE TABLE outbox_paused_topics (
    topic     TEXT    PRIMARY KEY,
    reason    TEXT    NOT NULL,
    actor     TEXT    NOT NULL,
    principal TEXT,
    paused_at INTEGER NOT NULL
);

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (17, 17);
