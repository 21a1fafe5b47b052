//! A sample's result: where it lives ([`ArenaRef`]), each feature's address, shape, dtype and
//! stamp ([`Feature`]), the result line trainers read ([`Published`], or [`Failed`]), and the
//! bounds a result is checked against before it costs a reader memory.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::key::{self, Key};
use crate::tensor::{byte_len, Dtype, MAX_RANK};

/// Where a published sample lives: what a reader opens, and where to send frees.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArenaRef {
    /// What a reader opens (see `memory::ShmSession` for the shared-memory form).
    pub session: String,
    /// The control endpoint, `host:port`.
    pub control: String,
    /// The control endpoint's token, when it has one: a connection presents it first (see
    /// [`crate::control`]). Absent without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// The token is redacted: results end up in logs.
impl std::fmt::Debug for ArenaRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaRef")
            .field("session", &self.session)
            .field("control", &self.control)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// One feature of a published sample.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Feature {
    /// Shape, with the leading batch dimension for captured tensors.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: Dtype,
    /// Absolute address of the first byte: the session's base address plus the object's offset
    /// in the region.
    pub address: u64,
    /// The object's stamp, kept in the [`STAMP_BYTES`] at `address + stamp_offset(bytes)` while
    /// the object is resident (zero once it is freed): a reader compares it before and after
    /// its copy, so a freed or replaced object is an error, never another object's bytes.
    /// Absent from results of placements that keep no stamps (the Mooncake store, whose keys do
    /// the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stamp: Option<u64>,
}

/// Bytes of an object's stamp (a little-endian `u64`, 8-byte aligned).
pub const STAMP_BYTES: u64 = 8;

/// Where an object of `len` bytes keeps its stamp, from its address: its bytes rounded up to 8.
pub const fn stamp_offset(len: u64) -> u64 {
    len.saturating_add(STAMP_BYTES - 1) & !(STAMP_BYTES - 1)
}
/// The largest stamp: stamps are in `[1, 2^53 - 1]`, exact as JSON numbers in every language.
pub const MAX_STAMP: u64 = (1 << 53) - 1;
/// Set in an object's stamp word, with its stamp in the low bits, while its bytes are still
/// being written (a result handed out before its copy completed): a reader waits for the word to
/// become the stamp ([`StampWord`]).
pub const PENDING_BIT: u64 = 1 << 63;
/// Set in an object's stamp word, with its stamp in the low bits, when its bytes could not be
/// written: a reader fails, and the space is free again.
pub const FAILED_BIT: u64 = 1 << 62;

/// What an object's stamp word says about it, for a reader holding its result's stamp (the
/// readiness rule of docs/protocol.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StampWord {
    /// The stamp itself: the object's bytes are all there.
    Ready,
    /// [`PENDING_BIT`] with the stamp: its bytes are still being written; ask again.
    Pending,
    /// [`FAILED_BIT`] with the stamp: its bytes will never come.
    Failed,
    /// Anything else (0 once freed, another object's stamp): it is gone.
    Gone,
}

impl StampWord {
    /// Reads `found` against the result's `stamp`.
    pub fn of(found: u64, stamp: u64) -> StampWord {
        if found == stamp {
            StampWord::Ready
        } else if found == stamp | PENDING_BIT {
            StampWord::Pending
        } else if found == stamp | FAILED_BIT {
            StampWord::Failed
        } else {
            StampWord::Gone
        }
    }
}

impl Feature {
    /// Bytes of this feature (`shape × item size`), `None` on overflow.
    pub fn byte_len(&self) -> Option<u64> {
        byte_len(&self.shape, self.dtype)
    }
}

/// The result of a published sample, exactly as the contract shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Published {
    /// The sample.
    pub sample_id: String,
    /// Its store namespace.
    pub store_id: String,
    /// Its generation.
    pub gen: u64,
    /// The target layers of the aux hidden states, or null.
    pub aux_layer_ids: Option<Vec<i64>>,
    /// Feature name -> where it is.
    pub features: BTreeMap<String, Feature>,
    /// The arena holding them.
    pub arena: ArenaRef,
    /// For a result of reserved tensors only (bytes its submitter writes), where the producer's
    /// own process writes each feature: its mapping of the arena, which a NIXL server process
    /// advertises at other addresses. Never serialized: not part of the contract.
    #[serde(skip)]
    pub writable: Option<BTreeMap<String, u64>>,
}

/// The most features a result may name (a sample has four; room for extra passthroughs).
pub const MAX_FEATURES: usize = 256;
/// The longest control endpoint a result may name.
pub const MAX_ENDPOINT_BYTES: usize = 256;
/// The longest session string a result may carry: a NIXL session carries its agent's
/// metadata (about 650 bytes with one NIC; more with several RDMA devices).
pub const MAX_SESSION_BYTES: usize = 8192;

impl Published {
    /// `{store_id}/{sample_id}/g{gen}`, the sample's name (for messages).
    pub fn sample_path(&self) -> String {
        key::sample_path(&self.store_id, &self.sample_id, self.gen)
    }

    /// The object key of feature `name`.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if the ids and the name do not make a valid key.
    pub fn key(&self, name: &str) -> Result<Key> {
        Key::new(&self.store_id, &self.sample_id, self.gen, name)
    }

    /// The object key of each feature.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a feature whose key is invalid.
    pub fn keys(&self) -> Result<Vec<Key>> {
        self.features.keys().map(|n| self.key(n)).collect()
    }

    /// Checks a result that came from outside this process (a JSON line, a Python dict) before
    /// anything is allocated or mapped for it: valid keys, a bounded number of features of
    /// bounded rank whose byte sizes do not overflow, bounded session and endpoint strings.
    ///
    /// # Errors
    /// [`Error::InvalidRead`] saying what is wrong, or [`Error::InvalidKey`].
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::InvalidRead {
            key: self.sample_path().chars().take(200).collect(),
            reason,
        };
        if self.features.len() > MAX_FEATURES {
            return Err(bad(format!(
                "{} features (at most {MAX_FEATURES})",
                self.features.len()
            )));
        }
        if self
            .arena
            .token
            .as_deref()
            .is_some_and(|t| !crate::limits::is_valid_token(t))
        {
            return Err(bad("arena.token is not a valid control token".into()));
        }
        if self.arena.session.len() > MAX_SESSION_BYTES
            || self.arena.control.len() > MAX_ENDPOINT_BYTES
        {
            return Err(bad(format!(
                "session or control endpoint too long (at most {MAX_SESSION_BYTES} and \
                 {MAX_ENDPOINT_BYTES} bytes)"
            )));
        }
        for (name, f) in &self.features {
            self.key(name)?;
            if f.shape.len() > MAX_RANK {
                return Err(bad(format!(
                    "feature {name:?} has rank {} (at most {MAX_RANK})",
                    f.shape.len()
                )));
            }
            let Some(len) = f.byte_len() else {
                return Err(bad(format!(
                    "shape {:?} of {} of feature {name:?} overflows",
                    f.shape, f.dtype
                )));
            };
            if let Some(stamp) = f.stamp {
                if !(1..=MAX_STAMP).contains(&stamp) {
                    return Err(bad(format!(
                        "feature {name:?} has stamp {stamp} (stamps are 1 to {MAX_STAMP})"
                    )));
                }
                let end = stamp_offset(len)
                    .checked_add(STAMP_BYTES)
                    .and_then(|n| f.address.checked_add(n));
                if f.address % STAMP_BYTES != 0 || end.is_none() {
                    return Err(bad(format!(
                        "feature {name:?} at {:#x}: a stamped object is 8-byte aligned and its \
                         stamp follows it",
                        f.address
                    )));
                }
            }
        }
        Ok(())
    }
}

/// A failed sample: `{"sample_id", "error"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failed {
    /// The sample.
    pub sample_id: String,
    /// Why its batch failed.
    pub error: String,
}

/// One line of results: a published sample or a failed one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SampleResult {
    /// Published: every feature has an address.
    Published(Published),
    /// The batch failed; nothing of it was written.
    Failed(Failed),
}

/// Turns a batch's outcome into one result per sample: on failure each sample gets the error.
pub fn batch_results(
    sample_ids: &[String],
    outcome: Result<Vec<Published>, &Error>,
) -> Vec<SampleResult> {
    match outcome {
        Ok(published) => published.into_iter().map(SampleResult::Published).collect(),
        Err(e) => sample_ids
            .iter()
            .map(|id| {
                SampleResult::Failed(Failed {
                    sample_id: id.clone(),
                    error: e.to_string(),
                })
            })
            .collect(),
    }
}
