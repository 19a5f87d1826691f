-- The default payload limit fits stock Kafka (issue 23, item 5): 1,048,576 bytes of
-- payload plus headers, CloudEvents attributes and framing is over Kafka's default
-- record batch limit (message.max.bytes, 1,048,588 bytes), so an event at the old
-- default could never be published to a default cluster. gRPC's default is now
-- 1,048,588 - 16,384 (max_header_bytes) - 16,384 (key, CloudEvents attributes, trace
-- context and framing) = 1,015,820 bytes; the SQL API keeps gRPC's defaults. A row the
-- owner changed keeps its value; one still at the old default moves to the new one (an
-- owner who runs the service with MAILROOM_MAX_PAYLOAD_BYTES=1048576 against a cluster
-- that takes it sets it back).
ALTER TABLE mailroom_sql_settings ALTER COLUMN max_payload_bytes SET DEFAULT 1015820;
UPDATE mailroom_sql_settings SET max_payload_bytes = 1015820 WHERE max_payload_bytes = 1048576;
