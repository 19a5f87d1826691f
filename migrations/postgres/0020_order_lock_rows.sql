-- Order locks and the fold's turn as row locks (issue 42, item 3; docs/sql-api.md,
-- "Order locks").
--
-- Until now the SQL API's per-key order lock and the relays' fold turn were advisory
-- locks. Advisory locks carry no privilege: any role that can connect could take
-- (7110, 1) and stop every relay's fold (SQL-API events on new keys waited as long as
-- it held it), or take a key's order lock and hold the key back. And each advisory lock
-- takes an entry in the cluster's shared lock table: an `enqueue_batch` over 1,000 keys
-- held 1,000, so a few bulk callers could exhaust it for every database.
--
-- Now both are row locks on tables only mailroom's owner may lock (`SELECT ... FOR
-- UPDATE/SHARE` needs UPDATE privilege; nobody else has any):
-- - `mailroom_fold_turn`, one row: a relay folds when it locks it, `FOR UPDATE SKIP
--   LOCKED`, for the length of the fold statement.
-- - `mailroom_order_slots`, 65,536 rows: a key's order lock is the row
--   `mailroom_order_slot(topic, key)` (the low 16 bits of `mailroom_order_lock`, so keys
--   that shared an advisory lock share a slot). Writers lock it `FOR UPDATE` (they wait
--   for one another); relays try it `FOR SHARE SKIP LOCKED` in the transaction that reads
--   the key's line (the handshake of 0015, unchanged). Two keys in one slot only wait for
--   each other's writers. The rows are only ever locked, never updated, so REPEATABLE
--   READ and SERIALIZABLE callers get no serialization failure from them.
-- A row lock lives in the row, not in the lock table: a call takes a fixed number of
-- lock-table entries (its relations) whatever its keys.
--
-- Rolling upgrade: binaries before this migration try the advisory order lock in shared
-- mode before they read a line (in claims and continued lines, which no schema check
-- stops at once). So the functions keep taking it too, after the slot row, while
-- `mailroom_sql_settings.legacy_order_lock` is true (this migration sets it), and the
-- relays of this release try it as well then (an older writer's transaction may still
-- be open when the migration commits). Its cost while on: one lock-table entry per key
-- and a key's SQL writers wait for anyone holding the key's advisory lock; the fold and
-- everything else no longer depend on it. Turn it off once no binary older than this
-- migration runs (docs/sql-api.md, "Order locks").
DO $migration$
DECLARE
    mr  text := (SELECT c.relnamespace::regnamespace::text FROM pg_catalog.pg_class c
                 WHERE c.oid = 'outbox_events'::regclass) || '.';
    src text;
BEGIN
    FOREACH src IN ARRAY ARRAY[
$src$
CREATE TABLE @mr.mailroom_fold_turn (
    turn boolean PRIMARY KEY DEFAULT true CHECK (turn)
)
$src$,
$src$
INSERT INTO @mr.mailroom_fold_turn DEFAULT VALUES
$src$,
$src$
CREATE TABLE @mr.mailroom_order_slots (
    slot integer PRIMARY KEY CHECK (slot BETWEEN 0 AND 65535)
)
$src$,
$src$
INSERT INTO @mr.mailroom_order_slots (slot) SELECT s FROM pg_catalog.generate_series(0, 65535) s
$src$,
$src$
ALTER TABLE @mr.mailroom_sql_settings ADD COLUMN legacy_order_lock boolean NOT NULL DEFAULT true
$src$,
$src$
CREATE FUNCTION @mr.mailroom_order_slot(p_topic text, p_key text) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT (@mr.mailroom_order_lock(p_topic, p_key) & 65535)::integer $$
$src$,
$src$
REVOKE ALL ON TABLE @mr.mailroom_fold_turn, @mr.mailroom_order_slots FROM PUBLIC
$src$,
$src$
REVOKE ALL ON FUNCTION @mr.mailroom_order_slot(text, text) FROM PUBLIC
$src$,
-- Binaries from 0017 on still run: the functions keep the advisory lock they try.
$src$
INSERT INTO @mr.mailroom_schema_compat (version, min_binary_schema) VALUES (20, 17)
$src$,
$src$
CREATE OR REPLACE FUNCTION mailroom.enqueue(
    topic           text,
    key             text        DEFAULT NULL,
    payload         bytea       DEFAULT '\x',
    headers         jsonb       DEFAULT '{}',
    type            text        DEFAULT NULL,
    idempotency_key text        DEFAULT NULL,
    deliver_after   timestamptz DEFAULT NULL,
    max_attempts    integer     DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    s          @mr.mailroom_sql_settings;
    v_key      text  := nullif(enqueue.key, ''::text);
    v_type     text  := nullif(enqueue.type, ''::text);
    v_idem     text  := nullif(enqueue.idempotency_key, ''::text);
    v_payload  bytea := coalesce(enqueue.payload, '\x'::bytea);
    v_headers  jsonb := coalesce(enqueue.headers, '{}'::jsonb);
    v_at       timestamptz := coalesce(enqueue.deliver_after, now());
    v_max      integer;
    v_hash     bigint;
    v_id       bigint;
    v_held     bigint;
    v_fp       bytea;
    v_held_fp  bytea;
BEGIN
    SELECT * INTO STRICT s FROM @mr.mailroom_sql_settings;
    v_max := @mr.mailroom_sql_check(''::text, enqueue.topic, v_key, v_payload, v_headers, v_type,
                                    v_idem, enqueue.deliver_after, enqueue.max_attempts, s);
    IF v_idem IS NOT NULL THEN
        v_hash := @mr.mailroom_fingerprint(enqueue.topic, v_key, v_payload, v_headers, v_type,
                                           enqueue.deliver_after, v_max);
        v_fp := @mr.mailroom_fingerprint128(enqueue.topic, v_key, v_payload, v_headers, v_type,
                                            enqueue.deliver_after, v_max);
    END IF;
    -- The key's order lock, before the insert draws the id: its slot row (migration
    -- 0020), then, while older relays may run, the advisory lock they try.
    IF v_key IS NOT NULL THEN
        PERFORM 1 FROM @mr.mailroom_order_slots o
        WHERE o.slot = @mr.mailroom_order_slot(enqueue.topic, v_key)
        FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'mailroom: this transaction''s snapshot is older than migration 0020; retry it'
                USING ERRCODE = '40001';
        END IF;
        IF s.legacy_order_lock THEN
            PERFORM pg_advisory_xact_lock(@mr.mailroom_order_lock(enqueue.topic, v_key));
        END IF;
    END IF;
    INSERT INTO @mr.outbox_events (topic, event_key, payload, headers, event_type,
                               idempotency_key, content_hash, max_attempts, scheduled_at,
                               content_fp, content_fp_version, counted)
    VALUES (enqueue.topic, v_key, v_payload, v_headers, v_type, v_idem, v_hash, v_max, v_at,
            v_fp, CASE WHEN v_fp IS NULL THEN NULL ELSE 2 END, v_key IS NULL)
    ON CONFLICT (topic, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT e.id, e.content_hash, e.content_fp INTO v_id, v_held, v_held_fp
        FROM @mr.outbox_events e WHERE e.topic = enqueue.topic AND e.idempotency_key = v_idem;
        IF (v_held_fp IS NOT NULL AND v_held_fp IS DISTINCT FROM v_fp)
           OR (v_held_fp IS NULL AND v_held IS DISTINCT FROM v_hash) THEN
            RAISE EXCEPTION 'mailroom: idempotency_key is already used by an event with other content'
                USING ERRCODE = 'MR020', COLUMN = 'idempotency_key';
        END IF;
        RETURN v_id;
    END IF;
    IF s.notify THEN
        PERFORM pg_notify('mailroom_outbox'::text, ''::text);
    END IF;
    RETURN v_id;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION mailroom.enqueue_batch(
    topics           text[],
    keys             text[]        DEFAULT NULL,
    payloads         bytea[]       DEFAULT NULL,
    headers          jsonb[]       DEFAULT NULL,
    types            text[]        DEFAULT NULL,
    idempotency_keys text[]        DEFAULT NULL,
    deliver_afters   timestamptz[] DEFAULT NULL,
    max_attempts     integer[]     DEFAULT NULL)
RETURNS TABLE (ord integer, id bigint, duplicate boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    s        @mr.mailroom_sql_settings;
    n        integer := coalesce(cardinality(enqueue_batch.topics), 0);
    v_key    text[]        := array_fill(NULL::text, ARRAY[n]);
    v_type   text[]        := array_fill(NULL::text, ARRAY[n]);
    v_idem   text[]        := array_fill(NULL::text, ARRAY[n]);
    v_pay    bytea[]       := array_fill(NULL::bytea, ARRAY[n]);
    v_hdr    jsonb[]       := array_fill(NULL::jsonb, ARRAY[n]);
    v_after  timestamptz[] := array_fill(NULL::timestamptz, ARRAY[n]);
    v_max    integer[]     := array_fill(NULL::integer, ARRAY[n]);
    v_hash   bigint[]      := array_fill(NULL::bigint, ARRAY[n]);
    v_fp     bytea[]       := array_fill(NULL::bytea, ARRAY[n]);
    plain    bigint[];
    taken    bigint[];
    p        integer := 0;
    arr      text;
    len      integer;
    i        integer;
    lock_id  bigint;
    slots    integer[];
    locked   bigint;
    r_id     bigint;
    r_hash   bigint;
    r_fp     bytea;
BEGIN
    SELECT * INTO STRICT s FROM @mr.mailroom_sql_settings;
    IF n = 0 THEN
        RAISE EXCEPTION 'mailroom: topics must not be empty'
            USING ERRCODE = 'MR030', COLUMN = 'topics';
    END IF;
    IF n > s.max_batch THEN
        RAISE EXCEPTION 'mailroom: % events; at most % per batch', n, s.max_batch
            USING ERRCODE = 'MR031', COLUMN = 'topics';
    END IF;
    -- Every array is indexed from 1 below: one of another shape would put events on
    -- other events' keys, payloads or settings.
    FOR arr, len IN VALUES
        ('topics'::text, array_lower(enqueue_batch.topics, 1) * array_ndims(enqueue_batch.topics)),
        ('keys'::text, array_lower(enqueue_batch.keys, 1) * array_ndims(enqueue_batch.keys)),
        ('payloads'::text, array_lower(enqueue_batch.payloads, 1) * array_ndims(enqueue_batch.payloads)),
        ('headers'::text, array_lower(enqueue_batch.headers, 1) * array_ndims(enqueue_batch.headers)),
        ('types'::text, array_lower(enqueue_batch.types, 1) * array_ndims(enqueue_batch.types)),
        ('idempotency_keys'::text, array_lower(enqueue_batch.idempotency_keys, 1) * array_ndims(enqueue_batch.idempotency_keys)),
        ('deliver_afters'::text, array_lower(enqueue_batch.deliver_afters, 1) * array_ndims(enqueue_batch.deliver_afters)),
        ('max_attempts'::text, array_lower(enqueue_batch.max_attempts, 1) * array_ndims(enqueue_batch.max_attempts))
    LOOP
        IF len IS NOT NULL AND len <> 1 THEN
            RAISE EXCEPTION 'mailroom: % must be a one-dimensional array indexed from 1', arr
                USING ERRCODE = 'MR033', COLUMN = arr;
        END IF;
    END LOOP;
    FOR arr, len IN VALUES
        ('keys'::text, cardinality(enqueue_batch.keys)),
        ('payloads'::text, cardinality(enqueue_batch.payloads)),
        ('headers'::text, cardinality(enqueue_batch.headers)),
        ('types'::text, cardinality(enqueue_batch.types)),
        ('idempotency_keys'::text, cardinality(enqueue_batch.idempotency_keys)),
        ('deliver_afters'::text, cardinality(enqueue_batch.deliver_afters)),
        ('max_attempts'::text, cardinality(enqueue_batch.max_attempts))
    LOOP
        IF len IS NOT NULL AND len <> n THEN
            RAISE EXCEPTION 'mailroom: % has % elements; topics has %', arr, len, n
                USING ERRCODE = 'MR032', COLUMN = arr;
        END IF;
    END LOOP;
    FOR i IN 1 .. n LOOP
        v_key[i]   := nullif(enqueue_batch.keys[i], ''::text);
        v_type[i]  := nullif(enqueue_batch.types[i], ''::text);
        v_idem[i]  := nullif(enqueue_batch.idempotency_keys[i], ''::text);
        v_pay[i]   := coalesce(enqueue_batch.payloads[i], '\x'::bytea);
        v_hdr[i]   := coalesce(enqueue_batch.headers[i], '{}'::jsonb);
        v_after[i] := enqueue_batch.deliver_afters[i];
        v_max[i]   := @mr.mailroom_sql_check('events['::text || i::text || '].'::text,
                                             enqueue_batch.topics[i], v_key[i], v_pay[i],
                                             v_hdr[i], v_type[i], v_idem[i], v_after[i],
                                             enqueue_batch.max_attempts[i], s);
        IF v_idem[i] IS NOT NULL THEN
            v_hash[i] := @mr.mailroom_fingerprint(enqueue_batch.topics[i], v_key[i], v_pay[i],
                                                  v_hdr[i], v_type[i], v_after[i], v_max[i]);
            v_fp[i] := @mr.mailroom_fingerprint128(enqueue_batch.topics[i], v_key[i], v_pay[i],
                                                   v_hdr[i], v_type[i], v_after[i], v_max[i]);
        END IF;
    END LOOP;
    -- The keys' order locks before the insert draws ids: their slot rows in ascending
    -- slot (two batches over the same keys take them in the same order; a row lock
    -- takes no lock-table entry, migration 0020), then, while older relays may run,
    -- the advisory locks they try, in ascending lock id.
    SELECT coalesce(array_agg(DISTINCT @mr.mailroom_order_slot(u.t, u.kk)), '{}'::integer[])
    INTO slots
    FROM unnest(enqueue_batch.topics, v_key) AS u(t, kk)
    WHERE u.kk IS NOT NULL;
    SELECT count(*) INTO locked
    FROM (SELECT 1 FROM @mr.mailroom_order_slots o WHERE o.slot = ANY (slots)
          ORDER BY o.slot FOR UPDATE) l;
    IF locked < cardinality(slots) THEN
        RAISE EXCEPTION 'mailroom: this transaction''s snapshot is older than migration 0020; retry it'
            USING ERRCODE = '40001';
    END IF;
    IF s.legacy_order_lock THEN
        FOR lock_id IN
            SELECT DISTINCT @mr.mailroom_order_lock(u.t, u.kk) AS l
            FROM unnest(enqueue_batch.topics, v_key) AS u(t, kk)
            WHERE u.kk IS NOT NULL
            ORDER BY 1
        LOOP
            PERFORM pg_advisory_xact_lock(lock_id);
        END LOOP;
    END IF;
    -- Ids are drawn in array order.
    WITH ins AS (
        INSERT INTO @mr.outbox_events (topic, event_key, payload, headers, event_type,
                                   idempotency_key, content_hash, max_attempts, scheduled_at,
                                   content_fp, content_fp_version, counted)
        SELECT u.t, u.kk, u.p, u.h, u.ty, u.i, u.c, u.m, coalesce(u.a, now()),
               u.f, CASE WHEN u.f IS NULL THEN NULL ELSE 2 END, u.kk IS NULL
        FROM unnest(enqueue_batch.topics, v_key, v_pay, v_hdr, v_type, v_idem, v_hash,
                    v_max, v_after, v_fp) WITH ORDINALITY AS u(t, kk, p, h, ty, i, c, m, a, f, o)
        ORDER BY u.o
        ON CONFLICT (topic, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id, idempotency_key)
    SELECT array_agg(ins.id ORDER BY ins.id) FILTER (WHERE ins.idempotency_key IS NULL),
           array_agg(ins.id) FILTER (WHERE ins.idempotency_key IS NOT NULL)
    INTO plain, taken
    FROM ins;
    FOR i IN 1 .. n LOOP
        IF v_idem[i] IS NULL THEN
            p := p + 1;
            ord := i; id := plain[p]; duplicate := false;
        ELSE
            SELECT e.id, e.content_hash, e.content_fp INTO r_id, r_hash, r_fp
            FROM @mr.outbox_events e
            WHERE e.topic = enqueue_batch.topics[i] AND e.idempotency_key = v_idem[i];
            IF (r_fp IS NOT NULL AND r_fp IS DISTINCT FROM v_fp[i])
               OR (r_fp IS NULL AND r_hash IS DISTINCT FROM v_hash[i]) THEN
                RAISE EXCEPTION 'mailroom: events[%].idempotency_key is already used by an event with other content', i
                    USING ERRCODE = 'MR020', COLUMN = 'events['::text || i::text || '].idempotency_key'::text;
            END IF;
            ord := i; id := r_id;
            duplicate := NOT (r_id = ANY (coalesce(taken, '{}'::bigint[])))
                         OR EXISTS (SELECT 1 FROM generate_series(1, i - 1) AS j
                                    WHERE v_idem[j] = v_idem[i]
                                      AND enqueue_batch.topics[j] = enqueue_batch.topics[i]);
        END IF;
        RETURN NEXT;
    END LOOP;
    IF s.notify AND (plain IS NOT NULL OR taken IS NOT NULL) THEN
        PERFORM pg_notify('mailroom_outbox'::text, ''::text);
    END IF;
END $$
$src$
    ] LOOP
        EXECUTE replace(src, '@mr.', mr);
    END LOOP;
END $migration$;
