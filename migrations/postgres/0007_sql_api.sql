-- The SQL API, version 1 (issue 16): enqueue inside the caller's own transaction.
--
-- The contract is the functions in schema `mailroom` (docs/sql-api.md); the tables stay
-- private and may change. The functions run as their owner (the role that migrates),
-- with a pinned search_path; role `mailroom_producer` gets USAGE on the schema and
-- EXECUTE on the functions, nothing else. PostgreSQL only: the embedded SQLite default
-- has no other writer that could share a transaction with it.
--
-- The rules are those of gRPC Enqueue (src/api/convert.rs) with the limits of the
-- settings row below (gRPC's defaults): one SQLSTATE per rule, in class MR. Ids are drawn
-- after the key row is locked (upserted), as the gRPC enqueue does, and the key row stays
-- locked until the caller commits: ids and commits agree within a key. Pending counts are
-- kept as the gRPC enqueue keeps them (migration 0005): the key upsert counts events
-- without an idempotency key, the insert trigger counts the others.

-- Limits and switches of the SQL API (one row). The owner may UPDATE it to match a
-- service started with other limits.
CREATE TABLE mailroom_sql_settings (
    singleton            BOOLEAN PRIMARY KEY DEFAULT true CHECK (singleton),
    max_payload_bytes    INTEGER NOT NULL DEFAULT 1048576,
    max_headers          INTEGER NOT NULL DEFAULT 64,
    max_header_bytes     INTEGER NOT NULL DEFAULT 16384,
    max_key_bytes        INTEGER NOT NULL DEFAULT 1024,
    max_batch            INTEGER NOT NULL DEFAULT 1000,
    max_attempts_cap     INTEGER NOT NULL DEFAULT 100,
    default_max_attempts INTEGER NOT NULL DEFAULT 6,
    -- NOTIFY mailroom_outbox from the caller's transaction (delivered on commit).
    notify               BOOLEAN NOT NULL DEFAULT true
);
INSERT INTO mailroom_sql_settings DEFAULT VALUES;

-- The content fingerprint, version 2 (src/domain.rs `NewEvent::fingerprint`, computed
-- the same way there): the first 8 bytes, big-endian, of SHA-256 over
--   F(topic) O(key) F(payload) be64(n) {F(name) F(value)}* O(type) O(be64(µs)) F(be32(max))
-- with F(b) = be64(len b) || b, O(NULL) = 0x00, O(b) = 0x01 || F(b); headers sorted by
-- name in byte order, without traceparent and tracestate (trace context is not content).
CREATE FUNCTION mailroom_fp_field(b bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT int8send(octet_length(b)::bigint) || b $$;

CREATE FUNCTION mailroom_fp_opt(b bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN b IS NULL THEN '\x00'::bytea
                  ELSE '\x01'::bytea || int8send(octet_length(b)::bigint) || b END $$;

CREATE FUNCTION mailroom_fingerprint(p_topic text, p_key text, p_payload bytea,
                                     p_headers jsonb, p_type text,
                                     p_deliver_after timestamptz, p_max_attempts integer)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
SELECT ('x' || encode(substr(sha256(
           mailroom_fp_field(convert_to(p_topic, 'UTF8'))
        || mailroom_fp_opt(convert_to(p_key, 'UTF8'))
        || mailroom_fp_field(p_payload)
        || (SELECT int8send(count(*))
                   || coalesce(string_agg(mailroom_fp_field(convert_to(h.k, 'UTF8'))
                                          || mailroom_fp_field(convert_to(h.v, 'UTF8')),
                                          ''::bytea ORDER BY h.k COLLATE "C"), ''::bytea)
            FROM jsonb_each_text(coalesce(p_headers, '{}'::jsonb)) AS h(k, v)
            WHERE h.k NOT IN ('traceparent', 'tracestate'))
        || mailroom_fp_opt(convert_to(p_type, 'UTF8'))
        || mailroom_fp_opt(int8send(floor(extract(epoch FROM p_deliver_after) * 1000000)::bigint))
        || mailroom_fp_field(int4send(p_max_attempts))
       ), 1, 8), 'hex'))::bit(64)::bigint
$$;

-- Validates one event (p: '' or 'events[i].', prefixed to argument names in messages);
-- returns the resolved attempt budget. Every rule has its own SQLSTATE (docs/sql-api.md);
-- the COLUMN field of the error names the argument.
CREATE FUNCTION mailroom_sql_check(p text, p_topic text, p_key text, p_payload bytea,
                                   p_headers jsonb, p_type text, p_idem text,
                                   p_deliver_after timestamptz, p_max_attempts integer,
                                   s mailroom_sql_settings)
RETURNS integer
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    h_count bigint;
    h_bytes bigint;
    h_nonstring boolean;
    h_empty boolean;
    h_ce boolean;
BEGIN
    IF p_topic IS NULL OR p_topic = '' THEN
        RAISE EXCEPTION 'mailroom: %topic is required', p
            USING ERRCODE = 'MR001', COLUMN = p || 'topic';
    END IF;
    IF octet_length(p_topic) > 249 THEN
        RAISE EXCEPTION 'mailroom: %topic must be at most 249 characters', p
            USING ERRCODE = 'MR001', COLUMN = p || 'topic';
    END IF;
    IF p_topic IN ('.', '..') THEN
        RAISE EXCEPTION 'mailroom: %topic must not be ''.'' or ''..''', p
            USING ERRCODE = 'MR001', COLUMN = p || 'topic';
    END IF;
    IF p_topic COLLATE "C" !~ '^[a-zA-Z0-9._-]+$' THEN
        RAISE EXCEPTION 'mailroom: %topic may contain only [a-zA-Z0-9._-]', p
            USING ERRCODE = 'MR001', COLUMN = p || 'topic';
    END IF;
    IF octet_length(p_key) > s.max_key_bytes THEN
        RAISE EXCEPTION 'mailroom: %key must be at most % bytes', p, s.max_key_bytes
            USING ERRCODE = 'MR002', COLUMN = p || 'key';
    END IF;
    IF octet_length(p_payload) > s.max_payload_bytes THEN
        RAISE EXCEPTION 'mailroom: %payload is % bytes; the limit is %',
                        p, octet_length(p_payload), s.max_payload_bytes
            USING ERRCODE = 'MR003', COLUMN = p || 'payload';
    END IF;
    IF jsonb_typeof(p_headers) <> 'object' THEN
        RAISE EXCEPTION 'mailroom: %headers must be a JSON object of strings', p
            USING ERRCODE = 'MR004', COLUMN = p || 'headers';
    END IF;
    IF p_headers <> '{}'::jsonb THEN
        SELECT count(*),
               coalesce(sum(octet_length(h.key) + octet_length(h.value #>> '{}')), 0),
               coalesce(bool_or(jsonb_typeof(h.value) <> 'string'), false),
               coalesce(bool_or(h.key = ''), false),
               coalesce(bool_or(left(h.key, 3) = 'ce_'), false)
        INTO h_count, h_bytes, h_nonstring, h_empty, h_ce
        FROM jsonb_each(p_headers) AS h;
        IF h_nonstring THEN
            RAISE EXCEPTION 'mailroom: %headers must be a JSON object of strings', p
                USING ERRCODE = 'MR004', COLUMN = p || 'headers';
        END IF;
        IF h_count > s.max_headers THEN
            RAISE EXCEPTION 'mailroom: %headers: at most % headers', p, s.max_headers
                USING ERRCODE = 'MR005', COLUMN = p || 'headers';
        END IF;
        IF h_bytes > s.max_header_bytes THEN
            RAISE EXCEPTION 'mailroom: %headers: at most % bytes of headers in all',
                            p, s.max_header_bytes
                USING ERRCODE = 'MR006', COLUMN = p || 'headers';
        END IF;
        IF h_empty THEN
            RAISE EXCEPTION 'mailroom: %headers: header names must not be empty', p
                USING ERRCODE = 'MR007', COLUMN = p || 'headers';
        END IF;
        IF h_ce THEN
            RAISE EXCEPTION 'mailroom: %headers: header names starting with ''ce_'' are reserved for CloudEvents attributes', p
                USING ERRCODE = 'MR008', COLUMN = p || 'headers';
        END IF;
    END IF;
    IF octet_length(p_type) > 256 THEN
        RAISE EXCEPTION 'mailroom: %type must be at most 256 bytes', p
            USING ERRCODE = 'MR009', COLUMN = p || 'type';
    END IF;
    IF octet_length(p_idem) > 256 THEN
        RAISE EXCEPTION 'mailroom: %idempotency_key must be at most 256 bytes', p
            USING ERRCODE = 'MR010', COLUMN = p || 'idempotency_key';
    END IF;
    IF p_max_attempts < 0 OR p_max_attempts > s.max_attempts_cap THEN
        RAISE EXCEPTION 'mailroom: %max_attempts must be between 0 and %', p, s.max_attempts_cap
            USING ERRCODE = 'MR011', COLUMN = p || 'max_attempts';
    END IF;
    IF NOT isfinite(p_deliver_after)
       OR p_deliver_after < '0001-01-01 00:00:00+00'::timestamptz
       OR p_deliver_after >= '10000-01-01 00:00:00+00'::timestamptz THEN
        RAISE EXCEPTION 'mailroom: %deliver_after is not a valid timestamp (years 0001..9999)', p
            USING ERRCODE = 'MR012', COLUMN = p || 'deliver_after';
    END IF;
    RETURN CASE WHEN coalesce(p_max_attempts, 0) = 0 THEN s.default_max_attempts
                ELSE p_max_attempts END;
END $$;

CREATE SCHEMA mailroom;

CREATE FUNCTION mailroom.api_version() RETURNS integer
LANGUAGE sql IMMUTABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 1 $$;

-- One event. Returns its id; an idempotent retry (same idempotency key, same content)
-- returns the original id; the same key with other content is SQLSTATE MR020.
CREATE FUNCTION mailroom.enqueue(
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
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    s          mailroom_sql_settings;
    v_key      text  := nullif(enqueue.key, '');
    v_type     text  := nullif(enqueue.type, '');
    v_idem     text  := nullif(enqueue.idempotency_key, '');
    v_payload  bytea := coalesce(enqueue.payload, '\x'::bytea);
    v_headers  jsonb := coalesce(enqueue.headers, '{}'::jsonb);
    v_at       timestamptz := coalesce(enqueue.deliver_after, now());
    v_max      integer;
    v_hash     bigint;
    v_id       bigint;
    v_held     bigint;
BEGIN
    SELECT * INTO STRICT s FROM mailroom_sql_settings;
    v_max := mailroom_sql_check('', enqueue.topic, v_key, v_payload, v_headers, v_type,
                                v_idem, enqueue.deliver_after, enqueue.max_attempts, s);
    IF v_idem IS NOT NULL THEN
        v_hash := mailroom_fingerprint(enqueue.topic, v_key, v_payload, v_headers, v_type,
                                       enqueue.deliver_after, v_max);
    END IF;
    -- Lock (upsert) the key row before the insert draws the id.
    IF v_key IS NOT NULL THEN
        INSERT INTO outbox_keys AS k (topic, event_key, ready_at, pending)
        VALUES (enqueue.topic, v_key, v_at, CASE WHEN v_idem IS NULL THEN 1 ELSE 0 END)
        ON CONFLICT (topic, event_key)
        DO UPDATE SET ready_at = LEAST(k.ready_at, EXCLUDED.ready_at),
                      pending = k.pending + EXCLUDED.pending;
    END IF;
    INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                               idempotency_key, content_hash, max_attempts, scheduled_at)
    VALUES (enqueue.topic, v_key, v_payload, v_headers, v_type, v_idem, v_hash, v_max, v_at)
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT e.id, e.content_hash INTO v_id, v_held
        FROM outbox_events e WHERE e.idempotency_key = v_idem;
        IF v_held IS DISTINCT FROM v_hash THEN
            RAISE EXCEPTION 'mailroom: idempotency_key is already used by an event with other content'
                USING ERRCODE = 'MR020', COLUMN = 'idempotency_key';
        END IF;
        RETURN v_id;
    END IF;
    IF s.notify THEN
        PERFORM pg_notify('mailroom_outbox', '');
    END IF;
    RETURN v_id;
END $$;

-- Several events, all or none (an error aborts the statement, and so the caller's
-- transaction or savepoint). Parallel arrays, one element per event; topics is required,
-- any other array may be NULL (every event takes the default) or must have as many
-- elements. Returns one row per event: its 1-based position, id and whether it was an
-- idempotent duplicate. Key rows are locked in byte order of (topic, key), the order the
-- gRPC enqueue and the relays' settle take them in.
CREATE FUNCTION mailroom.enqueue_batch(
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
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    s        mailroom_sql_settings;
    n        integer := coalesce(cardinality(enqueue_batch.topics), 0);
    v_key    text[]        := array_fill(NULL::text, ARRAY[n]);
    v_type   text[]        := array_fill(NULL::text, ARRAY[n]);
    v_idem   text[]        := array_fill(NULL::text, ARRAY[n]);
    v_pay    bytea[]       := array_fill(NULL::bytea, ARRAY[n]);
    v_hdr    jsonb[]       := array_fill(NULL::jsonb, ARRAY[n]);
    v_after  timestamptz[] := array_fill(NULL::timestamptz, ARRAY[n]);
    v_max    integer[]     := array_fill(NULL::integer, ARRAY[n]);
    v_hash   bigint[]      := array_fill(NULL::bigint, ARRAY[n]);
    plain    bigint[];
    taken    bigint[];
    p        integer := 0;
    arr      text;
    len      integer;
    i        integer;
    r_id     bigint;
    r_hash   bigint;
BEGIN
    SELECT * INTO STRICT s FROM mailroom_sql_settings;
    IF n = 0 THEN
        RAISE EXCEPTION 'mailroom: topics must not be empty'
            USING ERRCODE = 'MR030', COLUMN = 'topics';
    END IF;
    IF n > s.max_batch THEN
        RAISE EXCEPTION 'mailroom: % events; at most % per batch', n, s.max_batch
            USING ERRCODE = 'MR031', COLUMN = 'topics';
    END IF;
    FOR arr, len IN VALUES
        ('keys', cardinality(enqueue_batch.keys)),
        ('payloads', cardinality(enqueue_batch.payloads)),
        ('headers', cardinality(enqueue_batch.headers)),
        ('types', cardinality(enqueue_batch.types)),
        ('idempotency_keys', cardinality(enqueue_batch.idempotency_keys)),
        ('deliver_afters', cardinality(enqueue_batch.deliver_afters)),
        ('max_attempts', cardinality(enqueue_batch.max_attempts))
    LOOP
        IF len IS NOT NULL AND len <> n THEN
            RAISE EXCEPTION 'mailroom: % has % elements; topics has %', arr, len, n
                USING ERRCODE = 'MR032', COLUMN = arr;
        END IF;
    END LOOP;
    FOR i IN 1 .. n LOOP
        v_key[i]   := nullif(enqueue_batch.keys[i], '');
        v_type[i]  := nullif(enqueue_batch.types[i], '');
        v_idem[i]  := nullif(enqueue_batch.idempotency_keys[i], '');
        v_pay[i]   := coalesce(enqueue_batch.payloads[i], '\x'::bytea);
        v_hdr[i]   := coalesce(enqueue_batch.headers[i], '{}'::jsonb);
        v_after[i] := enqueue_batch.deliver_afters[i];
        v_max[i]   := mailroom_sql_check('events[' || i || '].', enqueue_batch.topics[i],
                                         v_key[i], v_pay[i], v_hdr[i], v_type[i], v_idem[i],
                                         v_after[i], enqueue_batch.max_attempts[i], s);
        IF v_idem[i] IS NOT NULL THEN
            v_hash[i] := mailroom_fingerprint(enqueue_batch.topics[i], v_key[i], v_pay[i],
                                              v_hdr[i], v_type[i], v_after[i], v_max[i]);
        END IF;
    END LOOP;
    -- Lock (upsert) the key rows in byte order before the insert draws ids. The upsert
    -- counts events without an idempotency key; the insert trigger counts the others.
    INSERT INTO outbox_keys AS k (topic, event_key, ready_at, pending)
    SELECT g.t, g.kk, g.r, g.c
    FROM (SELECT u.t, u.kk,
                 CASE WHEN bool_or(u.a IS NULL) THEN now() ELSE min(u.a) END AS r,
                 count(*) FILTER (WHERE u.i IS NULL) AS c
          FROM unnest(enqueue_batch.topics, v_key, v_after, v_idem) AS u(t, kk, a, i)
          WHERE u.kk IS NOT NULL
          GROUP BY u.t, u.kk) g
    ORDER BY g.t COLLATE "C", g.kk COLLATE "C"
    ON CONFLICT (topic, event_key)
    DO UPDATE SET ready_at = LEAST(k.ready_at, EXCLUDED.ready_at),
                  pending = k.pending + EXCLUDED.pending;
    -- Ids are drawn in array order.
    WITH ins AS (
        INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                                   idempotency_key, content_hash, max_attempts, scheduled_at)
        SELECT u.t, u.kk, u.p, u.h, u.ty, u.i, u.c, u.m, coalesce(u.a, now())
        FROM unnest(enqueue_batch.topics, v_key, v_pay, v_hdr, v_type, v_idem, v_hash,
                    v_max, v_after) WITH ORDINALITY AS u(t, kk, p, h, ty, i, c, m, a, o)
        ORDER BY u.o
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
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
            SELECT e.id, e.content_hash INTO r_id, r_hash
            FROM outbox_events e WHERE e.idempotency_key = v_idem[i];
            IF r_hash IS DISTINCT FROM v_hash[i] THEN
                RAISE EXCEPTION 'mailroom: events[%].idempotency_key is already used by an event with other content', i
                    USING ERRCODE = 'MR020', COLUMN = 'events[' || i || '].idempotency_key';
            END IF;
            ord := i; id := r_id;
            duplicate := NOT (r_id = ANY (coalesce(taken, '{}')))
                         OR (i > 1 AND v_idem[i] = ANY (v_idem[1:i - 1]));
        END IF;
        RETURN NEXT;
    END LOOP;
    IF s.notify AND (plain IS NOT NULL OR taken IS NOT NULL) THEN
        PERFORM pg_notify('mailroom_outbox', '');
    END IF;
END $$;

-- The functions find the private tables through their pinned search_path: pin it to the
-- schema this migration runs in (`public` unless the database URL chose another).
DO $$
BEGIN
    IF current_schema() <> 'public' THEN
        EXECUTE format('ALTER FUNCTION mailroom.enqueue(text, text, bytea, jsonb, text, text, timestamptz, integer) SET search_path = pg_catalog, %I, pg_temp', current_schema());
        EXECUTE format('ALTER FUNCTION mailroom.enqueue_batch(text[], text[], bytea[], jsonb[], text[], text[], timestamptz[], integer[]) SET search_path = pg_catalog, %I, pg_temp', current_schema());
    END IF;
END $$;

-- Least privilege: nobody but the owner may call anything here, except through the role.
REVOKE ALL ON SCHEMA mailroom FROM PUBLIC;
REVOKE ALL ON FUNCTION mailroom.api_version() FROM PUBLIC;
REVOKE ALL ON FUNCTION mailroom.enqueue(text, text, bytea, jsonb, text, text, timestamptz, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION mailroom.enqueue_batch(text[], text[], bytea[], jsonb[], text[], text[], timestamptz[], integer[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION mailroom_fp_field(bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION mailroom_fp_opt(bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION mailroom_fingerprint(text, text, bytea, jsonb, text, timestamptz, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION mailroom_sql_check(text, text, text, bytea, jsonb, text, text, timestamptz, integer, mailroom_sql_settings) FROM PUBLIC;

-- The producer role (cluster-wide, NOLOGIN): created when missing and the migrating role
-- may create roles; otherwise a warning, and a DBA runs the statements of
-- docs/sql-api.md ("Roles"). Databases migrating at the same time may race to create it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'mailroom_producer') THEN
        BEGIN
            CREATE ROLE mailroom_producer NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE WARNING 'mailroom: cannot create role mailroom_producer (no CREATEROLE); see docs/sql-api.md';
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'mailroom_producer') THEN
        GRANT USAGE ON SCHEMA mailroom TO mailroom_producer;
        GRANT EXECUTE ON FUNCTION mailroom.api_version() TO mailroom_producer;
        GRANT EXECUTE ON FUNCTION mailroom.enqueue(text, text, bytea, jsonb, text, text, timestamptz, integer) TO mailroom_producer;
        GRANT EXECUTE ON FUNCTION mailroom.enqueue_batch(text[], text[], bytea[], jsonb[], text[], text[], timestamptz[], integer[]) TO mailroom_producer;
    END IF;
END $$;
