-- Identity (issue 11); see migrations/postgres/0006_identity.sql.
CREATE TABLE mailroom_installation (
    singleton       INTEGER PRIMARY KEY CHECK (singleton = 1),
    installation_id TEXT    NOT NULL,
    created_at      INTEGER NOT NULL
);
-- A random (version 4) UUID.
INSERT INTO mailroom_installation (singleton, installation_id, created_at)
SELECT 1,
       substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-4' || substr(h, 14, 3) || '-'
       || substr('89ab', 1 + (abs(random()) % 4), 1) || substr(h, 18, 3) || '-' || substr(h, 21, 12),
       CAST(strftime('%s', 'now') AS INTEGER) * 1000000
FROM (SELECT lower(hex(randomblob(16))) AS h);

-- Inbox dedup ids move into namespaces, as on PostgreSQL. SQLite has no SHA-256: ids over
-- 512 bytes keep their plain form here (SQLite has no index row limit); a redelivery of
-- such a record after the upgrade is not recognised as a duplicate.
DROP INDEX inbox_events_dedup;

UPDATE inbox_events
SET message_id = CASE
        WHEN json_extract(headers, '$.ce_id') IS NOT NULL
             AND json_extract(headers, '$.ce_id') = message_id THEN
            'ce:' || length(CAST(coalesce(json_extract(headers, '$.ce_source'), '') AS BLOB)) || ':'
                  || coalesce(json_extract(headers, '$.ce_source'), '') || ':' || message_id
        WHEN substr(message_id, 1, length(topic) + 1) = topic || ':'
             AND substr(message_id, length(topic) + 2) GLOB '[0-9]*:[0-9]*'
             AND substr(message_id, length(topic) + 2) NOT GLOB '*[^0-9:]*'
             AND substr(message_id, length(topic) + 2) NOT GLOB '*:*:*' THEN
            'kafka:' || message_id
        ELSE 'rpc:' || message_id
    END;
UPDATE inbox_events SET idempotency_key = message_id;

CREATE UNIQUE INDEX inbox_events_dedup ON inbox_events (subscription, message_id);
