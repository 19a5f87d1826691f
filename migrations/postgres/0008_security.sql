-- Issue 12: the audit entry records the authenticated principal (token name) apart from
-- the operator name the caller claims, and the request_id that makes a retried
-- RequeueFailed/CancelEvents one action.
ALTER TABLE admin_audit ADD COLUMN principal TEXT;
ALTER TABLE admin_audit ADD COLUMN request_id TEXT;
CREATE UNIQUE INDEX admin_audit_request_id ON admin_audit (action, box, request_id)
    WHERE request_id IS NOT NULL;

-- Idempotency keys are scoped by topic: one producer's key never meets another topic's,
-- so a token limited to topics can neither take nor probe other keys. And the content
-- fingerprint that tells a retry from a conflicting reuse is 128 bits of SHA-256
-- (content_fp, content_fp_version = 2); rows from before keep their 64-bit content_hash
-- (version 1) and are compared with it.
ALTER TABLE outbox_events ADD COLUMN content_fp BYTEA;
ALTER TABLE outbox_events ADD COLUMN content_fp_version SMALLINT;
DROP INDEX outbox_events_idempotency;
CREATE UNIQUE INDEX outbox_events_idempotency
    ON outbox_events (topic, idempotency_key) WHERE idempotency_key IS NOT NULL;
