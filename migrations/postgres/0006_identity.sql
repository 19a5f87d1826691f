-- Identity (issue 11).
--
-- 1. An installation id, generated once per database. It names this installation in the
--    default CloudEvents source (`mailroom/<installation id>`), so that two deployments
--    never publish the same (ce_source, ce_id). A database restored from a backup keeps
--    it; its re-issued event ids are told apart by ce_id, which carries the creation time.
CREATE TABLE mailroom_installation (
    singleton       BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
    installation_id UUID        NOT NULL DEFAULT gen_random_uuid(),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);
INSERT INTO mailroom_installation DEFAULT VALUES;

-- 2. Inbox dedup ids move into namespaces (src/inbox/identity.rs): `ce:<n>:<source>:<id>`
--    for records that carried a ce_id (the stored headers hold ce_id and ce_source),
--    `kafka:<topic>:<partition>:<offset>` for records without, `rpc:<id>` for Receive
--    (Receive refuses ce_ headers, so its rows never hold ce_id). Ids over 512 bytes are
--    hashed as the intake hashes them. The unique index is rebuilt afterwards: the new ids
--    are distinct, but an update in place could meet an old id on its way.
DROP INDEX inbox_events_dedup;

WITH n AS (
    SELECT id,
        CASE
            WHEN headers ? 'ce_id' AND headers->>'ce_id' = message_id THEN
                'ce:' || octet_length(coalesce(headers->>'ce_source', '')) || ':'
                      || coalesce(headers->>'ce_source', '') || ':' || message_id
            WHEN left(message_id, length(topic) + 1) = topic || ':'
                 AND substr(message_id, length(topic) + 2) ~ '^[0-9]+:[0-9]+$' THEN
                'kafka:' || message_id
            ELSE 'rpc:' || message_id
        END AS plain,
        CASE
            WHEN headers ? 'ce_id' AND headers->>'ce_id' = message_id THEN
                'ce-h:' || encode(sha256(
                    int8send(octet_length(coalesce(headers->>'ce_source', '')))
                    || convert_to(coalesce(headers->>'ce_source', ''), 'UTF8')
                    || convert_to(message_id, 'UTF8')), 'hex')
            ELSE 'rpc-h:' || encode(sha256(convert_to(message_id, 'UTF8')), 'hex')
        END AS hashed
    FROM inbox_events
)
UPDATE inbox_events e
SET message_id = CASE WHEN octet_length(n.plain) <= 512 THEN n.plain ELSE n.hashed END,
    idempotency_key = CASE WHEN octet_length(n.plain) <= 512 THEN n.plain ELSE n.hashed END
FROM n
WHERE e.id = n.id;

CREATE UNIQUE INDEX inbox_events_dedup ON inbox_events (subscription, message_id);
