//! Enqueue and receive on SQLite: each one `BEGIN IMMEDIATE` transaction, a statement per
//! key row and per event.

use std::collections::HashMap;

use chrono::Utc;
use sqlx::Row;

use super::{SqliteStore, micros};
use crate::domain::{InboundMessage, NewEvent, idempotency_scope};
use crate::store::admission::{Holder, admissions, batch_keys, headers_json, inbox_admissions};
use crate::store::{Admission, StoreError, StoreResult};

/// A key row, created or woken.
const UPSERT_KEY: &str = "INSERT INTO outbox_keys (topic, event_key, ready_at) VALUES (?1, ?2, ?3)
     ON CONFLICT (topic, event_key) DO UPDATE SET ready_at = MIN(ready_at, excluded.ready_at)";

/// One event; an idempotency key already taken inserts nothing (and returns no id).
const INSERT_EVENT: &str = "INSERT INTO outbox_events (topic, event_key, payload, headers,
         event_type, idempotency_key, content_hash, max_attempts, scheduled_at, created_at,
         updated_at, content_fp, content_fp_version)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10, ?11,
             CASE WHEN ?11 IS NULL THEN NULL ELSE 2 END)
     ON CONFLICT (topic, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
     RETURNING id";

/// The event holding an idempotency key.
const HOLDER: &str = "SELECT id, content_hash, content_fp FROM outbox_events
     WHERE topic = ?1 AND idempotency_key = ?2";

/// Inserts one event: its new id, or `None` when its idempotency key is taken.
async fn insert_event(
    tx: &mut sqlx::SqliteConnection,
    e: &NewEvent,
    now: i64,
) -> StoreResult<Option<i64>> {
    let row = sqlx::query(INSERT_EVENT)
        .bind(&e.topic)
        .bind(&e.key)
        .bind(&e.payload)
        .bind(headers_json(&e.headers))
        .bind(&e.event_type)
        .bind(&e.idempotency_key)
        .bind(e.idempotency_key.as_ref().map(|_| e.fingerprint()))
        .bind(e.max_attempts as i64)
        .bind(e.deliver_after.map(micros).unwrap_or(now))
        .bind(now)
        .bind(e.idempotency_key.as_ref().map(|_| e.fingerprint128()))
        .fetch_optional(tx)
        .await?;
    Ok(match row {
        Some(r) => Some(r.try_get::<i64, _>(0)?),
        None => None,
    })
}

impl SqliteStore {
    pub(super) async fn insert_events(
        &self,
        events: &[NewEvent],
        atomic: bool,
    ) -> StoreResult<Vec<Admission>> {
        let now = micros(Utc::now());
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        for ((topic, key), ready) in batch_keys(events) {
            sqlx::query(UPSERT_KEY)
                .bind(topic)
                .bind(key)
                .bind(ready.map(micros).unwrap_or(now))
                .execute(&mut *tx)
                .await?;
        }
        let mut plain = Vec::new();
        let mut by_key = HashMap::new();
        let mut missing = Vec::new();
        for e in events {
            match (insert_event(&mut tx, e, now).await?, &e.idempotency_key) {
                (Some(id), None) => plain.push(id),
                (Some(id), Some(k)) => {
                    by_key.entry(idempotency_scope(&e.topic, k)).or_insert(id);
                }
                (None, Some(k)) => missing.push((e.topic.clone(), k.clone())),
                (None, None) => {
                    return Err(StoreError::other(
                        "insert without idempotency key returned no id",
                    ));
                }
            }
        }
        let mut existing = HashMap::new();
        for (t, k) in missing {
            let holder = sqlx::query(HOLDER)
                .bind(&t)
                .bind(&k)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(r) = holder {
                existing.insert(
                    idempotency_scope(&t, &k),
                    (
                        r.try_get::<i64, _>(0)?,
                        Holder::of(r.try_get(1)?, r.try_get(2)?),
                    ),
                );
            }
        }
        let result = admissions(events, plain, &by_key, &existing);
        if atomic && result.contains(&Admission::Conflict) {
            tx.rollback().await?;
        } else {
            tx.commit().await?;
        }
        Ok(result)
    }

    pub(super) async fn insert_messages(
        &self,
        subscription: &str,
        messages: &[InboundMessage],
    ) -> StoreResult<Vec<Admission>> {
        let now = micros(Utc::now());
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let keys: std::collections::BTreeSet<(&str, &str)> = messages
            .iter()
            .filter(|m| m.failure.is_none())
            .filter_map(|m| m.key.as_deref().map(|k| (m.topic.as_str(), k)))
            .collect();
        for (topic, key) in keys {
            sqlx::query(
                "INSERT INTO inbox_keys (subscription, topic, event_key, ready_at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (subscription, topic, event_key) DO UPDATE SET ready_at = MIN(ready_at, excluded.ready_at)",
            )
            .bind(subscription)
            .bind(topic)
            .bind(key)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        let mut inserted = HashMap::new();
        let mut existing = HashMap::new();
        for m in messages {
            let row = sqlx::query(
                "INSERT INTO inbox_events (subscription, message_id, idempotency_key, topic, event_key,
                     payload, headers, event_type, max_attempts, scheduled_at, created_at, updated_at,
                     status, last_error)
                 VALUES (?1, ?2, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?9, ?9,
                     CASE WHEN ?10 IS NULL THEN 'pending' ELSE 'failed' END, ?10)
                 ON CONFLICT (subscription, message_id) DO NOTHING
                 RETURNING id",
            )
            .bind(subscription)
            .bind(&m.message_id)
            .bind(&m.topic)
            .bind(&m.key)
            .bind(&m.payload)
            .bind(headers_json(&m.headers))
            .bind(&m.event_type)
            .bind(m.max_attempts as i64)
            .bind(now)
            .bind(&m.failure)
            .fetch_optional(&mut *tx)
            .await?;
            match row {
                Some(r) => {
                    inserted.insert(m.message_id.clone(), r.try_get::<i64, _>(0)?);
                }
                None => {
                    let id: i64 = sqlx::query_scalar(
                        "SELECT id FROM inbox_events WHERE subscription = ?1 AND message_id = ?2",
                    )
                    .bind(subscription)
                    .bind(&m.message_id)
                    .fetch_one(&mut *tx)
                    .await?;
                    existing.entry(m.message_id.clone()).or_insert(id);
                }
            }
        }
        tx.commit().await?;
        Ok(inbox_admissions(messages, &inserted, &existing))
    }
}
