-- Deliveries per minute; see migrations/postgres/0024_rates.sql.
CREATE TABLE mailroom_rates (
    box          TEXT    NOT NULL CHECK (box IN ('outbox', 'inbox')),
    subscription TEXT    NOT NULL,
    minute       INTEGER NOT NULL,
    n            INTEGER NOT NULL,
    PRIMARY KEY (box, subscription, minute)
);

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (24, 22);
