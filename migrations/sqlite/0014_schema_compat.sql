-- Schema compatibility; see migrations/postgres/0014_schema_compat.sql.
CREATE TABLE mailroom_schema_compat (
    version           INTEGER PRIMARY KEY,
    min_binary_schema INTEGER NOT NULL CHECK (min_binary_schema <= version)
);
INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (14, 13);
