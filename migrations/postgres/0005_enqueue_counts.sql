-- Enqueue counts the pending events of each key in the same statement that upserts the
-- key row (one write per key instead of two). The insert trigger keeps counting only the
-- rows it cannot know in advance: events with an idempotency key, which may insert
-- nothing when the key was already taken.
CREATE OR REPLACE FUNCTION outbox_keys_count_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox_keys k SET pending = k.pending + d.n
    FROM (SELECT topic, event_key, count(*) AS n FROM new_rows
          WHERE status = 'pending' AND event_key IS NOT NULL AND idempotency_key IS NOT NULL
          GROUP BY topic, event_key) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$;
