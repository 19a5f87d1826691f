//! Schema versions: what a database's migrations require of the binaries that run on it
//! (issue 24, item 1; `docs/storage.md`, "Schema compatibility"). A binary knows the
//! schema up to its highest embedded migration. From migration 0014 on, every migration
//! records in `mailroom_schema_compat` the lowest such schema a binary needs to run on
//! the database; the highest of these is the database's requirement. The engines read
//! the state ([`SchemaState`]); the decision ([`decide`]) is the same on every engine.

use sqlx::migrate::Migrator;

/// The migration that created `mailroom_schema_compat`: a database below it has no
/// requirement (and no table to read one from).
pub const COMPAT_SINCE: i64 = 14;

/// The database's schema: its highest applied migration (the same SQL on both engines).
pub const DATABASE_SCHEMA_SQL: &str =
    "SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success";

/// The lowest schema a binary must know, from [`COMPAT_SINCE`] on.
pub const REQUIRED_SCHEMA_SQL: &str =
    "SELECT COALESCE(MAX(min_binary_schema), 0) FROM mailroom_schema_compat";

/// What a database says about its schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaState {
    /// The highest migration applied.
    pub database: i64,
    /// The lowest schema a binary must know to run on it (0 before [`COMPAT_SINCE`]).
    pub required: i64,
}

/// Reads a database's [`SchemaState`] with the engine's text of [`DATABASE_SCHEMA_SQL`]
/// and [`REQUIRED_SCHEMA_SQL`] (PostgreSQL qualifies the names).
pub async fn read_state<DB>(
    pool: &sqlx::Pool<DB>,
    database_sql: &str,
    required_sql: &str,
) -> Result<SchemaState, sqlx::Error>
where
    DB: sqlx::Database,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let database: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(database_sql))
        .fetch_one(pool)
        .await?;
    let required: i64 = if database < COMPAT_SINCE {
        0
    } else {
        sqlx::query_scalar(sqlx::AssertSqlSafe(required_sql))
            .fetch_one(pool)
            .await?
    };
    Ok(SchemaState { database, required })
}

/// How a binary relates to a database's schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compat {
    /// The database is at the binary's schema.
    Known,
    /// Migrations the binary does not know are applied, and they declare it compatible.
    Ahead,
    /// The binary's own migrations are not all applied yet (`mailroom migrate` has not
    /// run, or runs now). Not a stop: the binary's statements that need what is missing
    /// fail on their own; reported apart so that it is never read as "known".
    Behind,
    /// The database requires a binary that knows a newer schema.
    Incompatible,
}

impl Compat {
    /// The state's name in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Compat::Known => "known",
            Compat::Ahead => "ahead",
            Compat::Behind => "behind",
            Compat::Incompatible => "incompatible",
        }
    }
}

/// The pure decision: a binary that knows schema `known` may run on `state` unless the
/// database requires more than it knows, the rule the relay's statements apply in the
/// database (`postgres::sql::compatible`). (Migrations write `min_binary_schema <=
/// version`, so a requirement above `known` comes with a migration the binary does not
/// know.)
pub fn decide(known: i64, state: SchemaState) -> Compat {
    if state.required > known {
        Compat::Incompatible
    } else if state.database > known {
        Compat::Ahead
    } else if state.database < known {
        Compat::Behind
    } else {
        Compat::Known
    }
}

/// The schema a migrator brings a database to: its highest migration.
pub(crate) fn highest(migrator: &Migrator) -> i64 {
    migrator.iter().map(|m| m.version).max().unwrap_or(0)
}

/// The migrator set to run on a database that has migrations it does not know (a newer
/// binary applied them): it applies its own and leaves the verdict to [`decide`],
/// instead of refusing with `VersionMissing` and crash-looping the replica.
pub(crate) fn tolerant(mut migrator: Migrator) -> Migrator {
    migrator.set_ignore_missing(true);
    migrator
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(database: i64, required: i64) -> SchemaState {
        SchemaState { database, required }
    }

    #[test]
    fn a_binary_runs_on_what_it_knows_and_on_what_declares_it_compatible() {
        // The same schema; an older one, one without the table (required 0): behind.
        assert_eq!(decide(14, state(14, 13)), Compat::Known);
        assert_eq!(decide(14, state(13, 13)), Compat::Behind);
        assert_eq!(decide(14, state(11, 0)), Compat::Behind);
        // Newer, additive: the database still asks for no more than 14.
        assert_eq!(decide(14, state(15, 14)), Compat::Ahead);
        assert_eq!(decide(14, state(20, 13)), Compat::Ahead);
        // Newer and requiring a binary that knows it.
        assert_eq!(decide(14, state(15, 15)), Compat::Incompatible);
        assert_eq!(decide(14, state(17, 16)), Compat::Incompatible);
        // A requirement equal to what the binary knows is met.
        assert_eq!(decide(15, state(15, 15)), Compat::Known);
    }

    #[test]
    fn both_engines_know_the_compat_table() {
        for m in [
            sqlx::migrate!("migrations/postgres"),
            sqlx::migrate!("migrations/sqlite"),
        ] {
            assert!(highest(&m) >= COMPAT_SINCE);
            assert!(tolerant(m).ignore_missing);
        }
    }
}
