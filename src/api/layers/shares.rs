//! Each caller's share of the server (issue 43, item 1): one principal (a token, or a
//! client certificate) may hold at most `percent` of the RPC slots (`overload`) and of
//! the budget of request bytes in flight (`admission`), so that one tenant's flood, or
//! its stalled uploads, leave the others room. A principal may exceed its byte share
//! with one request alone (one largest batch must always fit), never with a second.
//!
//! Callers without an identity (a server without tokens or client certificates) cannot
//! be told apart: they share the server's own limits only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::access::Principal;

/// What the principals hold now, and their share.
#[derive(Debug)]
pub struct Shares {
    percent: u32,
    held: Mutex<HashMap<Arc<str>, Held>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Held {
    rpcs: usize,
    bytes: u64,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.rpcs == 0 && self.bytes == 0
    }
}

/// The principal a request belongs to, for its share; `None` for a caller without an
/// identity.
pub fn principal_of(ext: &tonic::codegen::http::Extensions) -> Option<Arc<str>> {
    ext.get::<Principal>()
        .and_then(Principal::audit_label)
        .map(Arc::from)
}

impl Shares {
    /// Shares of `percent` (1..=100) of each limit; `None` at 100 (no bound beyond the
    /// server's).
    pub fn new(percent: u32) -> Option<Arc<Shares>> {
        (percent < 100).then(|| {
            Arc::new(Shares {
                percent: percent.max(1),
                held: Mutex::new(HashMap::new()),
            })
        })
    }

    /// The share of a limit of `total`: at least 1.
    pub fn of(&self, total: u64) -> u64 {
        (total * u64::from(self.percent) / 100).max(1)
    }

    /// The percentage, for refusals.
    pub fn percent(&self) -> u32 {
        self.percent
    }

    fn with<T>(&self, who: &Arc<str>, f: impl FnOnce(&mut Held) -> T) -> T {
        let mut map = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let entry = map.entry(who.clone()).or_default();
        let out = f(entry);
        if entry.is_empty() {
            map.remove(who);
        }
        out
    }

    /// One more RPC of `who`, unless it already holds its share of `slots`; the slot
    /// returns when the guard drops.
    pub fn take_rpc(self: &Arc<Self>, who: Arc<str>, slots: usize) -> Option<RpcShare> {
        let share = self.of(slots as u64);
        self.with(&who, |h| {
            if h.rpcs as u64 >= share {
                return false;
            }
            h.rpcs += 1;
            true
        })
        .then(|| RpcShare {
            shares: self.clone(),
            who,
        })
    }

    /// `more` bytes for a request of `who` that holds `own` already, unless the
    /// principal would pass its share of `total` with other requests holding bytes too.
    pub fn take_bytes(&self, who: &Arc<str>, own: u64, more: u64, total: u64) -> bool {
        let share = self.of(total);
        self.with(who, |h| {
            let alone = h.bytes == own;
            if !alone && h.bytes + more > share {
                return false;
            }
            h.bytes += more;
            true
        })
    }

    /// Bytes a request of `who` gives back.
    pub fn give_bytes(&self, who: &Arc<str>, n: u64) {
        self.with(who, |h| h.bytes = h.bytes.saturating_sub(n));
    }

    #[cfg(test)]
    fn bytes_of(&self, who: &str) -> u64 {
        let map = self.held.lock().unwrap();
        map.get(who).map_or(0, |h| h.bytes)
    }
}

/// One RPC slot of a principal's share, returned on drop.
pub struct RpcShare {
    shares: Arc<Shares>,
    who: Arc<str>,
}

impl Drop for RpcShare {
    fn drop(&mut self) {
        self.shares
            .with(&self.who, |h| h.rpcs = h.rpcs.saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_principal_holds_at_most_its_share_of_the_slots() {
        let shares = Shares::new(50).unwrap();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let held: Vec<_> = (0..5)
            .map(|_| shares.take_rpc(a.clone(), 10).expect("within the share"))
            .collect();
        assert!(shares.take_rpc(a.clone(), 10).is_none(), "a sixth of ten");
        assert!(
            shares.take_rpc(b.clone(), 10).is_some(),
            "another principal"
        );
        drop(held);
        assert!(shares.take_rpc(a, 10).is_some());
        assert!(Shares::new(100).is_none());
    }

    #[test]
    fn one_request_alone_may_pass_the_byte_share_a_second_may_not() {
        let shares = Shares::new(50).unwrap();
        let a: Arc<str> = Arc::from("a");
        // One request grows past half of 1,000.
        assert!(shares.take_bytes(&a, 0, 400, 1000));
        assert!(shares.take_bytes(&a, 400, 400, 1000));
        assert_eq!(shares.bytes_of("a"), 800);
        // A second request of the same principal gets nothing while the first holds 800.
        assert!(!shares.take_bytes(&a, 0, 10, 1000));
        shares.give_bytes(&a, 800);
        assert!(shares.take_bytes(&a, 0, 10, 1000));
        shares.give_bytes(&a, 10);
        // Two requests together stay within the share.
        assert!(shares.take_bytes(&a, 0, 480, 1000));
        assert!(shares.take_bytes(&a, 0, 10, 1000));
        assert!(!shares.take_bytes(&a, 480, 20, 1000));
        shares.give_bytes(&a, 490);
        assert_eq!(shares.bytes_of("a"), 0);
    }
}
