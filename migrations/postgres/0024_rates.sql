-- Deliveries per minute (issue 44, item 5; docs/console.md, "Overview"): every replica
-- adds its relays' and dispatchers' deliveries to the current minute's row every 10 s,
-- so the console's rate chart shows the same history on every replica and across
-- restarts. Rows older than two hours are deleted by the same task. `minute` counts
-- minutes since the Unix epoch; `subscription` is '' for the outbox.
--
-- Additive (min_binary_schema stays 22): older binaries do not write it; their
-- deliveries are missing from the chart until they are replaced.
CREATE TABLE mailroom_rates (
    box          TEXT   NOT NULL CHECK (box IN ('outbox', 'inbox')),
    subscription TEXT   NOT NULL,
    minute       BIGINT NOT NULL,
    n            BIGINT NOT NULL,
    PRIMARY KEY (box, subscription, minute)
);

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (24, 22);
