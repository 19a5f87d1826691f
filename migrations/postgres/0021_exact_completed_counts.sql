-- Completed counters made exact after a migration that ran beside traffic (issue 42,
-- item 4; docs/storage.md, "Migrations beside traffic").
--
-- 0016 counted the completed events once, then created the triggers that keep the count
-- from then on. A relay's settle that committed after that count's snapshot but ran
-- before the triggers existed (it was in flight during the count, and the trigger
-- creation waited for it) was neither counted nor triggered: the counters stayed short
-- for good (500 vs 506).
--
-- Now that the triggers exist, one statement reads, per topic, the completed events and
-- the counters' sum from the same snapshot. Every change to either commits in the same
-- transaction as the matching change to the other (the triggers), so their difference is
-- exactly what the count missed, however many settles commit meanwhile; it is added to
-- this backend's own shard, which retention folds into shard 0 like a relay's. The
-- statement reads (it walks the retained events once, as 0016 did) and writes rows no
-- relay writes: the service never waits on it. A migration that adds a count later does
-- the same: triggers first, then this reconciliation in a statement of its own.
DO $migration$
DECLARE
    -- The schema holding mailroom's tables, from the objects themselves.
    mr text := (SELECT c.relnamespace::regnamespace::text FROM pg_catalog.pg_class c
                WHERE c.oid = 'outbox_events'::regclass);
BEGIN
    EXECUTE format($sql$
        INSERT INTO %1$s.outbox_completed_counts AS c (topic, shard, n)
        SELECT topic, pg_catalog.pg_backend_pid(), d
        FROM (SELECT topic, pg_catalog.sum(n)::bigint AS d
              FROM (SELECT topic, pg_catalog.count(*) AS n FROM %1$s.outbox_events_view
                    WHERE status = 'completed' GROUP BY topic
                    UNION ALL
                    SELECT topic, -pg_catalog.sum(n) FROM %1$s.outbox_completed_counts
                    GROUP BY topic) x
              GROUP BY topic) g
        WHERE d <> 0
        ORDER BY topic COLLATE "C"
        ON CONFLICT (topic, shard) DO UPDATE SET n = c.n + EXCLUDED.n
    $sql$, mr);
    -- Nothing here changes what a binary must know.
    EXECUTE format('INSERT INTO %s.mailroom_schema_compat (version, min_binary_schema)
                    VALUES (21, 17)', mr);
END
$migration$;
