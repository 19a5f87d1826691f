-- Background jobs; see migrations/postgres/0025_jobs.sql. Times are microseconds since
-- the Unix epoch.
CREATE TABLE mailroom_jobs (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    kind         TEXT    NOT NULL CHECK (kind IN ('requeue', 'cancel', 'republish', 'redeliver')),
    box          TEXT    NOT NULL CHECK (box IN ('outbox', 'inbox')),
    selection    TEXT    NOT NULL,
    reason       TEXT,
    state        TEXT    NOT NULL CHECK (state IN ('running', 'cancelling', 'completed', 'cancelled', 'failed')),
    total        INTEGER NOT NULL,
    done         INTEGER NOT NULL DEFAULT 0,
    after_id     INTEGER NOT NULL DEFAULT 0,
    through_id   INTEGER NOT NULL,
    actor        TEXT    NOT NULL,
    principal    TEXT,
    request_id   TEXT,
    cancelled_by TEXT,
    owner        TEXT,
    lease_until  INTEGER,
    error        TEXT,
    created_at   INTEGER NOT NULL,
    updated_at   INTEGER NOT NULL,
    finished_at  INTEGER
);

CREATE UNIQUE INDEX mailroom_jobs_request ON mailroom_jobs (kind, box, request_id)
    WHERE request_id IS NOT NULL;
CREATE INDEX mailroom_jobs_open ON mailroom_jobs (id) WHERE state IN ('running', 'cancelling');

INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (25, 22);
