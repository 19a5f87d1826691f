-- The SQL API after migration 0008 (issue 12): idempotency keys are scoped by topic (the
-- unique index is on (topic, idempotency_key)), and new rows carry the 128-bit content
-- fingerprint (`content_fp`, version 2). `mailroom_fingerprint128` is the first 16 bytes
-- of the same SHA-256 digest whose first 8 bytes are `mailroom_fingerprint` and Rust's
-- `NewEvent::fingerprint128` / `fingerprint`. A holder with a `content_fp` is compared on
-- it; older rows on `content_hash`. The functions keep their signatures, owner, grants
-- and contract (docs/sql-api.md); only their bodies change.

CREATE FUNCTION mailroom_fingerprint128(p_topic text, p_key text, p_payload bytea,
                                     p_headers jsonb, p_type text,
                                     p_deliver_after timestamptz, p_max_attempts integer)
RETURNS bytea
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
SELECT substr(sha256(
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
       ), 1, 16)
$$;

-- One event. Returns its id; an idempotent retry (same idempotency key, same content)
-- returns the original id; the same key with other content is SQLSTATE MR020.
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
    v_fp       bytea;
    v_held_fp  bytea;
BEGIN
    SELECT * INTO STRICT s FROM mailroom_sql_settings;
    v_max := mailroom_sql_check('', enqueue.topic, v_key, v_payload, v_headers, v_type,
                                v_idem, enqueue.deliver_after, enqueue.max_attempts, s);
    IF v_idem IS NOT NULL THEN
        v_hash := mailroom_fingerprint(enqueue.topic, v_key, v_payload, v_headers, v_type,
                                       enqueue.deliver_after, v_max);
        v_fp := mailroom_fingerprint128(enqueue.topic, v_key, v_payload, v_headers, v_type,
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
                               idempotency_key, content_hash, max_attempts, scheduled_at,
                               content_fp, content_fp_version)
    VALUES (enqueue.topic, v_key, v_payload, v_headers, v_type, v_idem, v_hash, v_max, v_at,
            v_fp, CASE WHEN v_fp IS NULL THEN NULL ELSE 2 END)
    ON CONFLICT (topic, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT e.id, e.content_hash, e.content_fp INTO v_id, v_held, v_held_fp
        FROM outbox_events e WHERE e.topic = enqueue.topic AND e.idempotency_key = v_idem;
        IF (v_held_fp IS NOT NULL AND v_held_fp IS DISTINCT FROM v_fp)
           OR (v_held_fp IS NULL AND v_held IS DISTINCT FROM v_hash) THEN
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
    v_fp     bytea[]       := array_fill(NULL::bytea, ARRAY[n]);
    plain    bigint[];
    taken    bigint[];
    p        integer := 0;
    arr      text;
    len      integer;
    i        integer;
    r_id     bigint;
    r_hash   bigint;
    r_fp     bytea;
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
            v_fp[i] := mailroom_fingerprint128(enqueue_batch.topics[i], v_key[i], v_pay[i],
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
                                   idempotency_key, content_hash, max_attempts, scheduled_at,
                                   content_fp, content_fp_version)
        SELECT u.t, u.kk, u.p, u.h, u.ty, u.i, u.c, u.m, coalesce(u.a, now()),
               u.f, CASE WHEN u.f IS NULL THEN NULL ELSE 2 END
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
            FROM outbox_events e
            WHERE e.topic = enqueue_batch.topics[i] AND e.idempotency_key = v_idem[i];
            IF (r_fp IS NOT NULL AND r_fp IS DISTINCT FROM v_fp[i])
               OR (r_fp IS NULL AND r_hash IS DISTINCT FROM v_hash[i]) THEN
                RAISE EXCEPTION 'mailroom: events[%].idempotency_key is already used by an event with other content', i
                    USING ERRCODE = 'MR020', COLUMN = 'events[' || i || '].idempotency_key';
            END IF;
            ord := i; id := r_id;
            duplicate := NOT (r_id = ANY (coalesce(taken, '{}')))
                         OR EXISTS (SELECT 1 FROM generate_series(1, i - 1) AS j
                                    WHERE v_idem[j] = v_idem[i]
                                      AND enqueue_batch.topics[j] = enqueue_batch.topics[i]);
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

REVOKE ALL ON FUNCTION mailroom_fingerprint128(text, text, bytea, jsonb, text, timestamptz, integer) FROM PUBLIC;
