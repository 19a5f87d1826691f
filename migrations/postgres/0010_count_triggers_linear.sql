-- The pending-count update triggers (0002, 0003) joined OLD TABLE to NEW TABLE on id. The
-- planner has no statistics for transition tables and estimates one row for each, so it
-- nests the loops: a settle of 1,000 events compared 1,000,000 pairs and spent 330–550 ms
-- in the trigger (issue 15, docs/benchmarks.md "Performance v2, step 2"). Topic and key
-- never change in an UPDATE, so a key's change of pending events is the count of pending
-- new versions minus the count of pending old ones: two scans and one aggregate, linear
-- in the rows the statement touched. (Were a key ever rewritten, this form would still be
-- exact: minus one for the old key, plus one for the new.)
CREATE OR REPLACE FUNCTION outbox_keys_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox_keys k SET pending = k.pending + d.n
    FROM (SELECT topic, event_key, sum(n) AS n
          FROM (SELECT topic, event_key, 1 AS n FROM new_rows
                WHERE status = 'pending' AND event_key IS NOT NULL
                UNION ALL
                SELECT topic, event_key, -1 FROM old_rows
                WHERE status = 'pending' AND event_key IS NOT NULL) c
          GROUP BY topic, event_key
          HAVING sum(n) <> 0) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION inbox_keys_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE inbox_keys k SET pending = k.pending + d.n
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
END $$;
