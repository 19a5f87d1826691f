-- Per-attempt history; see migrations/postgres/0018_attempt_history.sql. The log is JSON
-- text; `at` is microseconds since the Unix epoch.
ALTER TABLE outbox_events ADD COLUMN attempt_log TEXT;
ALTER TABLE inbox_events ADD COLUMN attempt_log TEXT;

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (18, 17);
