//! Enqueue and receive: the two writes of new events, each one transaction (or one
//! statement) that `retry_aborted` may run again.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Row};

use super::PgStore;
use crate::domain::{InboundMessage, NewEvent, idempotency_scope};
use crate::store::Admission;
use crate::store::admission::{Holder, admissions, batch_keys, headers_json, inbox_admissions};

/// One statement: the CTE upserts (and so locks) the key rows in byte order (the
/// BTreeMap's, fed through `ORDER BY o`: no collation involved, the same order as the
/// settle's sorted array); the uncorrelated `(SELECT count(*) FROM keys)` is an InitPlan,
/// evaluated before the insert draws its first id. Locking the keys before drawing ids
/// keeps ids and commits in the same order within a key. Idempotency keys already taken
/// insert nothing.
const ENQUEUE: &str = "WITH keys AS (
        INSERT INTO outbox_keys (topic, event_key, ready_at, pending)
        SELECT t, k, COALESCE(r, now()), n
        FROM unnest($10::text[], $11::text[], $12::timestamptz[], $13::int8[])
             WITH ORDINALITY AS u(t, k, r, n, o)
        ORDER BY o
        ON CONFLICT (topic, event_key)
        DO UPDATE SET ready_at = LEAST(outbox_keys.ready_at, EXCLUDED.ready_at),
                      pending = outbox_keys.pending + EXCLUDED.pending
        RETURNING 1)
     INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
         idempotency_key, content_hash, max_attempts, scheduled_at, content_fp,
         content_fp_version)
     SELECT t, k, p, h::jsonb, ty, i, c, m, COALESCE(s, now()), f,
            CASE WHEN f IS NULL THEN NULL ELSE 2 END
     FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::text[], $6::text[],
                 $7::int8[], $8::int4[], $9::timestamptz[], $14::bytea[])
          WITH ORDINALITY AS u(t, k, p, h, ty, i, c, m, s, f, o)
     WHERE (SELECT count(*) FROM keys) >= 0
     ORDER BY o
     ON CONFLICT (topic, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
     RETURNING id, topic, idempotency_key";

/// The events holding idempotency keys that an enqueue found taken.
const HOLDERS: &str = "SELECT e.topic, e.idempotency_key, e.id, e.content_hash, e.content_fp
     FROM outbox_events e
     JOIN unnest($1::text[], $2::text[]) AS w(t, i)
       ON e.topic = w.t AND e.idempotency_key = w.i";

/// Key rows first, in byte order (fed through `ORDER BY o`): the order the settle locks
/// them in, whatever the collation.
const RECEIVE_KEYS: &str = "INSERT INTO inbox_keys (subscription, topic, event_key, ready_at)
     SELECT $1, t, k, now()
     FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS u(t, k, o) ORDER BY o
     ON CONFLICT (subscription, topic, event_key)
     DO UPDATE SET ready_at = LEAST(inbox_keys.ready_at, EXCLUDED.ready_at)";

/// Inbound messages, a message id already held storing nothing.
const RECEIVE: &str = "INSERT INTO inbox_events (subscription, message_id, idempotency_key,
         topic, event_key, payload, headers, event_type, max_attempts, scheduled_at, status,
         last_error)
     SELECT $1, i, i, t, k, p, h::jsonb, ty, m, now(),
            CASE WHEN f IS NULL THEN 'pending' ELSE 'failed' END, f
     FROM unnest($2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[], $7::text[],
                 $8::int4[], $9::text[])
          WITH ORDINALITY AS u(i, t, k, p, h, ty, m, f, o)
     ORDER BY o
     ON CONFLICT (subscription, message_id) DO NOTHING
     RETURNING id, message_id";

/// The rows holding message ids a receive found taken.
const HELD_MESSAGES: &str =
    "SELECT message_id, id FROM inbox_events WHERE subscription = $1 AND message_id = ANY($2)";

/// A batch's distinct keys, sorted, as the enqueue statement's key arrays: the earliest
/// schedule of each, and how many of its events carry no idempotency key (those always
/// insert, so the key upsert counts them; the insert trigger counts the others, see
/// migration 0005).
struct KeyColumns<'a> {
    topic: Vec<&'a str>,
    name: Vec<&'a str>,
    ready: Vec<Option<DateTime<Utc>>>,
    plain: Vec<i64>,
}

impl<'a> KeyColumns<'a> {
    fn of(events: &'a [NewEvent]) -> Self {
        let keys = batch_keys(events);
        let mut plain_per_key: HashMap<(&str, &str), i64> = HashMap::new();
        for e in events.iter().filter(|e| e.idempotency_key.is_none()) {
            if let Some(k) = &e.key {
                *plain_per_key
                    .entry((e.topic.as_str(), k.as_str()))
                    .or_default() += 1;
            }
        }
        let mut c = KeyColumns {
            topic: Vec::with_capacity(keys.len()),
            name: Vec::with_capacity(keys.len()),
            ready: Vec::with_capacity(keys.len()),
            plain: Vec::with_capacity(keys.len()),
        };
        for ((t, k), r) in &keys {
            c.topic.push(*t);
            c.name.push(*k);
            c.ready.push(*r);
            c.plain
                .push(plain_per_key.get(&(*t, *k)).copied().unwrap_or(0));
        }
        c
    }
}

/// A batch's events as the enqueue statement's arrays, in batch order.
struct EventColumns<'a> {
    topic: Vec<&'a str>,
    key: Vec<Option<&'a str>>,
    payload: Vec<&'a [u8]>,
    headers: Vec<String>,
    etype: Vec<Option<&'a str>>,
    idem: Vec<Option<&'a str>>,
    hash: Vec<Option<i64>>,
    fp128: Vec<Option<Vec<u8>>>,
    max_attempts: Vec<i32>,
    sched: Vec<Option<DateTime<Utc>>>,
}

impl<'a> EventColumns<'a> {
    fn of(events: &'a [NewEvent]) -> Self {
        let n = events.len();
        let mut c = EventColumns {
            topic: Vec::with_capacity(n),
            key: Vec::with_capacity(n),
            payload: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
            etype: Vec::with_capacity(n),
            idem: Vec::with_capacity(n),
            hash: Vec::with_capacity(n),
            fp128: Vec::with_capacity(n),
            max_attempts: Vec::with_capacity(n),
            sched: Vec::with_capacity(n),
        };
        for e in events {
            c.topic.push(e.topic.as_str());
            c.key.push(e.key.as_deref());
            c.payload.push(e.payload.as_slice());
            c.headers.push(headers_json(&e.headers));
            c.etype.push(e.event_type.as_deref());
            c.idem.push(e.idempotency_key.as_deref());
            c.hash
                .push(e.idempotency_key.as_ref().map(|_| e.fingerprint()));
            c.fp128
                .push(e.idempotency_key.as_ref().map(|_| e.fingerprint128()));
            c.max_attempts.push(e.max_attempts as i32);
            c.sched.push(e.deliver_after);
        }
        c
    }
}

/// Inbound messages as the receive statement's arrays, in batch order.
struct MessageColumns<'a> {
    mid: Vec<&'a str>,
    topic: Vec<&'a str>,
    key: Vec<Option<&'a str>>,
    payload: Vec<&'a [u8]>,
    headers: Vec<String>,
    etype: Vec<Option<&'a str>>,
    max: Vec<i32>,
    failure: Vec<Option<&'a str>>,
}

impl<'a> MessageColumns<'a> {
    fn of(messages: &'a [InboundMessage]) -> Self {
        let n = messages.len();
        let mut c = MessageColumns {
            mid: Vec::with_capacity(n),
            topic: Vec::with_capacity(n),
            key: Vec::with_capacity(n),
            payload: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
            etype: Vec::with_capacity(n),
            max: Vec::with_capacity(n),
            failure: Vec::with_capacity(n),
        };
        for m in messages {
            c.mid.push(m.message_id.as_str());
            c.topic.push(m.topic.as_str());
            c.key.push(m.key.as_deref());
            c.payload.push(m.payload.as_slice());
            c.headers.push(headers_json(&m.headers));
            c.etype.push(m.event_type.as_deref());
            c.max.push(m.max_attempts as i32);
            c.failure.push(m.failure.as_deref());
        }
        c
    }
}

/// The ids the enqueue statement returned: of events without an idempotency key, in
/// order, and of the others by their (topic-scoped) key.
type Inserted = (Vec<i64>, HashMap<String, i64>);

fn inserted(rows: &[PgRow]) -> Result<Inserted, sqlx::Error> {
    let mut plain = Vec::new();
    let mut by_key = HashMap::new();
    for r in rows {
        let id: i64 = r.try_get(0)?;
        match r.try_get::<Option<String>, _>(2)? {
            None => plain.push(id),
            Some(k) => {
                by_key.insert(idempotency_scope(r.try_get::<&str, _>(1)?, &k), id);
            }
        }
    }
    Ok((plain, by_key))
}

/// The bodies of the store calls that PostgreSQL may abort as a deadlock victim or a
/// serialization failure; `retry_aborted` runs them again.
impl PgStore {
    pub(super) async fn enqueue_once(
        &self,
        events: &[NewEvent],
        atomic: bool,
    ) -> Result<Vec<Admission>, sqlx::Error> {
        let k = KeyColumns::of(events);
        let e = EventColumns::of(events);
        let insert = sqlx::query(AssertSqlSafe(self.text(ENQUEUE)))
            .bind(&e.topic)
            .bind(&e.key)
            .bind(&e.payload)
            .bind(&e.headers)
            .bind(&e.etype)
            .bind(&e.idem)
            .bind(&e.hash)
            .bind(&e.max_attempts)
            .bind(&e.sched)
            .bind(&k.topic)
            .bind(&k.name)
            .bind(&k.ready)
            .bind(&k.plain)
            .bind(&e.fp128);
        let has_idem = events.iter().any(|e| e.idempotency_key.is_some());
        // An atomic batch that may conflict needs a transaction it can roll back. Anything
        // else is one statement in autocommit: one round trip, and the holders of taken
        // idempotency keys are read after the commit (their content never changes).
        let mut tx = if atomic && has_idem {
            Some(self.pool.begin().await?)
        } else {
            None
        };
        let rows = match tx.as_mut() {
            Some(tx) => insert.fetch_all(&mut **tx).await?,
            None => insert.fetch_all(&self.pool).await?,
        };
        let (plain, by_key) = inserted(&rows)?;
        let (missing_topics, missing): (Vec<&str>, Vec<&str>) = events
            .iter()
            .filter_map(|e| Some((e.topic.as_str(), e.idempotency_key.as_deref()?)))
            .filter(|(t, k)| !by_key.contains_key(&idempotency_scope(t, k)))
            .unzip();
        let mut existing = HashMap::new();
        if !missing.is_empty() {
            let q = sqlx::query(AssertSqlSafe(self.text(HOLDERS)))
                .bind(&missing_topics)
                .bind(&missing);
            let holders = match tx.as_mut() {
                Some(tx) => q.fetch_all(&mut **tx).await?,
                None => q.fetch_all(&self.pool).await?,
            };
            for r in holders {
                existing.insert(
                    idempotency_scope(r.try_get::<&str, _>(0)?, r.try_get::<&str, _>(1)?),
                    (
                        r.try_get::<i64, _>(2)?,
                        Holder::of(r.try_get(3)?, r.try_get(4)?),
                    ),
                );
            }
        }
        let result = admissions(events, plain, &by_key, &existing);
        if let Some(tx) = tx {
            if result.contains(&Admission::Conflict) {
                tx.rollback().await?;
            } else {
                tx.commit().await?;
            }
        }
        Ok(result)
    }

    pub(super) async fn receive_once(
        &self,
        subscription: &str,
        messages: &[InboundMessage],
    ) -> Result<Vec<Admission>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        // Messages stored as failed need no key row: they never hold their key.
        let keys: std::collections::BTreeSet<(&str, &str)> = messages
            .iter()
            .filter(|m| m.failure.is_none())
            .filter_map(|m| m.key.as_deref().map(|k| (m.topic.as_str(), k)))
            .collect();
        if !keys.is_empty() {
            let (topics, names): (Vec<&str>, Vec<&str>) = keys.into_iter().unzip();
            sqlx::query(AssertSqlSafe(self.text(RECEIVE_KEYS)))
                .bind(subscription)
                .bind(&topics)
                .bind(&names)
                .execute(&mut *tx)
                .await?;
        }
        let c = MessageColumns::of(messages);
        let rows = sqlx::query(AssertSqlSafe(self.text(RECEIVE)))
            .bind(subscription)
            .bind(&c.mid)
            .bind(&c.topic)
            .bind(&c.key)
            .bind(&c.payload)
            .bind(&c.headers)
            .bind(&c.etype)
            .bind(&c.max)
            .bind(&c.failure)
            .fetch_all(&mut *tx)
            .await?;
        let mut inserted = HashMap::new();
        for r in &rows {
            inserted.insert(r.try_get::<String, _>(1)?, r.try_get::<i64, _>(0)?);
        }
        let missing: Vec<&str> = c
            .mid
            .iter()
            .copied()
            .filter(|m| !inserted.contains_key(*m))
            .collect();
        let mut existing = HashMap::new();
        if !missing.is_empty() {
            for r in sqlx::query(AssertSqlSafe(self.text(HELD_MESSAGES)))
                .bind(subscription)
                .bind(&missing)
                .fetch_all(&mut *tx)
                .await?
            {
                existing.insert(r.try_get::<String, _>(0)?, r.try_get::<i64, _>(1)?);
            }
        }
        tx.commit().await?;
        Ok(inbox_admissions(messages, &inserted, &existing))
    }
}
