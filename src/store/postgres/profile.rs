//! The session profile: what every PostgreSQL connection mailroom opens sets right after
//! connecting (its pools, the migrator's, the LISTEN connection's), decided here and
//! nowhere else (docs/security.md, "A shared database").
//!
//! mailroom shares its database with other roles and sessions. What they may change
//! through the session defaults of a database or a role, or through objects they create,
//! must not change what mailroom's statements mean:
//! - **Names.** Service sessions search only `pg_catalog, pg_temp`, and every mailroom
//!   table and function in the statements is qualified with the schema that holds them
//!   ([`Qualifier`]): a function or operator another role plants in `public` (a better
//!   match for `bigint * interval` than pg_catalog's) is never resolved, and a role named
//!   like one of mailroom's schemas (its `"$user"` schema) changes nothing. Views and the
//!   functions of the migrations bind their names when they are created.
//! - **The migrator** creates objects, and the released migrations name them without a
//!   schema, so its path is the data schema, then `pg_catalog, pg_temp`: never
//!   `"$user"`, so a role named `mailroom` migrates into the same schema each time.
//! - **Isolation.** READ COMMITTED whatever the defaults say: the claim's handshake with
//!   writers (a key row or an order lock held from drawing an id to the commit) relies
//!   on each statement seeing what committed before it started.
//! - **Waits.** A `lock_timeout` and an `idle_in_transaction_session_timeout`, so a lock
//!   held by another session costs a bounded wait and a stuck transaction of mailroom's
//!   does not hold rows for ever.
//! - **Durability and meaning.** `synchronous_commit` is raised from `off` (an answered
//!   `Enqueue` must survive a crash), string literals are standard, and triggers fire
//!   (`session_replication_role = origin`: the count triggers keep the counters).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Executor};

/// The schema that holds mailroom's tables when none is configured: where every release
/// so far created them.
pub const DEFAULT_SCHEMA: &str = "public";

/// What a session is for: the two differ only in their search path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionKind {
    /// Enqueues, relays, the admin: every name qualified, nothing else searched.
    Service,
    /// Migrations: unqualified names are created in, and found in, the data schema.
    Migrator,
}

/// The settings a session runs with.
#[derive(Debug, Clone)]
pub struct SessionProfile {
    /// The schema of mailroom's tables (unquoted).
    pub schema: String,
    /// Service or migrator.
    pub kind: SessionKind,
    /// `lock_timeout` (`None`: the server's).
    pub lock_timeout: Option<Duration>,
    /// `idle_in_transaction_session_timeout` (`None`: the server's).
    pub idle_in_transaction: Option<Duration>,
}

/// How long a statement of the service waits for a lock another session holds before
/// it fails (`55P03`, answered `UNAVAILABLE`): a row an operator keeps locked costs its
/// callers a bounded wait, not their whole statement timeout.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a session of mailroom's may sit idle inside a transaction before the server
/// ends it: none of mailroom's transactions waits on anything but the database, so one
/// idle this long belongs to a process that hung, and its locks must go.
pub const DEFAULT_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(60);

impl SessionProfile {
    /// A service session's profile with the default waits.
    pub fn service(schema: &str) -> Self {
        SessionProfile {
            schema: schema.to_string(),
            kind: SessionKind::Service,
            lock_timeout: Some(DEFAULT_LOCK_TIMEOUT),
            idle_in_transaction: Some(DEFAULT_IDLE_IN_TRANSACTION),
        }
    }

    /// The migrator's profile: the data schema on the path; no lock timeout of its own
    /// here (the migration runner decides how it waits).
    pub fn migrator(schema: &str) -> Self {
        SessionProfile {
            schema: schema.to_string(),
            kind: SessionKind::Migrator,
            lock_timeout: None,
            idle_in_transaction: Some(DEFAULT_IDLE_IN_TRANSACTION),
        }
    }

    /// The search path of this kind of session.
    pub fn search_path(&self) -> String {
        match self.kind {
            SessionKind::Service => "pg_catalog, pg_temp".to_string(),
            SessionKind::Migrator => format!("{}, pg_catalog, pg_temp", quote_ident(&self.schema)),
        }
    }

    /// The one statement that applies the profile (a statement after connecting rather
    /// than startup options, which PgBouncer refuses). Every value is mailroom's own
    /// text, quoted as a literal.
    pub fn statement(&self) -> String {
        let ms = |d: Option<Duration>| d.map_or("0".to_string(), |d| d.as_millis().to_string());
        format!(
            "SELECT set_config('search_path', {path}, false),
                    set_config('default_transaction_isolation', 'read committed', false),
                    set_config('lock_timeout', {lock}, false),
                    set_config('idle_in_transaction_session_timeout', {idle}, false),
                    set_config('standard_conforming_strings', 'on', false),
                    CASE WHEN current_setting('synchronous_commit') = 'off'
                         THEN set_config('synchronous_commit', 'on', false) END,
                    CASE WHEN current_setting('session_replication_role') <> 'origin'
                         THEN set_config('session_replication_role', 'origin', false) END",
            path = quote_literal(&self.search_path()),
            lock = quote_literal(&ms(self.lock_timeout)),
            idle = quote_literal(&ms(self.idle_in_transaction)),
        )
    }

    /// Applies the profile to a fresh connection.
    pub async fn apply(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        conn.execute(AssertSqlSafe(self.statement()))
            .await
            .map(drop)
    }
}

/// `ident` as a PostgreSQL identifier, always quoted.
pub fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Every mailroom object a statement of the service may name: tables, the view, and the
/// functions of the migrations. The SQL API's functions live in schema `mailroom` and are
/// written qualified.
pub const OBJECTS: &[&str] = &[
    "_sqlx_migrations",
    "admin_audit",
    "inbox_events",
    "inbox_keys",
    "inbox_paused_subscriptions",
    "inbox_rewind_partitions",
    "inbox_rewinds",
    "mailroom_dead_letter",
    "mailroom_dead_letters",
    "mailroom_fold_turn",
    "mailroom_installation",
    "mailroom_jobs",
    "mailroom_order_lock",
    "mailroom_order_slot",
    "mailroom_order_slots",
    "mailroom_push_attempt",
    "mailroom_rates",
    "mailroom_schema_compat",
    "mailroom_sql_settings",
    "outbox_completed_add",
    "outbox_completed_counts",
    "outbox_events",
    "outbox_events_view",
    "outbox_keys",
    "outbox_paused_topics",
    "outbox_publishes",
];

/// Qualifies mailroom's object names in statement text with the data schema, once per
/// statement text: the statements stay written as they read best, and the one list
/// above decides what is mailroom's.
pub struct Qualifier {
    schema: String,
    prefix: String,
    done: RwLock<HashMap<(usize, usize), Arc<str>>>,
}

impl Qualifier {
    /// A qualifier for `schema` (unquoted).
    pub fn new(schema: &str) -> Self {
        Qualifier {
            schema: schema.to_string(),
            prefix: format!("{}.", quote_ident(schema)),
            done: RwLock::new(HashMap::new()),
        }
    }

    /// The data schema (unquoted).
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// `sql` with every unqualified mailroom name prefixed with the schema: a name is a
    /// whole identifier (letters, digits, `_`) that names an object (below). The list holds only
    /// relation and function names, which no column or alias of the statements shares.
    pub fn text(&self, sql: &str) -> String {
        let bytes = sql.as_bytes();
        let mut out = String::with_capacity(sql.len() + 64);
        let mut i = 0;
        while i < bytes.len() {
            let c = bytes[i];
            if is_ident(c) {
                let start = i;
                while i < bytes.len() && is_ident(bytes[i]) {
                    i += 1;
                }
                let word = &sql[start..i];
                let before = start.checked_sub(1).map(|j| bytes[j]);
                let after = bytes.get(i).copied();
                // Not after `.`, `"`, `'` or `$` (qualified, quoted, a literal, a dollar
                // quote), nor before `.` (a column of the table by its name).
                let starts_word =
                    !matches!(before, Some(b'.' | b'"' | b'\'' | b'$')) && after != Some(b'.');
                if starts_word && !word.as_bytes()[0].is_ascii_digit() && OBJECTS.contains(&word) {
                    out.push_str(&self.prefix);
                }
                out.push_str(word);
            } else {
                // Multi-byte characters are copied whole: only ASCII bytes start words.
                let ch = sql[i..].chars().next().unwrap_or('\u{fffd}');
                out.push(ch);
                i += ch.len_utf8().max(1);
            }
        }
        out
    }

    /// [`Qualifier::text`] of a statement that is a constant, kept after its first use
    /// (the address of the constant is its key).
    pub fn fixed(&self, sql: &'static str) -> Arc<str> {
        let key = (sql.as_ptr() as usize, sql.len());
        if let Some(s) = self
            .done
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return s.clone();
        }
        let s: Arc<str> = self.text(sql).into();
        self.done
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, s.clone());
        s
    }
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qualifies_whole_unqualified_names_only() {
        let q = Qualifier::new("public");
        assert_eq!(
            q.text("SELECT e.id FROM outbox_events e JOIN outbox_keys k ON k.topic = e.topic"),
            "SELECT e.id FROM \"public\".outbox_events e JOIN \"public\".outbox_keys k ON k.topic = e.topic"
        );
        // Longer names, qualified names, literals, parameters and columns are left alone.
        assert_eq!(
            q.text(
                "SELECT x.outbox_events, 'outbox_keys', outbox_events_line FROM mailroom.enqueue"
            ),
            "SELECT x.outbox_events, 'outbox_keys', outbox_events_line FROM mailroom.enqueue"
        );
        assert_eq!(
            q.text("INSERT INTO outbox_keys SET a = LEAST(outbox_keys.ready_at, now())"),
            "INSERT INTO \"public\".outbox_keys SET a = LEAST(outbox_keys.ready_at, now())"
        );
        assert_eq!(
            q.text("SELECT mailroom_order_lock(k.topic, k.event_key) — é FROM outbox_events_view"),
            "SELECT \"public\".mailroom_order_lock(k.topic, k.event_key) — é FROM \"public\".outbox_events_view"
        );
        let odd = Qualifier::new("we\"ird");
        assert_eq!(
            odd.text("FROM admin_audit"),
            "FROM \"we\"\"ird\".admin_audit"
        );
    }

    #[test]
    fn a_fixed_statement_is_qualified_once() {
        const S: &str = "DELETE FROM outbox_publishes";
        let q = Qualifier::new("data");
        let a = q.fixed(S);
        let b = q.fixed(S);
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, "DELETE FROM \"data\".outbox_publishes");
    }

    #[test]
    fn the_profile_pins_the_path_of_each_kind() {
        let p = SessionProfile {
            schema: "public".into(),
            kind: SessionKind::Service,
            lock_timeout: Some(Duration::from_secs(5)),
            idle_in_transaction: None,
        };
        assert_eq!(p.search_path(), "pg_catalog, pg_temp");
        let s = p.statement();
        assert!(
            s.contains("'pg_catalog, pg_temp'") && s.contains("'5000'"),
            "{s}"
        );
        let m = SessionProfile {
            schema: "it's".into(),
            kind: SessionKind::Migrator,
            ..p
        };
        assert_eq!(m.search_path(), "\"it's\", pg_catalog, pg_temp");
        assert!(m.statement().contains("'\"it''s\", pg_catalog, pg_temp'"));
    }
}
