-- The SQL API no longer touches key rows (issue 24, item 2; issue 25, item 2;
-- docs/sql-api.md, "Transactions").
--
-- Before, `mailroom.enqueue` upserted and locked the key's row in `outbox_keys` inside the
-- caller's transaction. A caller that kept its transaction open then held that row: the
-- relays' settle and lease renewal waited on it (holding the other keys of their claim),
-- and a REPEATABLE READ or SERIALIZABLE caller failed with 40001 whenever a relay or
-- another writer had touched the row since its snapshot.
--
-- Now a SQL enqueue only inserts its events and holds the key's *order lock*, a
-- transaction-level advisory lock on `mailroom_order_lock(topic, key)`, until the caller's
-- transaction ends:
-- - Order: ids of one key are drawn in commit order among SQL writers (they wait for one
--   another's order lock), and a relay does not read a key's line while any writer holds
--   the key's order lock (it tries the lock in shared mode before it reads, in the same
--   transaction: src/store/postgres/relay.rs). So no event above a SQL writer's
--   uncommitted id is published before that writer ends. gRPC enqueues take no order
--   lock: they lock the key row, as before, and never wait for a SQL caller.
-- - Counting: the SQL path cannot write the key row, so its keyed events are stored
--   `counted = false`: the count triggers leave them out, and the relays' claim folds
--   them in (creates or wakes the key row and sets `counted`, which the update trigger
--   then counts) within milliseconds of the commit, woken by the NOTIFY.
-- - search_path: every function here runs with `pg_catalog, pg_temp` and names the
--   schema of mailroom's tables and helpers explicitly, so nothing a caller can create
--   in `public` (an operator, a function, a table) is ever resolved by them.

ALTER TABLE outbox_events ADD COLUMN counted BOOLEAN NOT NULL DEFAULT true;
CREATE INDEX outbox_events_uncounted ON outbox_events (id) WHERE NOT counted;

-- The order lock of a key: one 64-bit advisory lock id. Topics cannot contain ':', so the
-- joined text is unambiguous; a collision only makes two keys wait for each other.
CREATE FUNCTION mailroom_order_lock(p_topic text, p_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT hashtextextended((p_topic || ':' || p_key) COLLATE "C", 7110) $$;

-- The SQL API's functions, re-created with a search_path of `pg_catalog, pg_temp` and
-- every mailroom object qualified with the schema this migration runs in (the count
-- triggers too: they fire inside those functions, under their search_path) (`@mr.` below,
-- replaced before each statement runs). Signatures, owner and grants are kept.
DO $migration$
DECLARE
    mr  text := quote_ident(current_schema()) || '.';
    src text;
BEGIN
    FOREACH src IN ARRAY ARRAY[
-- The count triggers (they run inside the SQL API's functions too) count only
-- `counted` rows.
$src$
CREATE OR REPLACE FUNCTION @mr.outbox_keys_count_insert() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE @mr.outbox_keys k SET pending = k.pending + d.n
    FROM (SELECT topic, event_key, count(*) AS n FROM new_rows
          WHERE status = 'pending' AND event_key IS NOT NULL AND idempotency_key IS NOT NULL
            AND counted
          GROUP BY topic, event_key) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.outbox_keys_count_update() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE @mr.outbox_keys k SET pending = k.pending + d.n
    FROM (SELECT c.topic, c.event_key, sum(c.n) AS n
          FROM (SELECT topic, event_key, id, 1 AS n FROM new_rows
                WHERE status = 'pending' AND event_key IS NOT NULL AND counted
                UNION ALL
                SELECT topic, event_key, id, -1 FROM old_rows
                WHERE status = 'pending' AND event_key IS NOT NULL AND counted) c
          JOIN @mr.outbox_keys q ON q.topic = c.topic AND q.event_key = c.event_key
          WHERE c.id > q.published_through
          GROUP BY c.topic, c.event_key
          HAVING sum(c.n) <> 0) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.outbox_keys_count_delete() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE @mr.outbox_keys k SET pending = k.pending - d.n
    FROM (SELECT o.topic, o.event_key, count(*) AS n FROM old_rows o
          JOIN @mr.outbox_keys q ON q.topic = o.topic AND q.event_key = o.event_key
          WHERE o.status = 'pending' AND o.event_key IS NOT NULL AND o.counted
            AND o.id > q.published_through
          GROUP BY o.topic, o.event_key) d
    WHERE k.topic = d.topic AND k.event_key = d.event_key;
    RETURN NULL;
END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.mailroom_fp_field(b bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT int8send(octet_length(b)::bigint) || b $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.mailroom_fp_opt(b bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT CASE WHEN b IS NULL THEN '\x00'::bytea
                  ELSE '\x01'::bytea || int8send(octet_length(b)::bigint) || b END $$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.mailroom_fingerprint_digest(p_topic text, p_key text, p_payload bytea,
                                     p_headers jsonb, p_type text,
                                     p_deliver_after timestamptz, p_max_attempts integer)
RETURNS bytea
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT sha256(
           @mr.mailroom_fp_field(convert_to(p_topic, 'UTF8'::name))
        || @mr.mailroom_fp_opt(convert_to(p_key, 'UTF8'::name))
        || @mr.mailroom_fp_field(p_payload)
        || (SELECT int8send(count(*))
                   || coalesce(string_agg(@mr.mailroom_fp_field(convert_to(h.k, 'UTF8'::name))
                                          || @mr.mailroom_fp_field(convert_to(h.v, 'UTF8'::name)),
                                          ''::bytea ORDER BY h.k COLLATE "C"), ''::bytea)
            FROM jsonb_each_text(coalesce(p_headers, '{}'::jsonb)) AS h(k, v)
            WHERE h.k NOT IN ('traceparent'::text, 'tracestate'::text))
        || @mr.mailroom_fp_opt(convert_to(p_type, 'UTF8'::name))
        || @mr.mailroom_fp_opt(int8send(floor(extract(epoch FROM p_deliver_after) * 1000000::numeric)::bigint))
        || @mr.mailroom_fp_field(int4send(p_max_attempts))
       )
$$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.mailroom_fingerprint(p_topic text, p_key text, p_payload bytea,
                                     p_headers jsonb, p_type text,
                                     p_deliver_after timestamptz, p_max_attempts integer)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT ('x'::text || encode(substr(@mr.mailroom_fingerprint_digest(p_topic, p_key, p_payload,
           p_headers, p_type, p_deliver_after, p_max_attempts), 1, 8), 'hex'))::bit(64)::bigint
$$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.mailroom_fingerprint128(p_topic text, p_key text, p_payload bytea,
                                     p_headers jsonb, p_type text,
                                     p_deliver_after timestamptz, p_max_attempts integer)
RETURNS bytea
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT substr(@mr.mailroom_fingerprint_digest(p_topic, p_key, p_payload, p_headers, p_type,
                                              p_deliver_after, p_max_attempts), 1, 16)
$$
$src$,
$src$
CREATE OR REPLACE FUNCTION @mr.mailroom_sql_check(p text, p_topic text, p_key text, p_payload bytea,
                                   p_headers jsonb, p_type text, p_idem text,
                                   p_deliver_after timestamptz, p_max_attempts integer,
                                   s @mr.mailroom_sql_settings)
RETURNS integer
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h_count bigint;
    h_bytes bigint;
    h_nonstring boolean;
    h_empty boolean;
    h_ce boolean;
BEGIN
    IF p_topic IS NULL OR p_topic = ''::text THEN
        RAISE EXCEPTION 'mailroom: %topic is required', p
            USING ERRCODE = 'MR001', COLUMN = p || 'topic'::text;
    END IF;
    IF octet_length(p_topic) > 249 THEN
        RAISE EXCEPTION 'mailroom: %topic must be at most 249 characters', p
            USING ERRCODE = 'MR001', COLUMN = p || 'topic'::text;
    END IF;
    IF p_topic IN ('.'::text, '..'::text) THEN
        RAISE EXCEPTION 'mailroom: %topic must not be ''.'' or ''..''', p
            USING ERRCODE = 'MR001', COLUMN = p || 'topic'::text;
    END IF;
    IF p_topic COLLATE "C" !~ '^[a-zA-Z0-9._-]+$'::text THEN
        RAISE EXCEPTION 'mailroom: %topic may contain only [a-zA-Z0-9._-]', p
            USING ERRCODE = 'MR001', COLUMN = p || 'topic'::text;
    END IF;
    IF octet_length(p_key) > s.max_key_bytes THEN
        RAISE EXCEPTION 'mailroom: %key must be at most % bytes', p, s.max_key_bytes
            USING ERRCODE = 'MR002', COLUMN = p || 'key'::text;
    END IF;
    IF octet_length(p_payload) > s.max_payload_bytes THEN
        RAISE EXCEPTION 'mailroom: %payload is % bytes; the limit is %',
                        p, octet_length(p_payload), s.max_payload_bytes
            USING ERRCODE = 'MR003', COLUMN = p || 'payload'::text;
    END IF;
    IF jsonb_typeof(p_headers) <> 'object'::text THEN
        RAISE EXCEPTION 'mailroom: %headers must be a JSON object of strings', p
            USING ERRCODE = 'MR004', COLUMN = p || 'headers'::text;
    END IF;
    IF p_headers <> '{}'::jsonb THEN
        SELECT count(*),
               coalesce(sum(octet_length(h.key)::bigint + octet_length(h.value #>> '{}'::text[])::bigint), 0::bigint),
               coalesce(bool_or(jsonb_typeof(h.value) <> 'string'::text), false),
               coalesce(bool_or(h.key = ''::text), false),
               coalesce(bool_or(left(h.key, 3) = 'ce_'::text), false)
        INTO h_count, h_bytes, h_nonstring, h_empty, h_ce
        FROM jsonb_each(p_headers) AS h;
        IF h_nonstring THEN
            RAISE EXCEPTION 'mailroom: %headers must be a JSON object of strings', p
                USING ERRCODE = 'MR004', COLUMN = p || 'headers'::text;
        END IF;
        IF h_count > s.max_headers::bigint THEN
            RAISE EXCEPTION 'mailroom: %headers: at most % headers', p, s.max_headers
                USING ERRCODE = 'MR005', COLUMN = p || 'headers'::text;
        END IF;
        IF h_bytes > s.max_header_bytes::bigint THEN
            RAISE EXCEPTION 'mailroom: %headers: at most % bytes of headers in all',
                            p, s.max_header_bytes
                USING ERRCODE = 'MR006', COLUMN = p || 'headers'::text;
        END IF;
        IF h_empty THEN
            RAISE EXCEPTION 'mailroom: %headers: header names must not be empty', p
                USING ERRCODE = 'MR007', COLUMN = p || 'headers'::text;
        END IF;
        IF h_ce THEN
            RAISE EXCEPTION 'mailroom: %headers: header names starting with ''ce_'' are reserved for CloudEvents attributes', p
                USING ERRCODE = 'MR008', COLUMN = p || 'headers'::text;
        END IF;
    END IF;
    IF octet_length(p_type) > 256 THEN
        RAISE EXCEPTION 'mailroom: %type must be at most 256 bytes', p
            USING ERRCODE = 'MR009', COLUMN = p || 'type'::text;
    END IF;
    IF octet_length(p_idem) > 256 THEN
        RAISE EXCEPTION 'mailroom: %idempotency_key must be at most 256 bytes', p
            USING ERRCODE = 'MR010', COLUMN = p || 'idempotency_key'::text;
    END IF;
    IF p_max_attempts < 0 OR p_max_attempts > s.max_attempts_cap THEN
        RAISE EXCEPTION 'mailroom: %max_attempts must be between 0 and %', p, s.max_attempts_cap
            USING ERRCODE = 'MR011', COLUMN = p || 'max_attempts'::text;
    END IF;
    IF NOT isfinite(p_deliver_after)
       OR p_deliver_after < '0001-01-01 00:00:00+00'::timestamptz
       OR p_deliver_after >= '10000-01-01 00:00:00+00'::timestamptz THEN
        RAISE EXCEPTION 'mailroom: %deliver_after is not a valid timestamp (years 0001..9999)', p
            USING ERRCODE = 'MR012', COLUMN = p || 'deliver_after'::text;
    END IF;
    RETURN CASE WHEN coalesce(p_max_attempts, 0) = 0 THEN s.default_max_attempts
                ELSE p_max_attempts END;
END $$
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
    -- The key's order lock, before the insert draws the id (migration 0015).
    IF v_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(@mr.mailroom_order_lock(enqueue.topic, v_key));
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
    -- The keys' order locks in ascending lock id, one by one (two batches over the same
    -- keys take them in the same order), before the insert draws ids.
    FOR lock_id IN
        SELECT DISTINCT @mr.mailroom_order_lock(u.t, u.kk) AS l
        FROM unnest(enqueue_batch.topics, v_key) AS u(t, kk)
        WHERE u.kk IS NOT NULL
        ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(lock_id);
    END LOOP;
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

REVOKE ALL ON FUNCTION mailroom_order_lock(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION mailroom_fingerprint_digest(text, text, bytea, jsonb, text, timestamptz, integer) FROM PUBLIC;

-- The producer role is per database (issue 24, item 2, "Scope"): the cluster-wide
-- `mailroom_producer` let a role granted it for one database enqueue into every database
-- of the cluster with a mailroom. `mailroom_producer_role()` names this database's role:
-- `mailroom_producer_<database>`, or `mailroom_producer_<16 hex of md5(database)>` when
-- that would not fit PostgreSQL's 63 bytes. The migration creates it when it may (else a
-- warning, and a DBA creates it: docs/sql-api.md, "Roles"), grants it the SQL API, and
-- takes the grants away from `mailroom_producer` in this database, naming in a warning
-- how many roles held it (they need the new role: GRANT mailroom_producer_<db> TO ...).
CREATE FUNCTION mailroom_producer_role() RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT CASE WHEN octet_length('mailroom_producer_'::text || current_database()::text) <= 63
            THEN 'mailroom_producer_'::text || current_database()::text
            ELSE 'mailroom_producer_'::text || left(md5(current_database()::text), 16) END
$$;

DO $roles$
DECLARE
    r       text := mailroom_producer_role();
    members bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE WARNING 'mailroom: cannot create role % (no CREATEROLE); see docs/sql-api.md', r;
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
        EXECUTE format('GRANT USAGE ON SCHEMA mailroom TO %I', r);
        EXECUTE format('GRANT EXECUTE ON FUNCTION mailroom.api_version(),
            mailroom.enqueue(text, text, bytea, jsonb, text, text, timestamptz, integer),
            mailroom.enqueue_batch(text[], text[], bytea[], jsonb[], text[], text[], timestamptz[], integer[])
            TO %I', r);
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'mailroom_producer') THEN
        REVOKE EXECUTE ON FUNCTION mailroom.api_version(),
            mailroom.enqueue(text, text, bytea, jsonb, text, text, timestamptz, integer),
            mailroom.enqueue_batch(text[], text[], bytea[], jsonb[], text[], text[], timestamptz[], integer[])
            FROM mailroom_producer;
        REVOKE USAGE ON SCHEMA mailroom FROM mailroom_producer;
        SELECT count(*) INTO members FROM pg_auth_members a JOIN pg_roles g ON g.oid = a.roleid
        WHERE g.rolname = 'mailroom_producer';
        IF members > 0 THEN
            RAISE WARNING 'mailroom: % role(s) hold the cluster-wide mailroom_producer, which no longer grants the SQL API in database %; grant them % instead (docs/sql-api.md, "Roles")',
                members, current_database(), r;
        END IF;
    END IF;
END $roles$;

REVOKE ALL ON FUNCTION mailroom_producer_role() FROM PUBLIC;

-- Relays of binaries before 0015 neither fold uncounted events nor respect order locks:
-- they must not relay on this schema (their enqueues stay correct).
INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (15, 15);
