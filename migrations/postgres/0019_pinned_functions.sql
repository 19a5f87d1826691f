-- Every mailroom function runs with a pinned search_path (issue 42, item 1;
-- docs/security.md, "A shared database").
--
-- The SQL API's functions and the outbox count triggers were pinned to
-- `pg_catalog, pg_temp` by 0015. Left over were the inbox count triggers (0003, 0010: no
-- setting, so they resolved names through the search_path of whatever session fired
-- them) and the helpers of 0016 and 0018 (`SET search_path FROM CURRENT`: the
-- migrator's path of the day, `"$user", public`). In a database where other roles may
-- create in `public`, an operator or function planted there (`*(bigint, interval)`, a
-- `jsonb_build_object` overload) was a better match than pg_catalog's and ran as
-- mailroom's user inside these functions. They are re-created here with the same
-- bodies, every mailroom object qualified with the schema that holds mailroom's tables
-- (taken from `outbox_events` itself, never from `current_schema()`, which a role named
-- like one of mailroom's schemas changes), and `SET search_path = pg_catalog, pg_temp`.
-- Names, signatures, owners and the triggers that call them are kept.
DO $migration$
DECLARE
    mr  text := (SELECT quote_ident(n.nspname) || '.' FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE c.oid = 'outbox_events'::regclass);
    src text;
BEGIN
    FOREACH src IN ARRAY ARRAY[
$src$
CREATE OR REPLACE FUNCTION @mr.inbox_keys_count_insert() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE @mr.inbox_keys k SET pending = k.pending + d.n
    FROM (SELECT subscription, topic, event_key, count(*) AS n FROM new_rows
          WHERE status = 'pending' AND event_key IS NOT NULL
          GROUP BY subscription, topic, event_key) d
    WHERE k.subscription = d.subscription AND k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.inbox_keys_count_update() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE @mr.inbox_keys k SET pending = k.pending + d.n
    FROM (SELECT subscription, topic, event_key, sum(n) AS n
          FROM (SELECT subscription, topic, event_key, 1 AS n FROM new_rows
                WHERE status = 'pending' AND event_key IS NOT NULL
                UNION ALL
                SELECT subscription, topic, event_key, -1 FROM old_rows
                WHERE status = 'pending' AND event_key IS NOT NULL) c
          GROUP BY subscription, topic, event_key
          HAVING sum(n) <> 0) d
    WHERE k.subscription = d.subscription AND k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.inbox_keys_count_delete() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE @mr.inbox_keys k SET pending = k.pending - d.n
    FROM (SELECT subscription, topic, event_key, count(*) AS n FROM old_rows
          WHERE status = 'pending' AND event_key IS NOT NULL
          GROUP BY subscription, topic, event_key) d
    WHERE k.subscription = d.subscription AND k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.outbox_completed_add(p_topics text[], p_n bigint[]) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
INSERT INTO @mr.outbox_completed_counts AS c (topic, shard, n)
SELECT t, pg_backend_pid(), d FROM unnest(p_topics, p_n) AS u(t, d)
WHERE d <> 0
ORDER BY t COLLATE "C"
ON CONFLICT (topic, shard) DO UPDATE SET n = c.n + EXCLUDED.n
$$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.outbox_completed_count_update() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM @mr.outbox_completed_add(array_agg(topic), array_agg(d))
    FROM (SELECT topic, sum(d) AS d
          FROM (SELECT topic, 1 AS d FROM new_rows WHERE status = 'completed'
                UNION ALL
                SELECT topic, -1 FROM old_rows WHERE status = 'completed') x
          GROUP BY topic) g
    HAVING count(*) > 0;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.outbox_completed_count_delete() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM @mr.outbox_completed_add(array_agg(topic), array_agg(-n))
    FROM (SELECT topic, count(*) AS n FROM old_rows WHERE status = 'completed'
          GROUP BY topic) g
    HAVING count(*) > 0;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.outbox_completed_count_logged() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM @mr.outbox_completed_add(array_agg(topic), array_agg(n))
        FROM (SELECT topic, sum(events)::bigint AS n FROM new_rows GROUP BY topic) g
        HAVING count(*) > 0;
    ELSE
        PERFORM @mr.outbox_completed_add(array_agg(topic), array_agg(-n))
        FROM (SELECT topic, sum(events)::bigint AS n FROM old_rows GROUP BY topic) g
        HAVING count(*) > 0;
    END IF;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.mailroom_push_attempt(p_log jsonb, p_attempt integer, p_error text)
RETURNS jsonb
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT CASE WHEN jsonb_array_length(l) > 10 THEN l - 0 ELSE l END
FROM (SELECT COALESCE(p_log, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
        'attempt', p_attempt, 'at', now(), 'error', left(p_error, 1000)))) AS s(l)
$$
$src$
    ] LOOP
        EXECUTE replace(src, '@mr.', mr);
    END LOOP;
END
$migration$;

-- The same behaviour under another resolution: binaries of schema 17 and 18 run on it.
INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (19, 17);
