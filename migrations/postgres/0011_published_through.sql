-- Publishing without rewriting event rows (issue 15, docs/storage.md).
--
-- A key's line is ordered by id, and a relay publishes a prefix of it. Instead of one
-- UPDATE per published event, the settle advances the key's cursor once: every event of
-- the key with `status = 'pending'` and `id <= published_through` is published. Rows
-- that leave the line any other way (retried, failed, cancelled, published after a gap,
-- and every unkeyed or inbox event) are still written one by one, as before. The row's
-- `status` column therefore reads 'pending' for an event the cursor has passed: read
-- statuses through `outbox_events_view`, which applies the cursor.
ALTER TABLE outbox_keys ADD COLUMN published_through BIGINT NOT NULL DEFAULT 0;
-- The inbox keeps per-row settles; its column stays 0, so the claim reads both boxes alike.
ALTER TABLE inbox_keys ADD COLUMN published_through BIGINT NOT NULL DEFAULT 0;

-- One row per cursor advance: when the key's events up to `through` (above the previous
-- advance) were published. It gives each cursor-published event its exact publish time
-- (the first advance at or above its id) and lets retention age them.
CREATE TABLE outbox_publishes (
    topic     TEXT        NOT NULL,
    event_key TEXT        NOT NULL,
    through   BIGINT      NOT NULL,
    at        TIMESTAMPTZ NOT NULL,
    events    INTEGER     NOT NULL,             -- how many the advance published (retention's batches)
    PRIMARY KEY (topic, event_key, through)
);
CREATE INDEX outbox_publishes_at ON outbox_publishes (at);

-- The outbox's events as the admin API reports them: a cursor-published event is
-- 'completed', published (and last updated) at its advance's time.
CREATE VIEW outbox_events_view AS
SELECT e.id, e.topic, e.event_key, e.payload, e.headers, e.event_type, e.idempotency_key,
       e.content_hash,
       CASE WHEN c.done THEN 'completed' ELSE e.status END AS status,
       e.attempts, e.max_attempts, e.scheduled_at, e.created_at,
       CASE WHEN c.done THEN c.at ELSE e.updated_at END AS updated_at,
       CASE WHEN c.done THEN c.at ELSE e.published_at END AS published_at,
       e.last_error, e.claim_token, e.claimed_until, e.content_fp, e.content_fp_version
FROM outbox_events e
LEFT JOIN LATERAL (
    SELECT true AS done,
           (SELECT p.at FROM outbox_publishes p
            WHERE p.topic = e.topic AND p.event_key = e.event_key AND p.through >= e.id
            ORDER BY p.through LIMIT 1) AS at
    FROM outbox_keys k
    WHERE e.status = 'pending' AND e.event_key IS NOT NULL
      AND k.topic = e.topic AND k.event_key = e.event_key AND e.id <= k.published_through
) c ON true;

-- The pending counts count the events in line: a row the cursor has passed is not, even
-- though its status column still reads 'pending'. Both triggers compare with the cursor
-- as it stands when the statement ends.
CREATE OR REPLACE FUNCTION outbox_keys_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox_keys k SET pending = k.pending + d.n
    FROM (SELECT c.topic, c.event_key, sum(c.n) AS n
          FROM (SELECT topic, event_key, id, 1 AS n FROM new_rows
                WHERE status = 'pending' AND event_key IS NOT NULL
                UNION ALL
                SELECT topic, event_key, id, -1 FROM old_rows
                WHERE status = 'pending' AND event_key IS NOT NULL) c
          JOIN outbox_keys q ON q.topic = c.topic AND q.event_key = c.event_key
          WHERE c.id > q.published_through
          GROUP BY c.topic, c.event_key
          HAVING sum(c.n) <> 0) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION outbox_keys_count_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox_keys k SET pending = k.pending - d.n
    FROM (SELECT o.topic, o.event_key, count(*) AS n FROM old_rows o
          JOIN outbox_keys q ON q.topic = o.topic AND q.event_key = o.event_key
          WHERE o.status = 'pending' AND o.event_key IS NOT NULL AND o.id > q.published_through
          GROUP BY o.topic, o.event_key) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;
