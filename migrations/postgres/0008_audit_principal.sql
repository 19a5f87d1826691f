-- Issue 12: the audit entry records the authenticated principal (token name) apart from
-- the operator name the caller claims, and the request_id that makes a retried
-- RequeueFailed/CancelEvents one action.
ALTER TABLE admin_audit ADD COLUMN principal TEXT;
ALTER TABLE admin_audit ADD COLUMN request_id TEXT;
CREATE UNIQUE INDEX admin_audit_request_id ON admin_audit (action, box, request_id)
    WHERE request_id IS NOT NULL;
