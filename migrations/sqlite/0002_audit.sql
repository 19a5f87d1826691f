-- Operator surface (issue 4): the audit log of requeues and cancels, and a per-key count
-- of pending events (kept exact by triggers) so that ListPending never aggregates the
-- whole backlog. Times are microseconds since the Unix epoch.

CREATE TABLE admin_audit (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    at        INTEGER NOT NULL,
    actor     TEXT    NOT NULL,
    action    TEXT    NOT NULL,
    box       TEXT    NOT NULL,
    selection TEXT    NOT NULL,
    count     INTEGER NOT NULL
);

ALTER TABLE outbox_keys ADD COLUMN pending INTEGER NOT NULL DEFAULT 0;

UPDATE outbox_keys SET pending = (
    SELECT count(*) FROM outbox_events e
    WHERE e.status = 'pending' AND e.topic = outbox_keys.topic
      AND e.event_key = outbox_keys.event_key);

CREATE TRIGGER outbox_events_count_insert AFTER INSERT ON outbox_events
    WHEN NEW.status = 'pending' AND NEW.event_key IS NOT NULL
BEGIN
    UPDATE outbox_keys SET pending = pending + 1
    WHERE topic = NEW.topic AND event_key = NEW.event_key;
END;

CREATE TRIGGER outbox_events_count_update AFTER UPDATE OF status ON outbox_events
    WHEN NEW.event_key IS NOT NULL AND (OLD.status = 'pending') <> (NEW.status = 'pending')
BEGIN
    UPDATE outbox_keys SET pending = pending + (CASE WHEN NEW.status = 'pending' THEN 1 ELSE -1 END)
    WHERE topic = NEW.topic AND event_key = NEW.event_key;
END;

CREATE TRIGGER outbox_events_count_delete AFTER DELETE ON outbox_events
    WHEN OLD.status = 'pending' AND OLD.event_key IS NOT NULL
BEGIN
    UPDATE outbox_keys SET pending = pending - 1
    WHERE topic = OLD.topic AND event_key = OLD.event_key;
END;
