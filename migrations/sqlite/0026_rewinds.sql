-- Rewinding a subscription to a time; see migrations/postgres/0026_rewinds.sql. Times are
-- microseconds since the Unix epoch.
CREATE TABLE inbox_rewinds (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    subscription TEXT    NOT NULL,
    to_time      INTEGER NOT NULL,
    redeliver    INTEGER NOT NULL,
    actor        TEXT    NOT NULL,
    principal    TEXT,
    request_id   TEXT,
    created_at   INTEGER NOT NULL
);

CREATE UNIQUE INDEX inbox_rewinds_request ON inbox_rewinds (subscription, request_id)
    WHERE request_id IS NOT NULL;
CREATE INDEX inbox_rewinds_subscription ON inbox_rewinds (subscription, created_at);

CREATE TABLE inbox_rewind_partitions (
    rewind_id    INTEGER NOT NULL REFERENCES inbox_rewinds (id) ON DELETE CASCADE,
    topic        TEXT    NOT NULL,
    kafka_partition INTEGER NOT NULL,
    from_offset  INTEGER NOT NULL,
    until_offset INTEGER NOT NULL,
    applied_at   INTEGER,
    PRIMARY KEY (rewind_id, topic, kafka_partition)
);

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (26, 22);
