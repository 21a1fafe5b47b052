//! Object keys: `{store_id}/{sample_id}/g{gen}/{name}`, built, parsed and formatted here and
//! nowhere else.
//!
//! One object holds one tensor of one sample. The key format is the Mooncake store's, so a trainer
//! that frees store objects frees arena objects with the same strings.
//!
//! Ids and names may hold any characters (SGLang's sink takes any string): `%`, `/` and control
//! characters in a part are percent-encoded in the key (`run/1` -> `run%2F1`, `50%` -> `50%25`),
//! so the four parts of every key are unambiguous and a prefix free `{store_id}/` never reaches
//! another store's (or sample's) objects. Ids without those characters are their own key part.
//! Results carry the ids as given; [`Key::new`] and [`sample_path`] encode, so producers and
//! readers agree. The Mooncake store placement keeps the store's raw layout ([`store_key`]). A [`Key`] is one validated
//! string (what the object table, results and the control protocol all carry) plus the positions
//! of its parts, so it hashes and compares as that string ([`Borrow<str>`]): the writer looks a
//! free line's strings up in its table without parsing or allocating.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

/// The longest key, in bytes. A free line holds at least one key of any valid length (JSON
/// escaping at most doubles it, well under [`crate::limits::MAX_LINE_BYTES`]), so every key that
/// can be published can also be freed.
pub const MAX_KEY_BYTES: usize = 1024;

/// A validated object key.
///
/// Invariants: every part is non-empty and free of control characters; `store_id`, `sample_id`
/// and `name` contain no `/` (they are encoded with [`escape_part`]); `gen >= 1`; the whole key is at most [`MAX_KEY_BYTES`] bytes. So
/// `Key::from_str(key.as_str()) == Ok(key)`. Equality, hashing and ordering are the string's.
#[derive(Clone)]
pub struct Key {
    text: Box<str>,
    /// Byte positions of the three `/` separators.
    cuts: [u32; 3],
    gen: u64,
}

impl Key {
    /// Builds a key from a sample's ids and a feature name, as given (each part encoded with
    /// [`escape_part`]).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if a part is empty, `gen < 1`, or the key would be longer than
    /// [`MAX_KEY_BYTES`].
    pub fn new(store_id: &str, sample_id: &str, gen: u64, name: &str) -> Result<Key> {
        Key::from_encoded(
            &escape_part(store_id),
            &escape_part(sample_id),
            gen,
            &escape_part(name),
        )
    }

    /// A key from parts already encoded (as a key's string carries them: [`Key::store_id`] and
    /// the other accessors).
    ///
    /// # Errors
    /// As [`Key::new`], and for a part holding `/` or a control character.
    pub fn from_encoded(store_id: &str, sample_id: &str, gen: u64, name: &str) -> Result<Key> {
        check_encoded_sample(store_id, sample_id, gen)?;
        check_part("name", name)?;
        let text = format!("{store_id}/{sample_id}/g{gen}/{name}");
        check_len(&text)?;
        let a = store_id.len();
        let b = a + 1 + sample_id.len();
        let c = text.len() - name.len() - 1;
        Ok(Key {
            text: text.into_boxed_str(),
            // All below MAX_KEY_BYTES (checked), so they fit in u32.
            cuts: [a as u32, b as u32, c as u32],
            gen,
        })
    }

    /// The key as the string that results, free lines and the object table carry.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The trainer store namespace, as the key carries it (encoded).
    pub fn store_id(&self) -> &str {
        &self.text[..self.cut(0)]
    }

    /// The sample this object belongs to, as the key carries it (encoded).
    pub fn sample_id(&self) -> &str {
        &self.text[self.cut(0) + 1..self.cut(1)]
    }

    /// `{store_id}/{sample_id}/` as the key carries it (encoded): what every object of the
    /// sample's generations starts with.
    pub fn sample_prefix(&self) -> &str {
        &self.text[..=self.cut(1)]
    }

    /// The generation (server capture always uses 1).
    pub fn gen(&self) -> u64 {
        self.gen
    }

    /// The feature name (`hidden_state`, `input_ids`, ...), as the key carries it (encoded).
    pub fn name(&self) -> &str {
        &self.text[self.cut(2) + 1..]
    }

    fn cut(&self, i: usize) -> usize {
        self.cuts[i] as usize
    }
}

/// Checks a key prefix for a prefix free: `{store_id}/`, `{store_id}/{sample_id}/` or
/// `{store_id}/{sample_id}/g{gen}/`, every part valid, at most [`MAX_KEY_BYTES`] bytes. A prefix
/// ends with `/`, so `st/` never matches `st2/...`.
///
/// # Errors
/// [`Error::InvalidKey`] saying which rule the prefix breaks.
pub fn check_prefix(prefix: &str) -> Result<()> {
    let bad = |reason: &str| Error::InvalidKey {
        key: prefix
            .chars()
            .take(80)
            .collect::<String>()
            .escape_debug()
            .to_string(),
        reason: reason.into(),
    };
    if prefix.len() > MAX_KEY_BYTES {
        return Err(too_long(prefix, prefix.len()));
    }
    let Some(body) = prefix.strip_suffix('/') else {
        return Err(bad("a prefix ends with '/': {store_id}/, {store_id}/{sample_id}/ or {store_id}/{sample_id}/g{gen}/"));
    };
    let parts: Vec<&str> = body.split('/').collect();
    match parts.as_slice() {
        [store] => check_part("store_id", store),
        [store, sample] => check_part("store_id", store).and(check_part("sample_id", sample)),
        [store, sample, g] => {
            let gen = g
                .strip_prefix('g')
                .and_then(|n| n.parse::<u64>().ok())
                .filter(|n| *n >= 1 && g[1..] == n.to_string())
                .ok_or_else(|| bad("the third part of a prefix is g{gen}, gen >= 1"))?;
            check_encoded_sample(store, sample, gen)
        }
        _ => Err(bad("a prefix has one to three parts before its final '/'")),
    }
}

/// The name of a sample, `{store_id}/{sample_id}/g{gen}` (ids encoded as in [`Key::new`]): what
/// every key of the sample starts with (before `/{name}`), so `sample_path(..) + "/"` is the
/// sample's prefix for a prefix free. Not validated.
pub fn sample_path(store_id: &str, sample_id: &str, gen: u64) -> String {
    format!(
        "{}/{}/g{gen}",
        escape_part(store_id),
        escape_part(sample_id)
    )
}

/// A part of a key as the key carries it: `%`, `/` and control characters percent-encoded (each
/// UTF-8 byte as `%XX`), everything else as it is. Injective, so distinct ids never share keys.
pub fn escape_part(part: &str) -> std::borrow::Cow<'_, str> {
    let special = |c: char| c == '%' || c == '/' || c.is_control();
    if !part.contains(special) {
        return std::borrow::Cow::Borrowed(part);
    }
    let mut out = String::with_capacity(part.len() + 8);
    for c in part.chars() {
        if special(c) {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The Mooncake store's key of an object, `{store_id}/{sample_id}/g{gen}/{name}` with the parts
/// as given (not encoded): what SpecForge's `MooncakeFeatureStore` computes itself, so the store
/// placement uses it. The store frees exact keys only, so a `/` in an id is harmless there.
///
/// # Errors
/// [`Error::InvalidKey`] for an empty part, `gen < 1` or a key over [`MAX_KEY_BYTES`].
pub fn store_key(store_id: &str, sample_id: &str, gen: u64, name: &str) -> Result<String> {
    // The encoded key checks emptiness and gen; its length bounds the raw one's.
    Key::new(store_id, sample_id, gen, name)?;
    Ok(format!("{store_id}/{sample_id}/g{gen}/{name}"))
}

/// Checks the ids every key of one sample shares (as given: encoded here).
///
/// # Errors
/// As [`Key::new`].
pub(crate) fn check_sample(store_id: &str, sample_id: &str, gen: u64) -> Result<()> {
    check_encoded_sample(&escape_part(store_id), &escape_part(sample_id), gen)
}

fn check_encoded_sample(store_id: &str, sample_id: &str, gen: u64) -> Result<()> {
    check_part("store_id", store_id)?;
    check_part("sample_id", sample_id)?;
    if gen < 1 {
        return Err(Error::InvalidKey {
            key: format!("{store_id}/{sample_id}/g{gen}")
                .escape_debug()
                .to_string(),
            reason: "gen must be >= 1".into(),
        });
    }
    // The shortest key of this sample (a one-byte name) must fit.
    let shortest = store_id.len() + sample_id.len() + digits(gen) + 5;
    if shortest > MAX_KEY_BYTES {
        return Err(too_long(
            &format!("{store_id}/{sample_id}/g{gen}/"),
            shortest,
        ));
    }
    Ok(())
}

fn digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

fn check_len(text: &str) -> Result<()> {
    if text.len() > MAX_KEY_BYTES {
        return Err(too_long(text, text.len()));
    }
    Ok(())
}

fn too_long(text: &str, len: usize) -> Error {
    // Show the start only: the point is the length.
    let start: String = text.chars().take(64).collect();
    Error::InvalidKey {
        key: format!("{}...", start.escape_debug()),
        reason: format!(
            "the key is {len} bytes, longer than the limit of {MAX_KEY_BYTES} bytes (so that \
             every key fits in a free line); use shorter store or sample ids or names"
        ),
    }
}

fn check_part(what: &str, part: &str) -> Result<()> {
    let reason = if part.is_empty() {
        format!("{what} is empty")
    } else if part.len() > MAX_KEY_BYTES {
        return Err(too_long(part, part.len()));
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

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.text == other.text
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Must hash exactly as `str` does: the object table is looked up by `&str`.
        self.as_str().hash(state);
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Key) -> std::cmp::Ordering {
        self.text.cmp(&other.text)
    }
}

impl Borrow<str> for Key {
    fn borrow(&self) -> &str {
        &self.text
    }
}

impl AsRef<str> for Key {
    fn as_ref(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.text, f)
    }
}

impl FromStr for Key {
    type Err = Error;

    fn from_str(s: &str) -> Result<Key> {
        let bad = |reason: &str| {
            let start: String = s.chars().take(80).collect();
            Error::InvalidKey {
                key: start.escape_debug().to_string(),
                reason: reason.to_owned(),
            }
        };
        check_len(s)?;
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
        let gen_text = gen
            .strip_prefix('g')
            .filter(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| bad("third part must be g<generation>, e.g. g1"))?;
        let gen = gen_text
            .parse::<u64>()
            .map_err(|_| bad("third part must be g<generation>, e.g. g1"))?;
        let key = Key::from_encoded(store, sample, gen, name)?;
        // `g01` would make a different string for the same parts: only the canonical form is a
        // key, so a key compares equal exactly when its string does.
        if key.as_str() != s {
            return Err(bad("the generation has leading zeros"));
        }
        Ok(key)
    }
}

impl Serialize for Key {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Key, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn builds_and_parses() {
        let k = Key::new("a1b2c3d4", "run0:t17", 1, "hidden_state").unwrap();
        assert_eq!(k.as_str(), "a1b2c3d4/run0:t17/g1/hidden_state");
        assert_eq!(k.to_string(), k.as_str());
        assert_eq!(
            "a1b2c3d4/run0:t17/g1/hidden_state".parse::<Key>().unwrap(),
            k
        );
        assert_eq!(
            (k.store_id(), k.sample_id(), k.gen(), k.name()),
            ("a1b2c3d4", "run0:t17", 1, "hidden_state")
        );
        let big = Key::new("s", "x", 12345, "n").unwrap();
        assert_eq!((big.sample_id(), big.gen(), big.name()), ("x", 12345, "n"));
    }

    #[test]
    fn looks_up_by_str() {
        let k = Key::new("a", "b", 1, "c").unwrap();
        let m = HashMap::from([(k.clone(), 7)]);
        assert_eq!(m.get("a/b/g1/c"), Some(&7));
        assert_eq!(m.get("a/b/g1/d"), None);
    }

    #[test]
    fn rejects_bad_parts() {
        for (s, sa, g, n) in [
            ("", "s", 1, "n"),
            ("a", "", 1, "n"),
            ("a", "s", 1, ""),
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
            "a/s/g01/n",
            "a/s/g+1/n",
            "a/s/gx/n",
            "/s/g1/n",
            "a/s/g1/",
            "a/s/g99999999999999999999999/n",
        ] {
            assert!(s.parse::<Key>().is_err(), "{s} should not parse");
        }
    }

    #[test]
    fn any_id_is_encoded_so_parts_stay_unambiguous() {
        let k = Key::new("run/1", "50%", 1, "a\nb").unwrap();
        assert_eq!(k.as_str(), "run%2F1/50%25/g1/a%0Ab");
        assert_eq!(
            (k.store_id(), k.sample_id(), k.name()),
            ("run%2F1", "50%25", "a%0Ab")
        );
        assert_eq!(k.as_str().parse::<Key>().unwrap(), k);
        // Injective: an id that looks encoded is encoded again.
        assert_ne!(
            Key::new("run%2F1", "s", 1, "n").unwrap(),
            Key::new("run/1", "s", 1, "n").unwrap()
        );
        // A prefix free of store "run/" cannot reach store "run/1"'s objects, nor "run"'s.
        assert!(!k
            .as_str()
            .starts_with(&format!("{}/", sample_path("run", "1", 1))));
        assert!(!k.as_str().starts_with(&format!("{}/", escape_part("run"))));
        assert_eq!(sample_path("run/1", "50%", 1), "run%2F1/50%25/g1");
        assert_eq!(store_key("run/1", "s", 2, "n").unwrap(), "run/1/s/g2/n");
        assert!(store_key("", "s", 1, "n").is_err());
        assert!(matches!(
            escape_part("plain"),
            std::borrow::Cow::Borrowed("plain")
        ));
        // A key's own prefixes are valid prefixes, also when encoding made its parts longer.
        let fill = MAX_KEY_BYTES - "st/".len() - "/g1/n".len();
        let k = Key::new("st", &"%".repeat(fill / 3), 1, "n").unwrap();
        assert!(check_prefix(&format!("{}/{}/g1/", k.store_id(), k.sample_id())).is_ok());
    }

    #[test]
    fn keys_are_bounded_so_every_free_line_fits() {
        let long = "x".repeat(MAX_KEY_BYTES);
        let e = Key::new("a", &long, 1, "n").unwrap_err();
        assert!(
            e.to_string().contains("longer than the limit of 1024"),
            "{e}"
        );
        assert!(check_sample("a", &long, 1).is_err());
        let e = format!("a/{long}/g1/n").parse::<Key>().unwrap_err();
        assert!(e.to_string().contains("1024"), "{e}");
        // The longest key allowed, made of characters JSON escapes, still fits a free line.
        let fill = MAX_KEY_BYTES - "a/b/g1/".len();
        let k = Key::new("a", "b", 1, &"\"".repeat(fill)).unwrap();
        assert_eq!(k.as_str().len(), MAX_KEY_BYTES);
        let line = serde_json::to_vec(&[&k]).unwrap();
        assert!(line.len() < crate::limits::MAX_LINE_BYTES);
        assert!(Key::new("a", "b", 1, &"\"".repeat(fill + 1)).is_err());
    }

    #[test]
    fn serialises_as_its_string() {
        let k = Key::new("a", "b", 2, "c").unwrap();
        assert_eq!(serde_json::to_string(&k).unwrap(), "\"a/b/g2/c\"");
        let back: Key = serde_json::from_str("\"a/b/g2/c\"").unwrap();
        assert_eq!(back, k);
        assert!(serde_json::from_str::<Key>("\"a/b/c\"").is_err());
    }

    proptest! {
        #[test]
        fn round_trips(store in "\\PC{1,12}|[a/%\n]{1,6}", sample in "\\PC{1,12}|[a/%\n]{1,6}",
                       gen in 1u64.., name in "\\PC{1,12}") {
            let k = Key::new(&store, &sample, gen, &name).unwrap();
            let back = k.as_str().parse::<Key>().unwrap();
            prop_assert_eq!(&back, &k);
            prop_assert_eq!((back.store_id(), back.sample_id(), back.gen(), back.name()),
                            (&*escape_part(&store), &*escape_part(&sample), gen, &*escape_part(&name)));
        }

        #[test]
        fn distinct_ids_never_share_a_key(a in "[a/%2F]{1,6}", b in "[a/%2F]{1,6}") {
            prop_assume!(a != b);
            prop_assert_ne!(Key::new(&a, "s", 1, "n").unwrap(), Key::new(&b, "s", 1, "n").unwrap());
            prop_assert_ne!(Key::new("st", &a, 1, "n").unwrap(), Key::new("st", &b, 1, "n").unwrap());
        }

        #[test]
        fn parse_never_panics(s in "\\PC{0,40}") {
            let _ = s.parse::<Key>();
        }
    }
}
