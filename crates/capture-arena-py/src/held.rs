//! A call's hold on a sink's writer, which it may outlive (`close()` meanwhile).

use std::sync::Arc;

use capture_arena::Sink;
use pyo3::prelude::*;

/// A call's hold on the sink. If `close()` ran meanwhile, this may be the last hold: then the
/// writer stops when it is dropped, and that must not keep the GIL (it waits for queued copies
/// and unmaps the region). All holds are dropped with the GIL held, so the count check is not
/// racy. A hold a forked child inherited (a reservation object) is forgotten there, never
/// dropped: the writer, its threads and the arena are the parent's (as `PySink`'s drop).
pub(crate) struct Held(pub(crate) Option<Arc<Sink>>, u32);

impl Held {
    /// A hold taken in this process.
    pub(crate) fn new(sink: Arc<Sink>) -> Held {
        Held(Some(sink), std::process::id())
    }

    /// Whether this hold was taken in another process (this one is its forked child).
    pub(crate) fn inherited(&self) -> bool {
        self.1 != std::process::id()
    }
}

impl std::ops::Deref for Held {
    type Target = Sink;
    fn deref(&self) -> &Sink {
        self.0.as_deref().expect("held until dropped")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.inherited() {
            std::mem::forget(self.0.take());
            return;
        }
        if let Some(s) = self.0.take() {
            // The last hold (close() ran meanwhile): stop the writer without the GIL.
            if let Some(last) = Arc::into_inner(s) {
                Python::attach(|py| py.detach(move || drop(last)));
            }
        }
    }
}
