//! capture-arena: the capture server's arena.
//!
//! An inference server captures hidden states per sample during prefill. A [`Sink`] hands each
//! batch to a [`Writer`] thread, the only thread that places or frees objects in the [`Arena`]:
//! it places every tensor as an object in one region of memory (host shared memory, device
//! memory, memory a transfer engine owns), copies the bytes (or leaves a reserved object's to
//! its submitter), and returns per-sample results with every feature's address. Trainers read the bytes by
//! (session, address) and free objects by writing JSON lists of keys to the control endpoint,
//! which the same writer thread serves.
//!
//! Data flows one way:
//! `sink -> writer (queue -> placer) -> arena (alloc + memory) -> result -> client (reader ->
//! transport) -> control client -> writer (control server) -> arena`.
//!
//! The modules, in layers that import only downward. The table lists them from the bottom up: a
//! module imports only modules of its own row or of rows before it, and a row "beside" another
//! shares its place without importing it (nor is imported by it). `scripts/layers.py`, run by the
//! test command, reads this table and fails on an import against it, a module missing from it,
//! or an import circle.
//!
//! | layer | module | noun |
//! |---|---|---|
//! | base | [`error`](Error), `random`, [`page`] | errors; random bits for names, tokens and stamps; this host's page size and page arithmetic |
//! | device | `driver` (feature `cuda`) | the CUDA driver: contexts, streams, events, VMM allocations, pinned host ranges; NVML's fabric state (it knows errors only) |
//! | data | [`key`], [`tensor`], [`sample`], [`limits`], [`report`], [`stats`] | object keys; tensors (a device tensor holds its readiness event); requests and results (the wire), and the table of objects their submitters are writing; bounds every input is checked against; what the writer reports, and its counters |
//! | memory | [`alloc`], [`memory`], [`paged`] | extent allocator over `[0, capacity)`; regions (batch copies that may complete later), the one mapping type; a paged cache's rows and their copy into an object (host, or device through the driver) |
//! | arena | [`arena`] | region + allocator + object table; atomic batches, reserve → copy → commit |
//! | protocol | [`control`], [`reply`] | the free protocol (line buffer, parser); the local reply path |
//! | settings | [`config`] | every setting and its environment variable (above what it sets, below what reads it) |
//! | server | [`writer`], [`sink`] | the writer thread (submit queue, control server, placer); the inference server's entry |
//! | read side (beside server) | [`transport`], [`client`] | how a reader reaches an arena; the trainer side (reader, control client and its connections, stats query, feature store) |
#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod alloc;
pub mod arena;
pub mod client;
pub mod config;
pub mod control;
#[cfg(feature = "cuda")]
pub mod driver;
mod error;
pub mod key;
pub mod limits;
pub mod memory;
pub mod page;
pub mod paged;
mod random;
pub mod reply;
pub mod report;
pub mod sample;
pub mod sink;
pub mod stats;
pub mod tensor;
pub mod transport;
pub mod writer;

// The README's and the Rust guide's examples run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
mod readme {}
#[cfg(doctest)]
#[doc = include_str!("../../../docs/rust.md")]
mod rust_guide {}

pub use arena::{Arena, Freed, StoreUsage};
pub use client::{ControlClient, FeatureStore, Reader};
pub use config::{arena_enabled, Config, Placement};
pub use error::{Error, Result};
pub use key::Key;
pub use sample::{
    ArenaRef, Feature, Published, Sample, SampleResult, SampleSpec, StampWord, FAILED_BIT,
    PENDING_BIT,
};
pub use sink::Sink;
pub use stats::StatsSnapshot;
pub use tensor::{Dtype, HostBytes, Tensor, TensorData};
pub use transport::{Destination, DeviceSlice, ReadBuffer, ReadOp, Transport};
pub use writer::{BatchHandle, Writer};
