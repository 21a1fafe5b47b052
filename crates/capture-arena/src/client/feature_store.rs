//! The trainer-facing store: read a result's tensors, release them.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::lock;
use super::reader::{byte_len, feature, key_of};
use super::{ControlClient, Reader};
use crate::error::{Error, Result};
use crate::sample::Published;
use crate::tensor::Dtype;

/// A tensor copied out of the arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedTensor {
    /// Shape.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: Dtype,
    /// Row-major bytes.
    pub data: Vec<u8>,
}

/// Health figures of a [`FeatureStore`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Health {
    /// Samples read (`get`) and not yet released.
    pub resident_samples: u64,
    /// Their bytes.
    pub resident_bytes: u64,
    /// Keys whose free the producer has not confirmed yet (not sent, or not applied).
    pub pending_frees: u64,
    /// Of those, keys a producer refused for its control token (a missing or wrong token).
    pub refused_frees: u64,
    /// Keys dropped because too many frees were waiting (their objects stay resident).
    pub dropped_frees: u64,
    /// Sessions (producers) open in the reader.
    pub open_sessions: u64,
}

/// How many released samples a store remembers for use-after-release errors: 16 bytes each
/// (a 128-bit hash) plus the set's overhead, about 9 MiB in all however long the ids are.
pub const RELEASED_MEMORY: usize = 1 << 18;

/// The released samples, remembered by a 128-bit keyed hash of (session, store id, sample id,
/// gen, objects' stamps): bounded memory whatever the strings; oldest forgotten first.
#[derive(Debug)]
struct Released {
    hashers: (RandomState, RandomState),
    set: HashSet<u128>,
    order: VecDeque<u128>,
}

impl Default for Released {
    fn default() -> Released {
        Released {
            hashers: (RandomState::new(), RandomState::new()),
            set: HashSet::new(),
            order: VecDeque::new(),
        }
    }
}

impl Released {
    fn id(&self, r: &Published) -> u128 {
        // With its objects' stamps: a sample published again under the same keys (a retry with
        // `replace`) is another one.
        let stamps: Vec<Option<u64>> = r.features.values().map(|f| f.stamp).collect();
        let parts = (&r.arena.session, &r.store_id, &r.sample_id, r.gen, stamps);
        let hi = self.hashers.0.hash_one(&parts);
        let lo = self.hashers.1.hash_one(&parts);
        (u128::from(hi) << 64) | u128::from(lo)
    }

    fn contains(&self, r: &Published) -> bool {
        self.set.contains(&self.id(r))
    }

    fn insert(&mut self, r: &Published) {
        let id = self.id(r);
        if self.set.insert(id) {
            self.order.push_back(id);
            if self.order.len() > RELEASED_MEMORY {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
}

/// The trainer-facing store: read a result's tensors, release them.
///
/// Results come from outside the process (a JSON line, a Python dict): each is validated
/// ([`Published::validate`]) before anything is allocated or mapped for it. A released sample is
/// remembered for the last [`RELEASED_MEMORY`] releases: reading it again is an error even
/// though its bytes may still be in the region. A sample published again under the same keys (a
/// retry with `replace`) is another sample: its objects carry other stamps, so it is read, and
/// a late release of the first frees nothing of it (where the producer applies stamped frees).
#[derive(Debug)]
pub struct FeatureStore {
    reader: Arc<Reader>,
    control: ControlClient,
    state: Mutex<State>,
}

impl Default for FeatureStore {
    fn default() -> FeatureStore {
        let reader = Arc::new(Reader::new());
        let r = reader.clone();
        // Frees for a producer that is gone are dropped, never sent (to a successor on the
        // same port, say).
        let control = ControlClient::new(Duration::from_secs(5))
            .with_liveness(Arc::new(move |session: &str| r.is_gone(session)));
        FeatureStore {
            reader,
            control,
            state: Mutex::default(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Sample -> feature -> bytes read (a feature read twice counts once).
    resident: HashMap<String, HashMap<String, u64>>,
    released: Released,
}

fn sample_key(r: &Published) -> String {
    format!("{}\n{}", r.arena.session, r.sample_path())
}

impl FeatureStore {
    /// An empty store.
    pub fn new() -> FeatureStore {
        FeatureStore::default()
    }

    /// The reader underneath (for zero-copy views).
    pub fn reader(&self) -> &Reader {
        &self.reader
    }

    /// The control client underneath.
    pub fn control(&self) -> &ControlClient {
        &self.control
    }

    /// Validates `r` and fails with [`Error::Released`] if this store released it.
    ///
    /// # Errors
    /// As [`Published::validate`], or [`Error::Released`].
    pub fn check(&self, r: &Published) -> Result<()> {
        r.validate()?;
        if lock(&self.state).released.contains(r) {
            return Err(Error::Released {
                sample: r.sample_path(),
            });
        }
        Ok(())
    }

    /// The bytes of each of `names` in `result`, each feature checked against its arena and all
    /// of them together no more than the arena holds (a real result's objects are disjoint):
    /// what to size buffers by, so that a forged result cannot make its reader allocate more
    /// than one arena's worth. `result` is validated first ([`FeatureStore::check`]).
    ///
    /// # Errors
    /// As [`FeatureStore::check`]; [`Error::UnknownFeature`]; [`Error::InvalidRead`] for a
    /// feature outside the arena, or features that add up to more than it holds.
    pub fn checked_lens(&self, result: &Published, names: &[&str]) -> Result<Vec<u64>> {
        self.check(result)?;
        self.lens_in_arena(result, names)
    }

    /// [`FeatureStore::checked_lens`] of a result already checked.
    fn lens_in_arena(&self, result: &Published, names: &[&str]) -> Result<Vec<u64>> {
        let transport = self.reader.open(&result.arena.session)?;
        let mut total = 0u64;
        let mut lens = Vec::with_capacity(names.len());
        for &name in names {
            let f = feature(result, name)?;
            let len = byte_len(result, name, f)?;
            transport.check(f.address, len)?;
            total = total.saturating_add(len);
            lens.push(len);
        }
        let capacity = transport.capacity();
        if total > capacity {
            return Err(Error::InvalidRead {
                key: result.sample_path(),
                reason: format!(
                    "its features add up to {total} bytes, more than the {capacity}-byte arena \
                     holds"
                ),
            });
        }
        Ok(lens)
    }

    /// Copies every feature of `result` (or those in `names`) out of the arena, each checked
    /// against the arena before its buffer is allocated.
    ///
    /// # Errors
    /// [`Error::Released`] after `release`; [`Error::UnknownFeature`]; as [`Reader::read`].
    pub fn get(
        &self,
        result: &Published,
        names: Option<&[&str]>,
    ) -> Result<BTreeMap<String, OwnedTensor>> {
        self.check(result)?;
        self.control.learn(&result.arena.control);
        let mut wanted: Vec<&str> = match names {
            Some(n) => n.to_vec(),
            None => result.features.keys().map(String::as_str).collect(),
        };
        wanted.sort_unstable();
        wanted.dedup();
        let lens = self.lens_in_arena(result, &wanted)?;
        let need = lens.iter().fold(0u64, |a, &n| a.saturating_add(n));
        let (limit, of) = crate::limits::memory_limit();
        if need > limit {
            // Allocated and zeroed, they would have the kernel kill this process (overcommit
            // lets the reservation through): refused, at the cost of this read alone.
            return Err(Error::InvalidRead {
                key: result.sample_path(),
                reason: format!(
                    "its features need {need} bytes, more than {of}'s {limit} bytes of memory: \
                     read fewer of them, or give the process more memory"
                ),
            });
        }
        let mut bufs = Vec::with_capacity(wanted.len());
        for (&name, len) in wanted.iter().zip(lens) {
            let cannot = |why: String| Error::InvalidRead {
                key: key_of(result, name),
                reason: why,
            };
            let len = usize::try_from(len)
                .map_err(|_| cannot(format!("{len} bytes do not fit in memory")))?;
            let mut b = Vec::new();
            b.try_reserve_exact(len)
                .map_err(|e| cannot(format!("allocating {len} bytes: {e}")))?;
            b.resize(len, 0);
            bufs.push(b);
        }
        let mut outs: Vec<(&str, &mut [u8])> = wanted
            .iter()
            .zip(bufs.iter_mut())
            .map(|(n, b)| (*n, b.as_mut_slice()))
            .collect();
        self.reader.read_many(result, &mut outs)?;
        drop(outs);
        let mut out = BTreeMap::new();
        for (name, data) in wanted.into_iter().zip(bufs) {
            let f = feature(result, name)?;
            out.insert(
                name.to_owned(),
                OwnedTensor {
                    shape: f.shape.clone(),
                    dtype: f.dtype,
                    data,
                },
            );
        }
        self.note_resident(result, out.iter().map(|(n, t)| (n.as_str(), t.data.len())));
        Ok(out)
    }

    /// Copies several features of `result` into caller buffers (each exactly its feature's
    /// size), in one request to the transport, counting the sample as resident until it is
    /// released.
    ///
    /// # Errors
    /// As [`FeatureStore::get`].
    pub fn get_many_into(&self, result: &Published, outs: &mut [(&str, &mut [u8])]) -> Result<()> {
        self.check(result)?;
        self.control.learn(&result.arena.control);
        self.reader.read_many(result, outs)?;
        self.note_resident(result, outs.iter().map(|(n, o)| (*n, o.len())));
        Ok(())
    }

    /// Copies several features of `result` into destinations of any kind (host or device
    /// memory: [`crate::Destination`]), in one request to the transport.
    ///
    /// # Errors
    /// As [`FeatureStore::get`] and [`Reader::read_to`].
    pub fn get_many_to(
        &self,
        result: &Published,
        outs: &mut [(&str, crate::Destination<'_>)],
    ) -> Result<()> {
        self.check(result)?;
        self.control.learn(&result.arena.control);
        self.reader.read_to(result, outs)?;
        self.note_resident(result, outs.iter().map(|(n, o)| (*n, o.len() as usize)));
        Ok(())
    }

    /// Copies feature `name` of `result` into `out` (exactly its size).
    ///
    /// # Errors
    /// As [`FeatureStore::get`].
    pub fn get_into(&self, result: &Published, name: &str, out: &mut [u8]) -> Result<()> {
        self.get_many_into(result, &mut [(name, out)])
    }

    fn note_resident<'a>(&self, result: &Published, read: impl Iterator<Item = (&'a str, usize)>) {
        let mut st = lock(&self.state);
        let features = st.resident.entry(sample_key(result)).or_default();
        for (name, len) in read {
            features.insert(name.to_owned(), len as u64);
        }
    }

    /// Frees every object of `result` over its control endpoint; later `get`s of it fail.
    /// Never waits on the network: the keys are queued and the endpoint's sender sends them
    /// (retrying an unreachable endpoint until it answers or refuses connections).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] and the like for an invalid result (nothing is released then).
    pub fn release(&self, result: &Published) -> Result<()> {
        result.validate()?;
        // Each key with its object's stamp: a late release never frees a replacement.
        let keys: Vec<(crate::Key, Option<u64>)> = result
            .features
            .iter()
            .map(|(name, f)| result.key(name).map(|k| (k, f.stamp)))
            .collect::<Result<_>>()?;
        {
            let mut st = lock(&self.state);
            st.resident.remove(&sample_key(result));
            st.released.insert(result);
        }
        // The endpoint's token comes from its live producer's results: an old result of a
        // restarted producer must not replace it (its keys are dropped as gone anyway).
        if result.arena.token.is_some() && !self.reader().is_gone(&result.arena.session) {
            self.control
                .learn_token(&result.arena.control, result.arena.token.as_deref());
        }
        match self.control.free_in(
            Some(&result.arena.control),
            Some(&result.arena.session),
            result.arena.token.as_deref(),
            keys,
        ) {
            // Released all the same: the keys wait for the endpoint (its sender warns).
            Err(Error::FreeNotSent { .. } | Error::Unauthorized { .. }) | Ok(()) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Has the senders send what waits; returns without waiting.
    ///
    /// # Errors
    /// As [`ControlClient::flush`].
    pub fn flush(&self) -> Result<()> {
        self.control.flush()
    }

    /// As [`ControlClient::flush_samples_within`], for `sample_ids` of `store_id` (as given:
    /// encoded here).
    ///
    /// # Errors
    /// As [`ControlClient::flush_samples_within`].
    pub fn flush_samples_within(
        &self,
        store_id: &str,
        sample_ids: &[&str],
        timeout: Duration,
    ) -> Result<()> {
        let store = crate::key::escape_part(store_id);
        let samples = sample_ids
            .iter()
            .map(|id| format!("{store}/{}/", crate::key::escape_part(id)))
            .collect();
        self.control.flush_samples_within(&samples, timeout)
    }

    /// Waits up to `timeout` for every free to go out (what a trainer does before it exits).
    ///
    /// # Errors
    /// As [`ControlClient::flush_within`].
    pub fn flush_within(&self, timeout: Duration) -> Result<()> {
        self.control.flush_within(timeout)
    }

    /// Resident samples and bytes, frees not yet sent or dropped, sessions open. Samples of
    /// producers that are gone no longer count as resident (their memory went with them).
    pub fn health(&self) -> Health {
        // Each session is asked whether its producer is gone without the state's lock (an
        // ask opens a file or connects a socket): reads and releases go on meanwhile.
        let sessions: HashSet<String> = lock(&self.state)
            .resident
            .keys()
            .map(|k| k.split('\n').next().unwrap_or_default().to_owned())
            .collect();
        let gone: HashSet<String> = sessions
            .into_iter()
            .filter(|s| self.reader.is_gone(s))
            .collect();
        let mut st = lock(&self.state);
        st.resident
            .retain(|k, _| !gone.contains(k.split('\n').next().unwrap_or_default()));
        Health {
            resident_samples: st.resident.len() as u64,
            resident_bytes: st.resident.values().flat_map(|f| f.values()).sum(),
            pending_frees: self.control.pending() as u64,
            refused_frees: self.control.refused() as u64,
            dropped_frees: self.control.dropped(),
            open_sessions: self.reader.open_sessions() as u64,
        }
    }
}
