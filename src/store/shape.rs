//! How the admin statements of a box are shaped: its tables, and how they name the
//! subscription (the inbox has one; the outbox has none and reads as `''`). Shared by the
//! PostgreSQL and SQLite admin stores, which differ only in the text casts PostgreSQL needs.

use crate::domain::BoxKind;

/// A box's tables and how its statements name the subscription.
pub(crate) struct Shape {
    pub events: &'static str,
    pub keys: &'static str,
    pub inbox: bool,
    /// `::text` on PostgreSQL (untyped parameters and literals need it), empty on SQLite.
    text: &'static str,
}

impl Shape {
    pub fn postgres(b: BoxKind) -> Shape {
        Shape {
            text: "::text",
            ..Shape::sqlite(b)
        }
    }

    pub fn sqlite(b: BoxKind) -> Shape {
        let (events, keys) = match b {
            BoxKind::Outbox => ("outbox_events", "outbox_keys"),
            BoxKind::Inbox => ("inbox_events", "inbox_keys"),
        };
        Shape {
            events,
            keys,
            inbox: b == BoxKind::Inbox,
            text: "",
        }
    }

    /// The subscription column `col` (`''` in the outbox, which has none).
    pub fn sub(&self, col: &str) -> String {
        if self.inbox {
            col.to_string()
        } else {
            format!("''{}", self.text)
        }
    }

    /// `AND a.subscription = b.subscription` in the inbox, nothing in the outbox.
    pub fn same_sub(&self, a: &str, b: &str) -> String {
        if self.inbox {
            format!(" AND {a}.subscription = {b}.subscription")
        } else {
            String::new()
        }
    }

    /// The optional subscription filter `param` on `col`; in the outbox it only matches
    /// when no subscription is asked for.
    pub fn sub_filter(&self, col: &str, param: &str) -> String {
        let t = self.text;
        if self.inbox {
            format!("({param}{t} IS NULL OR {col} = {param})")
        } else {
            format!("{param}{t} IS NULL")
        }
    }

    /// `subscription, ` to lead a GROUP BY in the inbox.
    pub fn group_sub(&self) -> &'static str {
        if self.inbox { "subscription, " } else { "" }
    }
}
