//! The store's errors: what went wrong, typed, so that callers decide by variant (retry,
//! report, give up) and nobody reads error text. The service layer maps them to its own
//! errors once (`crate::error`); the store never builds service errors.

use crate::domain::{EventId, Status};

/// An error of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or refused the connection: retry later.
    #[error("database unavailable: {0}")]
    Unavailable(#[source] Cause),
    /// PostgreSQL aborted the transaction as a deadlock victim (`40P01`) or a
    /// serialization failure (`40001`): nothing of it was applied, and the same call may
    /// simply run again.
    #[error("database unavailable: {0}")]
    Retryable(#[source] Cause),
    /// The database refused the statement because of the data (PostgreSQL classes 22
    /// data exception, 23 integrity constraint, 54 program limit such as an index row
    /// too large; SQLite TOOBIG, CONSTRAINT, MISMATCH, RANGE): retrying cannot help.
    #[error("database refused the data: {0}")]
    Refused(#[source] Cause),
    /// PostgreSQL cancelled the statement after the `statement_timeout` of its query
    /// class (`57014`), or after waiting `lock_timeout` for a lock another session
    /// holds (`55P03`): the statement, and its transaction, changed nothing.
    #[error("database statement timed out: {0}")]
    TimedOut(#[source] Cause),
    /// Explicit ids that name no event; nothing was changed. The message names at most
    /// a few of them (`some_of`).
    #[error("no event with id {}; nothing was changed", some_of(ids))]
    Missing {
        /// Every id asked for that names no event.
        ids: Vec<EventId>,
    },
    /// Explicitly named events that are not in the state the action needs (`wanted`);
    /// nothing was changed.
    #[error("only {} events can be {action}: {}; nothing was changed", wanted.as_str(), some_of(found))]
    WrongState {
        /// The state the action needs.
        wanted: Status,
        /// The action in the past tense: "requeued", "cancelled".
        action: &'static str,
        /// The offending events and their state.
        found: Vec<(EventId, Status)>,
    },
    /// Selected events changed state between their selection and the update, in the
    /// same transaction: it was rolled back, nothing was changed.
    #[error("some selected events changed state meanwhile; nothing was changed, try again")]
    ChangedMeanwhile,
    /// The database's schema requires a binary that knows schema `required`; this one
    /// knows `binary`. The relay's statements check it themselves (issue 42, item 2):
    /// nothing was changed.
    #[error(
        "the database requires a binary that knows schema {required} or later; this binary knows schema {binary}: nothing was changed"
    )]
    SchemaRefused {
        /// The highest schema this binary knows.
        binary: i64,
        /// The lowest schema the database accepts.
        required: i64,
    },
    /// Anything else the database or a row decode reported.
    #[error("database error: {0}")]
    Other(#[source] Cause),
}

/// A store call's result.
pub type StoreResult<T> = Result<T, StoreError>;

impl StoreError {
    /// An error of the store's own (no driver error behind it).
    pub(crate) fn other(message: impl Into<String>) -> StoreError {
        StoreError::Other(Cause {
            message: message.into(),
            driver: None,
        })
    }
}

/// What the database or the driver reported: its message, and the driver's error when
/// there is one, kept for code that needs it typed (`driver`). It stands for the
/// driver's error in the chain: its `source` is the driver error's own source, so a
/// printer that walks the chain does not repeat the driver's message twice. (The
/// store's messages include the cause's text, as sqlx's own errors do, because logs
/// and status messages print `Display` only.)
#[derive(Debug)]
pub struct Cause {
    message: String,
    driver: Option<sqlx::Error>,
}

impl Cause {
    /// The driver's error, if the cause is one.
    pub fn driver(&self) -> Option<&sqlx::Error> {
        self.driver.as_ref()
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.driver.as_ref().and_then(std::error::Error::source)
    }
}

impl From<sqlx::Error> for Cause {
    fn from(e: sqlx::Error) -> Self {
        Cause {
            message: e.to_string(),
            driver: Some(e),
        }
    }
}

/// A value an error message may name: an id, or an id with its state.
pub(crate) trait Named {
    fn name(&self) -> String;
}

impl Named for EventId {
    fn name(&self) -> String {
        self.to_string()
    }
}

impl Named for (EventId, Status) {
    fn name(&self) -> String {
        format!("{} is {}", self.0, self.1.as_str())
    }
}

/// At most the first `SHOWN` items and how many more: an error naming 100,000 ids must
/// stay far below gRPC's metadata limits (the message travels in a header).
pub(crate) fn some_of<T: Named>(items: &[T]) -> String {
    const SHOWN: usize = 10;
    let head: Vec<String> = items[..items.len().min(SHOWN)]
        .iter()
        .map(Named::name)
        .collect();
    let head = head.join(", ");
    match items.len().saturating_sub(SHOWN) {
        0 => head,
        more => format!("{head} and {more} more"),
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Tls(_)
            // A connection closed mid-handshake: with TLS built in, sqlx asks for TLS
            // first (`sslmode=prefer`) and reads EOF as "unexpected response from
            // SSLRequest". The database is unreachable, not the request wrong.
            | sqlx::Error::Protocol(_) => StoreError::Unavailable(Cause::from(e)),
            sqlx::Error::Database(db) => {
                // Class 08 (connection), 57P (operator intervention: shutdown), 53 (resources),
                // 25P03 (the server ended a transaction idle past
                // `idle_in_transaction_session_timeout`), SQLite BUSY, LOCKED,
                // BUSY_SNAPSHOT: all say "try again later", not "bad request".
                // 40001/40P01 (serialization, deadlock): run the call again. 57014 (the
                // statement timeout) and 55P03 (a lock another session holds outlasted
                // the session's `lock_timeout`): the statement waited too long and
                // changed nothing.
                let code = db.code().map(|c| c.to_string()).unwrap_or_default();
                if code == "40001" || code == "40P01" {
                    StoreError::Retryable(Cause::from(e))
                } else if code.starts_with("08")
                    || code.starts_with("57P")
                    || code == "25P03"
                    || code.starts_with("53")
                    || code == "5"
                    || code == "6"
                    || code == "517"
                {
                    StoreError::Unavailable(Cause::from(e))
                } else if code == "57014" || code == "55P03" {
                    StoreError::TimedOut(Cause::from(e))
                } else if refusal(&code) {
                    StoreError::Refused(Cause::from(e))
                } else {
                    StoreError::Other(Cause::from(e))
                }
            }
            _ => StoreError::Other(Cause::from(e)),
        }
    }
}

/// Whether a database error code says the data was refused (see `StoreError::Refused`).
fn refusal(code: &str) -> bool {
    if code.len() == 5 {
        // PostgreSQL SQLSTATE: five characters, the class first.
        return code.starts_with("22") || code.starts_with("23") || code.starts_with("54");
    }
    // SQLite: extended result codes (at most four digits); the primary code is the low byte.
    matches!(code.parse::<u32>().map(|c| c & 0xff), Ok(18 | 19 | 20 | 25))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn a_driver_error_is_kept_typed_behind_the_same_message() {
        let e = StoreError::from(sqlx::Error::PoolTimedOut);
        assert_eq!(
            e.to_string(),
            format!("database unavailable: {}", sqlx::Error::PoolTimedOut)
        );
        let cause = e.source().expect("a source");
        assert_eq!(cause.to_string(), sqlx::Error::PoolTimedOut.to_string());
        let StoreError::Unavailable(cause) = &e else {
            panic!("{e:?}")
        };
        assert!(matches!(cause.driver(), Some(sqlx::Error::PoolTimedOut)));
        // The driver's own message is not repeated below the cause.
        assert!(cause.source().is_none());
        let io = StoreError::from(sqlx::Error::Io(std::io::Error::other("reset")));
        let mut chain = Vec::new();
        let mut next = io.source();
        while let Some(e) = next {
            chain.push(e.to_string());
            next = e.source();
        }
        assert_eq!(chain.last().map(String::as_str), Some("reset"), "{chain:?}");
        let own = StoreError::other("totals row missing");
        assert_eq!(own.to_string(), "database error: totals row missing");
        let StoreError::Other(cause) = &own else {
            panic!("{own:?}")
        };
        assert!(cause.driver().is_none());
    }
}
