-- Schema compatibility (issue 24, item 1; docs/storage.md, "Schema compatibility"). Each
-- migration from this one on inserts one row: `min_binary_schema` is the lowest schema a
-- binary must know (its highest embedded migration) to run on a database migrated this
-- far. A binary compares its own with MAX(min_binary_schema): below it, it stops
-- relaying, retention and admin writes and reports NOT_SERVING. An additive migration
-- repeats the previous requirement; one that changes what rows mean raises it to its own
-- version. Requirements never go down: the maximum over every row is what counts.
CREATE TABLE mailroom_schema_compat (
    version           BIGINT PRIMARY KEY,
    min_binary_schema BIGINT NOT NULL CHECK (min_binary_schema <= version)
);
-- This migration only adds the table: a binary that knows 0013 runs on it unchanged
-- (binaries before 0014 do not check; 0011, the per-key cursor, is what made binaries
-- before 0011 unsafe).
INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (14, 13);
