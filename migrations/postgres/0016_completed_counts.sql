-- Completed events counted as they complete (issue 24, item 3; docs/admin.md, "Cost").
--
-- Status is computed from the per-key cursor (0011), so counting completed events meant
-- walking every retained row through `outbox_events_view`: GetStats took seconds at a
-- million retained events. Now each way an event becomes, or stops being, completed
-- adds to a counter of its topic:
-- - a row's status changes to or from 'completed' (relay settles, requeue's rewrite of
--   rows a cursor passed), or such a row is deleted (retention): the outbox_events
--   triggers below;
-- - a cursor advance is logged, or its log row is deleted with its events (retention,
--   pruning, requeue): the outbox_publishes triggers, with the row's `events`.
-- Each backend adds to a row of its own (`shard` = its pid), so concurrent relays never
-- wait for one another; retention folds the rows of other backends into shard 0. SQL-API
-- callers store pending events only, so they never touch a counter. Pending events are
-- counted per key (outbox_keys.pending) and failed ones through their partial index.
CREATE TABLE outbox_completed_counts (
    topic TEXT    NOT NULL,
    shard INTEGER NOT NULL,
    n     BIGINT  NOT NULL,
    PRIMARY KEY (topic, shard)
);

INSERT INTO outbox_completed_counts (topic, shard, n)
SELECT topic, 0, count(*) FROM outbox_events_view WHERE status = 'completed' GROUP BY topic;

CREATE FUNCTION outbox_completed_add(p_topics text[], p_n bigint[]) RETURNS void
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
INSERT INTO outbox_completed_counts AS c (topic, shard, n)
SELECT t, pg_backend_pid(), d FROM unnest(p_topics, p_n) AS u(t, d)
WHERE d <> 0
ORDER BY t COLLATE "C"
ON CONFLICT (topic, shard) DO UPDATE SET n = c.n + EXCLUDED.n
$$;

CREATE FUNCTION outbox_completed_count_update() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM outbox_completed_add(array_agg(topic), array_agg(d))
    FROM (SELECT topic, sum(d) AS d
          FROM (SELECT topic, 1 AS d FROM new_rows WHERE status = 'completed'
                UNION ALL
                SELECT topic, -1 FROM old_rows WHERE status = 'completed') x
          GROUP BY topic) g
    HAVING count(*) > 0;
    RETURN NULL;
END $$;

CREATE FUNCTION outbox_completed_count_delete() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM outbox_completed_add(array_agg(topic), array_agg(-n))
    FROM (SELECT topic, count(*) AS n FROM old_rows WHERE status = 'completed'
          GROUP BY topic) g
    HAVING count(*) > 0;
    RETURN NULL;
END $$;

CREATE FUNCTION outbox_completed_count_logged() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM outbox_completed_add(array_agg(topic), array_agg(n))
        FROM (SELECT topic, sum(events)::bigint AS n FROM new_rows GROUP BY topic) g
        HAVING count(*) > 0;
    ELSE
        PERFORM outbox_completed_add(array_agg(topic), array_agg(-n))
        FROM (SELECT topic, sum(events)::bigint AS n FROM old_rows GROUP BY topic) g
        HAVING count(*) > 0;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_events_completed_update AFTER UPDATE ON outbox_events
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_completed_count_update();
CREATE TRIGGER outbox_events_completed_delete AFTER DELETE ON outbox_events
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_completed_count_delete();
CREATE TRIGGER outbox_publishes_completed_insert AFTER INSERT ON outbox_publishes
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_completed_count_logged();
CREATE TRIGGER outbox_publishes_completed_delete AFTER DELETE ON outbox_publishes
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_completed_count_logged();

-- Older binaries' requeue keeps a log row below the new cursor with the whole `events`
-- of the first advance it dropped (this release counts only the events at or below the
-- new cursor), so their requeues would leave the counts too high: they must not run
-- admin writes on this schema.
INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (16, 16);
