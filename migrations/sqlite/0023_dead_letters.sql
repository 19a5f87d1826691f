-- Dead letters; see migrations/postgres/0023_dead_letters.sql. Times are microseconds
-- since the Unix epoch.
CREATE TABLE mailroom_dead_letters (
    box       TEXT    NOT NULL CHECK (box IN ('outbox', 'inbox')),
    event_id  INTEGER NOT NULL,
    failed_at INTEGER NOT NULL,
    PRIMARY KEY (box, event_id, failed_at)
);

CREATE TRIGGER outbox_events_dead_letter AFTER UPDATE OF status ON outbox_events
WHEN NEW.status = 'failed' AND OLD.status <> 'failed'
BEGIN
    INSERT OR IGNORE INTO mailroom_dead_letters (box, event_id, failed_at)
    VALUES ('outbox', NEW.id, NEW.updated_at);
END;

CREATE TRIGGER inbox_events_dead_letter AFTER UPDATE OF status ON inbox_events
WHEN NEW.status = 'failed' AND OLD.status <> 'failed'
BEGIN
    INSERT OR IGNORE INTO mailroom_dead_letters (box, event_id, failed_at)
    VALUES ('inbox', NEW.id, NEW.updated_at);
END;

CREATE TRIGGER inbox_events_dead_letter_insert AFTER INSERT ON inbox_events
WHEN NEW.status = 'failed'
BEGIN
    INSERT OR IGNORE INTO mailroom_dead_letters (box, event_id, failed_at)
    VALUES ('inbox', NEW.id, NEW.updated_at);
END;

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (23, 22);
