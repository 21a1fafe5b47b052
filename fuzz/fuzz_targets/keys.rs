//! Keys and prefixes from peers (free lines, results): a key that parses prints as itself and
//! is made of parts that make it again, and its own prefixes are accepted; a prefix that is
//! accepted ends with `/` and names one to three whole, non-empty parts (a store, a sample, a
//! generation), so it cannot reach into a neighbour whose name merely starts the same.
#![no_main]

use capture_arena::key::{check_prefix, MAX_KEY_BYTES};
use capture_arena::Key;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(key) = text.parse::<Key>() {
        assert_eq!(key.as_str(), text);
        assert!(text.len() <= MAX_KEY_BYTES);
        let again = Key::from_encoded(key.store_id(), key.sample_id(), key.gen(), key.name())
            .expect("the parts of a key make a key");
        assert_eq!(again, key);
        // Any ids make a key whose parts hold no '/': the text split three ways, as ids.
        let mut raw = text.splitn(3, '/');
        if let (Some(a), Some(b), Some(c)) = (raw.next(), raw.next(), raw.next()) {
            if let Ok(k) = Key::new(a, b, 1, c) {
                assert!(!k.store_id().contains('/') && !k.sample_id().contains('/'));
                assert_eq!(k.as_str().parse::<Key>().ok().as_ref(), Some(&k));
            }
        }
        // Its own prefixes are valid and reach it.
        for prefix in [
            format!("{}/", key.store_id()),
            format!("{}/{}/", key.store_id(), key.sample_id()),
            format!("{}/{}/g{}/", key.store_id(), key.sample_id(), key.gen()),
        ] {
            assert!(check_prefix(&prefix).is_ok(), "{prefix:?}");
            assert!(text.starts_with(&prefix));
        }
    }
    if check_prefix(text).is_ok() {
        assert!(text.ends_with('/') && text.len() <= MAX_KEY_BYTES);
        // A prefix names whole parts: no key of another store or sample starts with it.
        let parts: Vec<&str> = text.trim_end_matches('/').split('/').collect();
        assert!((1..=3).contains(&parts.len()), "{text:?}");
        assert!(parts.iter().all(|p| !p.is_empty()));
    }
});
