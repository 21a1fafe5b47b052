//! A call's hold on a sink's writer, which it may outlive (`close()` meanwhile).

use std::sync::Arc;

use capture_arena::Sink;
use pyo3::prelude::*;

/// A call's hold on the sink. If `close()` ran meanwhile, this may be the last hold: then the
/// writer stops when it is dropped, and that must not keep the GIL (it waits for queued copies
/// and unmaps the region). All holds are dropped with the GIL held, so the count check is not
/// racy.
pub(crate) struct Held(pub(crate) Option<Arc<Sink>>);

impl std::ops::Deref for Held {
    type Target = Sink;
    fn deref(&self) -> &Sink {
        self.0.as_deref().expect("held until dropped")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            // The last hold (close() ran meanwhile): stop the writer without the GIL.
            if let Some(last) = Arc::into_inner(s) {
                Python::attach(|py| py.detach(move || drop(last)));
            }
        }
    }
}
