//! Secrets: a string `Debug` never shows, and the constant-time comparison tokens are
//! checked with.

/// A secret string: `Debug` never shows it.
#[derive(Clone, PartialEq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}
