//! The SQL API's limits (`mailroom_sql_settings`, migration 0007) kept in step with the
//! service's: `mailroom.enqueue` cannot read the service's configuration, so each
//! replica writes its limits into the row at start-up (docs/sql-api.md).

use crate::domain::Limits;
use crate::store::{StoreError, StoreResult};

use super::PgStore;

/// Writes `limits` where they differ, only while the database accepts this binary (the
/// schema gate, `sql::compatible`, with the binary's schema as $8): a binary that a
/// migration declared incompatible must not write limits the newer release's SQL API
/// then enforces. Returns the requirement read and whether the row changed.
const SYNC: &str = "WITH gate AS MATERIALIZED (
        SELECT COALESCE(max(min_binary_schema), 0) AS required FROM mailroom_schema_compat),
     changed AS (
        UPDATE mailroom_sql_settings SET
            max_payload_bytes = $1, max_headers = $2, max_header_bytes = $3,
            max_key_bytes = $4, max_batch = $5, max_attempts_cap = $6, default_max_attempts = $7
        WHERE (max_payload_bytes, max_headers, max_header_bytes, max_key_bytes, max_batch,
               max_attempts_cap, default_max_attempts)
            IS DISTINCT FROM ($1, $2, $3, $4, $5, $6, $7)
          AND (SELECT required FROM gate) <= $8
        RETURNING 1)
    SELECT (SELECT required FROM gate), (SELECT count(*) FROM changed) > 0";

/// A limit as the table's INTEGER column holds it (limits are validated far below).
fn int(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

impl PgStore {
    /// Makes the SQL API validate with `limits`, as gRPC does. `Ok(true)`: the row
    /// differed and now matches. `StoreError::SchemaRefused`: the database requires a
    /// newer binary, and nothing was written.
    pub async fn sync_sql_limits(&self, limits: &Limits) -> StoreResult<bool> {
        let (required, changed): (i64, bool) = sqlx::query_as(sqlx::AssertSqlSafe(self.text(SYNC)))
            .bind(int(limits.max_payload_bytes))
            .bind(int(limits.max_headers))
            .bind(int(limits.max_header_bytes))
            .bind(int(limits.max_key_bytes))
            .bind(int(limits.max_batch))
            .bind(int(limits.max_attempts_cap as usize))
            .bind(int(limits.default_max_attempts as usize))
            .bind(self.known)
            .fetch_one(self.admin_pool())
            .await?;
        if required > self.known {
            return Err(StoreError::SchemaRefused {
                binary: self.known,
                required,
            });
        }
        Ok(changed)
    }
}
