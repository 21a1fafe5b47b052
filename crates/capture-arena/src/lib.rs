//! capture-arena: the capture server's arena.
//!
//! An inference server captures hidden states per sample during prefill. A [`Sink`] hands each
//! batch to a [`Writer`] thread, the only thread that touches the [`Arena`]: it places every
//! tensor as an object in one region of memory (host shared memory today), copies the bytes, and
//! returns per-sample results with every feature's address. Trainers read the bytes by
//! (session, address) and free objects by writing JSON lists of keys to the control endpoint,
//! which the same writer thread serves.
//!
//! Data flows one way:
//! `sink -> writer (queue -> placer) -> arena (alloc + memory) -> result -> client (reader ->
//! transport) -> control client -> writer (control server) -> arena`.
//!
//! | module | noun |
//! |---|---|
//! | [`key`] | object keys `{store_id}/{sample_id}/g{gen}/{name}`, one type everywhere |
//! | [`alloc`] | extent allocator over `[0, capacity)`, youngest-neighbour fit (offsets only) |
//! | [`memory`] | regions (batch copies that may complete later) and the one mapping type |
//! | [`arena`] | region + allocator + object table; atomic batches, reserve → copy → commit |
//! | [`writer`] | the writer thread: submit queue, control server, placer |
//! | [`control`] | the free protocol: line buffer and parser |
//! | [`reply`] | the local reply path: descriptors and metadata for readers on the host |
//! | [`sample`], [`tensor`] | requests, tensors, results |
//! | [`config`] | every setting and its environment variable |
//! | [`stats`] | the writer's counters |
//! | [`transport`] | how a reader reaches an arena, chosen from the session |
//! | [`client`] | the trainer side: reader, control client, feature store |
#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod alloc;
pub mod arena;
pub mod client;
pub mod config;
pub mod control;
mod error;
pub mod key;
pub mod memory;
pub mod reply;
pub mod sample;
pub mod sink;
pub mod stats;
pub mod tensor;
pub mod transport;
pub mod writer;

// The README's Rust examples run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
mod readme {}

pub use arena::{Arena, StoreUsage};
pub use client::{ControlClient, FeatureStore, Reader};
pub use config::{arena_enabled, Config, Placement};
pub use error::{Error, Result};
pub use key::Key;
pub use sample::{ArenaRef, Feature, Published, Sample, SampleResult, SampleSpec};
pub use sink::Sink;
pub use stats::StatsSnapshot;
pub use tensor::{Dtype, Tensor, TensorData};
pub use transport::{Destination, DeviceSlice, ReadBuffer, ReadOp, Transport};
pub use writer::{BatchHandle, Writer};
