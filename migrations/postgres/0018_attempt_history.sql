-- Per-attempt history (issue 28, item 1; docs/admin.md, "Attempt history"): each event
-- keeps its last 10 counted attempts (attempt number, time, error) in `attempt_log`, a
-- JSON array oldest first, appended by the relay's settle when an attempt is spent or the
-- event fails. Transient failures (no attempt spent) are not logged: an outage would push
-- the real attempts out. Requeue keeps the log.
--
-- Additive (min_binary_schema 17): an older binary's settle leaves the log alone, so the
-- log misses the attempts older replicas made during a rolling upgrade.
ALTER TABLE outbox_events ADD COLUMN attempt_log JSONB;
ALTER TABLE inbox_events ADD COLUMN attempt_log JSONB;

-- The log with one more attempt, trimmed to the last 10; each error cut to 1000
-- characters.
CREATE FUNCTION mailroom_push_attempt(p_log jsonb, p_attempt integer, p_error text)
RETURNS jsonb
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
SELECT CASE WHEN jsonb_array_length(l) > 10 THEN l - 0 ELSE l END
FROM (SELECT COALESCE(p_log, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
        'attempt', p_attempt, 'at', now(), 'error', left(p_error, 1000)))) AS s(l)
$$;

-- The admin reads the outbox through the view (0011): the log is its last column.
CREATE OR REPLACE VIEW outbox_events_view AS
SELECT e.id, e.topic, e.event_key, e.payload, e.headers, e.event_type, e.idempotency_key,
       e.content_hash,
       CASE WHEN c.done THEN 'completed' ELSE e.status END AS status,
       e.attempts, e.max_attempts, e.scheduled_at, e.created_at,
       CASE WHEN c.done THEN c.at ELSE e.updated_at END AS updated_at,
       CASE WHEN c.done THEN c.at ELSE e.published_at END AS published_at,
       e.last_error, e.claim_token, e.claimed_until, e.content_fp, e.content_fp_version,
       e.attempt_log
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

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (18, 17);
