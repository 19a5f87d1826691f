-- Operator surface (issue 4): the audit log of requeues and cancels, and a per-key count
-- of pending events so that ListPending and GetStats never aggregate the whole backlog.

CREATE TABLE admin_audit (
    id        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor     TEXT        NOT NULL,
    action    TEXT        NOT NULL,            -- 'requeue' | 'cancel'
    box       TEXT        NOT NULL,            -- 'outbox' | 'inbox'
    selection JSONB       NOT NULL,            -- the ids or the filter, as asked
    count     BIGINT      NOT NULL
);

-- Pending events of each key, kept exact by statement-level triggers (one grouped
-- UPDATE per statement, on key rows the writing transaction has already locked: enqueue
-- and settle lock their keys first, requeue and cancel too). Unkeyed events have no key
-- row and are counted from their own index.
ALTER TABLE outbox_keys ADD COLUMN pending BIGINT NOT NULL DEFAULT 0;

UPDATE outbox_keys k SET pending = c.n
FROM (SELECT topic, event_key, count(*) AS n FROM outbox_events
      WHERE status = 'pending' AND event_key IS NOT NULL GROUP BY topic, event_key) c
WHERE k.topic = c.topic AND k.event_key = c.event_key;

CREATE FUNCTION outbox_keys_count_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox_keys k SET pending = k.pending + d.n
    FROM (SELECT topic, event_key, count(*) AS n FROM new_rows
          WHERE status = 'pending' AND event_key IS NOT NULL GROUP BY topic, event_key) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;

CREATE FUNCTION outbox_keys_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox_keys k SET pending = k.pending + d.n
    FROM (SELECT n.topic, n.event_key,
                 sum(CASE WHEN n.status = 'pending' THEN 1 ELSE -1 END) AS n
          FROM old_rows o JOIN new_rows n ON n.id = o.id
          WHERE n.event_key IS NOT NULL AND (o.status = 'pending') <> (n.status = 'pending')
          GROUP BY n.topic, n.event_key) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;

CREATE FUNCTION outbox_keys_count_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox_keys k SET pending = k.pending - d.n
    FROM (SELECT topic, event_key, count(*) AS n FROM old_rows
          WHERE status = 'pending' AND event_key IS NOT NULL GROUP BY topic, event_key) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_events_count_insert AFTER INSERT ON outbox_events
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_keys_count_insert();
CREATE TRIGGER outbox_events_count_update AFTER UPDATE ON outbox_events
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_keys_count_update();
CREATE TRIGGER outbox_events_count_delete AFTER DELETE ON outbox_events
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_keys_count_delete();
