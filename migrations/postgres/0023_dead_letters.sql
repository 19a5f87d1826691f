-- Dead letters (issue 44, item 3; docs/operations.md, "Dead-letter topics").
--
-- Every event that becomes `failed` (out of attempts, cancelled, or an inbox message
-- stored failed) leaves a row here, written by a trigger in the transaction that failed
-- it, so a failure is never missed by a process that crashes after its commit. The
-- service's dead-letter pump reads the rows, enqueues a copy of each event whose topic
-- (outbox) or subscription (inbox) has a dead-letter topic as an ordinary outbox event of
-- that topic (retried with attempts of its own, never the original's), and deletes the
-- rows, those of topics without a dead-letter topic too. `failed_at` tells two failures
-- of one event apart (a requeued event that fails again is dead-lettered again).
--
-- Additive (min_binary_schema stays 22): an older binary's failures leave rows the
-- newer binaries' pumps handle.
CREATE TABLE mailroom_dead_letters (
    box       TEXT        NOT NULL CHECK (box IN ('outbox', 'inbox')),
    event_id  BIGINT      NOT NULL,
    failed_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (box, event_id, failed_at)
);

DO $migration$
DECLARE
    mr  text := (SELECT quote_ident(n.nspname) || '.' FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE c.oid = 'outbox_events'::regclass);
    src text;
BEGIN
    FOREACH src IN ARRAY ARRAY[
$src$
CREATE FUNCTION @mr.mailroom_dead_letter() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO @mr.mailroom_dead_letters (box, event_id, failed_at)
    VALUES (TG_ARGV[0], NEW.id, NEW.updated_at)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$
$src$,
$src$
CREATE TRIGGER outbox_events_dead_letter AFTER UPDATE OF status ON @mr.outbox_events
FOR EACH ROW WHEN (NEW.status = 'failed' AND OLD.status IS DISTINCT FROM 'failed')
EXECUTE FUNCTION @mr.mailroom_dead_letter('outbox')
$src$,
$src$
CREATE TRIGGER inbox_events_dead_letter AFTER UPDATE OF status ON @mr.inbox_events
FOR EACH ROW WHEN (NEW.status = 'failed' AND OLD.status IS DISTINCT FROM 'failed')
EXECUTE FUNCTION @mr.mailroom_dead_letter('inbox')
$src$,
$src$
CREATE TRIGGER inbox_events_dead_letter_insert AFTER INSERT ON @mr.inbox_events
FOR EACH ROW WHEN (NEW.status = 'failed')
EXECUTE FUNCTION @mr.mailroom_dead_letter('inbox')
$src$,
$src$
REVOKE ALL ON FUNCTION @mr.mailroom_dead_letter() FROM PUBLIC
$src$
    ] LOOP
        EXECUTE replace(src, '@mr.', mr);
    END LOOP;
END $migration$;

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (23, 22);
