//! Rewinds of inbox subscriptions in the database (migration 0026), written once for
//! every engine over `AdminSql`: what an operator asked for (audited), and each
//! partition a consumer applied it to. The consumer's side is `inbox::rewind_to`.

use chrono::{DateTime, Utc};

use super::admin_flow::{NewAudit, decode_all, insert_audit, rows_in};
use super::admin_sql::{AdminSql, Param, RewindSql, Shared, Stmt, query};
use super::rows::Cols;
use super::{StoreError, StoreResult};
use crate::domain::BoxKind;
use crate::domain::admin::{Rewind, RewindPartition, RewindRequest, RewindStart};

/// The rewind half of the store.
#[async_trait::async_trait]
pub trait RewindStore: Send + Sync {
    /// Stores a rewind and its audit entry (or, on a dry run, counts the messages stored
    /// since its time). A request id that asked for one answers that one.
    async fn start_rewind(&self, r: &RewindRequest) -> StoreResult<RewindStart>;

    /// Up to `limit` rewinds, newest first, of `subscription` (all when `None`) asked for
    /// since `since` (ever when `None`), each with its partitions.
    async fn rewinds(
        &self,
        subscription: Option<&str>,
        since: Option<DateTime<Utc>>,
        limit: u32,
    ) -> StoreResult<Vec<Rewind>>;

    /// Records that a consumer goes back from `until` to `from` on a partition, unless a
    /// row is there already; the partition's row (the earlier one, if any: applying a
    /// rewind again uses the window first recorded).
    async fn intend_rewind(&self, p: &RewindPartition) -> StoreResult<RewindPartition>;

    /// Records that the partition's new position is committed.
    async fn rewind_applied(&self, p: &RewindPartition) -> StoreResult<()>;
}

fn decode_rewind(row: &impl Cols) -> StoreResult<Rewind> {
    Ok(Rewind {
        id: row.int("id")?,
        subscription: row.text("subscription")?,
        to_time: row.time("to_time")?,
        redeliver: row.flag("redeliver")?,
        actor: row.text("actor")?,
        principal: row.opt_text("principal")?,
        request_id: row.opt_text("request_id")?,
        created_at: row.time("created_at")?,
        partitions: Vec::new(),
    })
}

fn decode_partition(row: &impl Cols) -> StoreResult<RewindPartition> {
    Ok(RewindPartition {
        rewind_id: row.int("rewind_id")?,
        topic: row.text("topic")?,
        partition: i32::try_from(row.count("kafka_partition")?)
            .map_err(|_| StoreError::other("a partition number out of range"))?,
        from_offset: row.int("from_offset")?,
        until_offset: row.int("until_offset")?,
        applied_at: row.opt_time("applied_at")?,
    })
}

fn stmt(r: RewindSql) -> Stmt {
    Stmt::Shared(Shared::Rewind(r))
}

const INBOX: BoxKind = BoxKind::Inbox;

#[async_trait::async_trait]
impl<E: AdminSql> RewindStore for E {
    async fn start_rewind(&self, r: &RewindRequest) -> StoreResult<RewindStart> {
        let mut tx = self.begin().await?;
        if !r.context.dry_run
            && let Some(rid) = r.context.request_id.as_deref()
        {
            let q = query(
                stmt(RewindSql::OfRequest),
                vec![Param::Text(Some(&r.subscription)), Param::Text(Some(rid))],
            );
            if let Some(row) = rows_in(self, &mut tx, INBOX, q).await?.first() {
                let rewind = decode_rewind(row)?;
                self.rollback(tx).await?;
                return Ok(RewindStart {
                    rewind: Some(rewind),
                    stored_since: 0,
                    replayed: true,
                    audit_id: None,
                });
            }
        }
        let q = query(
            stmt(RewindSql::StoredSince),
            vec![
                Param::Text(Some(&r.subscription)),
                Param::Time(Some(r.to_time)),
            ],
        );
        let rows = rows_in(self, &mut tx, INBOX, q).await?;
        let stored_since = rows.first().map(|r| r.int("n")).transpose()?.unwrap_or(0);
        if r.context.dry_run {
            self.rollback(tx).await?;
            return Ok(RewindStart {
                rewind: None,
                stored_since,
                replayed: false,
                audit_id: None,
            });
        }
        let q = query(
            stmt(RewindSql::Insert),
            vec![
                Param::Text(Some(&r.subscription)),
                Param::Time(Some(r.to_time)),
                Param::Flag(r.redeliver),
                Param::Text(Some(&r.context.actor)),
                Param::Text(r.context.principal.as_deref()),
                Param::Text(r.context.request_id.as_deref()),
                Param::Now,
            ],
        );
        let rows = rows_in(self, &mut tx, INBOX, q).await?;
        let Some(row) = rows.first() else {
            // The same request id won a race: ask again for its answer.
            self.rollback(tx).await?;
            return Box::pin(self.start_rewind(r)).await;
        };
        let rewind = decode_rewind(row)?;
        let audit = NewAudit {
            context: &r.context,
            action: "rewind",
            box_kind: INBOX,
            selection: serde_json::json!({
                "rewind": rewind.id,
                "subscription": r.subscription,
                "to_time": r.to_time,
                "redeliver": r.redeliver,
            }),
            count: stored_since,
        };
        let audit_id = insert_audit(self, &mut tx, &audit).await?;
        self.commit(tx).await?;
        Ok(RewindStart {
            rewind: Some(rewind),
            stored_since,
            replayed: false,
            audit_id: Some(audit_id),
        })
    }

    async fn rewinds(
        &self,
        subscription: Option<&str>,
        since: Option<DateTime<Utc>>,
        limit: u32,
    ) -> StoreResult<Vec<Rewind>> {
        let mut tx = self.begin().await?;
        let q = query(
            stmt(RewindSql::List),
            vec![
                Param::Text(subscription),
                Param::Time(since),
                Param::Int(Some(i64::from(limit))),
            ],
        );
        let mut rewinds = decode_all(&rows_in(self, &mut tx, INBOX, q).await?, decode_rewind)?;
        if !rewinds.is_empty() {
            let ids: Vec<i64> = rewinds.iter().map(|r| r.id).collect();
            let q = query(stmt(RewindSql::Partitions), vec![Param::Ids(&ids)]);
            let parts = decode_all(&rows_in(self, &mut tx, INBOX, q).await?, decode_partition)?;
            for p in parts {
                if let Some(r) = rewinds.iter_mut().find(|r| r.id == p.rewind_id) {
                    r.partitions.push(p);
                }
            }
        }
        self.rollback(tx).await?;
        Ok(rewinds)
    }

    async fn intend_rewind(&self, p: &RewindPartition) -> StoreResult<RewindPartition> {
        let mut tx = self.begin().await?;
        let key = [
            Param::Int(Some(p.rewind_id)),
            Param::Text(Some(&p.topic)),
            Param::Int(Some(i64::from(p.partition))),
        ];
        let mut params = key.to_vec();
        params.extend([
            Param::Int(Some(p.from_offset)),
            Param::Int(Some(p.until_offset)),
        ]);
        let sql = self.sql(INBOX, stmt(RewindSql::Intend));
        self.execute_in(&mut tx, &sql, &params).await?;
        let q = query(stmt(RewindSql::Partition), key.to_vec());
        let rows = rows_in(self, &mut tx, INBOX, q).await?;
        let row = rows
            .first()
            .ok_or_else(|| StoreError::other("a rewind partition row vanished"))?;
        let stored = decode_partition(row)?;
        self.commit(tx).await?;
        Ok(stored)
    }

    async fn rewind_applied(&self, p: &RewindPartition) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        let sql = self.sql(INBOX, stmt(RewindSql::Applied));
        let params = [
            Param::Int(Some(p.rewind_id)),
            Param::Text(Some(&p.topic)),
            Param::Int(Some(i64::from(p.partition))),
            Param::Now,
        ];
        self.execute_in(&mut tx, &sql, &params).await?;
        self.commit(tx).await?;
        Ok(())
    }
}
