//! Object keys: `{store_id}/{sample_id}/g{gen}/{name}`, built and parsed here and nowhere else.
//!
//! One object holds one tensor of one sample. The key format is the Mooncake store's, so a trainer
//! that frees store objects frees arena objects with the same strings.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A validated object key.
///
/// Invariants: every part is non-empty and free of control characters; `store_id`, `sample_id`
/// and `name` contain no `/`; `gen >= 1`. So `Key::from_str(&key.to_string()) == Ok(key)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    store_id: String,
    sample_id: String,
    gen: u64,
    name: String,
}

impl Key {
    /// Builds a key from its parts.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if a part is empty, holds a `/` or a control character, or `gen < 1`.
    pub fn new(store_id: &str, sample_id: &str, gen: u64, name: &str) -> Result<Key> {
        check_part("store_id", store_id)?;
        check_part("sample_id", sample_id)?;
        check_part("name", name)?;
        if gen < 1 {
            return Err(Error::InvalidKey {
                key: format!("{store_id}/{sample_id}/g{gen}/{name}"),
                reason: "gen must be >= 1".into(),
            });
        }
        Ok(Key {
            store_id: store_id.to_owned(),
            sample_id: sample_id.to_owned(),
            gen,
            name: name.to_owned(),
        })
    }

    /// The trainer store namespace.
    pub fn store_id(&self) -> &str {
        &self.store_id
    }
    /// The sample this object belongs to.
    pub fn sample_id(&self) -> &str {
        &self.sample_id
    }
    /// The generation (server capture always uses 1).
    pub fn gen(&self) -> u64 {
        self.gen
    }
    /// The feature name (`hidden_state`, `input_ids`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }
}

fn check_part(what: &str, part: &str) -> Result<()> {
    let reason = if part.is_empty() {
        format!("{what} is empty")
    } else if part.contains('/') {
        format!("{what} {part:?} contains '/'")
    } else if part.chars().any(char::is_control) {
        format!("{what} {part:?} contains a control character")
    } else {
        return Ok(());
    };
    Err(Error::InvalidKey {
        key: part.escape_debug().to_string(),
        reason,
    })
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/g{}/{}",
            self.store_id, self.sample_id, self.gen, self.name
        )
    }
}

impl FromStr for Key {
    type Err = Error;

    fn from_str(s: &str) -> Result<Key> {
        let bad = |reason: &str| Error::InvalidKey {
            key: s.escape_debug().to_string(),
            reason: reason.to_owned(),
        };
        let mut parts = s.split('/');
        let (Some(store), Some(sample), Some(gen), Some(name), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(bad(
                "expected exactly four '/'-separated parts: {store_id}/{sample_id}/g{gen}/{name}",
            ));
        };
        let gen = gen
            .strip_prefix('g')
            .filter(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|g| g.parse::<u64>().ok())
            .ok_or_else(|| bad("third part must be g<generation>, e.g. g1"))?;
        Key::new(store, sample, gen, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn builds_and_parses() {
        let k = Key::new("a1b2c3d4", "run0:t17", 1, "hidden_state").unwrap();
        assert_eq!(k.to_string(), "a1b2c3d4/run0:t17/g1/hidden_state");
        assert_eq!(
            "a1b2c3d4/run0:t17/g1/hidden_state".parse::<Key>().unwrap(),
            k
        );
        assert_eq!(k.gen(), 1);
        assert_eq!(k.name(), "hidden_state");
    }

    #[test]
    fn rejects_bad_parts() {
        for (s, sa, g, n) in [
            ("", "s", 1, "n"),
            ("a", "", 1, "n"),
            ("a", "s", 1, ""),
            ("a/b", "s", 1, "n"),
            ("a", "s/t", 1, "n"),
            ("a", "s", 1, "n/m"),
            ("a", "s\n", 1, "n"),
            ("a", "s", 1, "n\u{7f}"),
            ("a", "s", 0, "n"),
        ] {
            let err = Key::new(s, sa, g, n).unwrap_err();
            assert!(matches!(err, Error::InvalidKey { .. }), "{err}");
        }
        for s in [
            "a/s/g1",
            "a/s/g1/n/x",
            "a/s/1/n",
            "a/s/g/n",
            "a/s/g0/n",
            "a/s/g+1/n",
            "a/s/gx/n",
            "/s/g1/n",
            "a/s/g1/",
            "a/s/g99999999999999999999999/n",
        ] {
            assert!(s.parse::<Key>().is_err(), "{s} should not parse");
        }
    }

    proptest! {
        #[test]
        fn round_trips(store in "[^/\\p{Cc}]{1,12}", sample in "[^/\\p{Cc}]{1,12}",
                       gen in 1u64.., name in "[^/\\p{Cc}]{1,12}") {
            let k = Key::new(&store, &sample, gen, &name).unwrap();
            prop_assert_eq!(k.to_string().parse::<Key>().unwrap(), k);
        }

        #[test]
        fn parse_never_panics(s in "\\PC{0,40}") {
            let _ = s.parse::<Key>();
        }
    }
}
