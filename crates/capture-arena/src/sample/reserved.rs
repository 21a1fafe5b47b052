//! Objects whose submitter writes their bytes itself ([`crate::tensor::TensorData::Reserved`]):
//! how it names an object it wrote ([`Written`]: by its stamp and where the bytes went, not by
//! its key), and the table of the objects still being written that the writer keeps and the
//! submitter's threads check their destinations against ([`ReservedObjects`]).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use crate::key::Key;

/// An object whose caller wrote its bytes ([`crate::Arena::commit_reserved`]), named by what
/// the caller checked before it wrote them ([`crate::Arena::finish_written`]): the object's
/// stamp, where the bytes went in this process's mapping of the arena, and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The object's stamp, as its reservation's result gave it.
    pub stamp: u64,
    /// Where its bytes were written, in this process's mapping of the arena.
    pub at: u64,
    /// How many bytes were written there.
    pub len: u64,
}

/// The objects being written ([`crate::Arena::commit_reserved`]), by stamp: each one's key,
/// where it lies in this process's mapping of the arena, and its length. The writer keeps it up
/// to date (an object enters before its result is handed out, and leaves when its write is
/// finished); the threads that write those objects check each destination against it before
/// they write a byte ([`ReservedObjects::check`]), in device memory too, where they cannot read
/// the stamp words ([`crate::Writer::reserved_objects`]).
#[derive(Debug, Default)]
pub struct ReservedObjects(Mutex<HashMap<u64, (Key, u64, u64)>>);

impl ReservedObjects {
    /// The table, for the arena that keeps it: stamp -> (key, address here, length).
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<u64, (Key, u64, u64)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `w` is an object being written: the one of its stamp, lying at `w.at` (this
    /// process's mapping) with `w.len` bytes; else why not, with the numbers.
    ///
    /// # Errors
    /// A stamp of no object being written (another reservation's, or one finished), or an
    /// object that lies elsewhere or has another length.
    pub fn check(&self, w: &Written) -> std::result::Result<(), String> {
        match self.lock().get(&w.stamp) {
            Some(entry) => check_entry(w, entry),
            None => Err(not_reserved(w)),
        }
    }

    /// The key of the object of `w`'s stamp and whether `w` lies where it does
    /// ([`ReservedObjects::check`]), under one lock; `None` for a stamp of no object being
    /// written.
    pub(crate) fn key_of(&self, w: &Written) -> Option<(Key, std::result::Result<(), String>)> {
        let table = self.lock();
        let entry = table.get(&w.stamp)?;
        Some((entry.0.clone(), check_entry(w, entry)))
    }

    /// How many objects are being written.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no object is being written.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn check_entry(w: &Written, (_, at, len): &(Key, u64, u64)) -> std::result::Result<(), String> {
    if *at == w.at && *len == w.len {
        return Ok(());
    }
    Err(format!(
        "[{:#x}, +{}) is not the object reserved with stamp {}, which lies at [{at:#x}, +{len}) \
         (a destination that is not this request's reservation)",
        w.at, w.len, w.stamp
    ))
}

fn not_reserved(w: &Written) -> String {
    format!(
        "no object reserved with stamp {} is being written (a stamp that is not this request's \
         reservation, or one finished already); its destination [{:#x}, +{})",
        w.stamp, w.at, w.len
    )
}
