//! The sink: what an inference server's capture hook holds. It owns a [`Config`] and starts the
//! writer (region and control listener included) on the first capture, so a server that never
//! captures takes no memory and opens no port; or, with `eager`
//! (`SGLANG_SPEC_CAPTURE_ARENA_EAGER=1`), when it is made, so the first capture does not pay
//! for creating and pre-faulting the arena (about half a second per GiB of host memory,
//! BENCHMARKS.md).

use std::sync::{Mutex, OnceLock};

use crate::config::Config;
use crate::error::Result;
use crate::sample::{Captured, Sample, SampleSpec};
use crate::stats::StatsSnapshot;
use crate::writer::{BatchHandle, Outcome, Writer};

/// A lazily started arena writer. See the module docs.
#[derive(Debug)]
pub struct Sink {
    config: Config,
    writer: OnceLock<Writer>,
    starting: Mutex<()>,
}

impl Sink {
    /// A sink with `config`, checked now; nothing is allocated until the first submission,
    /// unless `config.eager`.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) for an invalid setting; with `eager`, as
    /// [`Writer::start`].
    pub fn new(config: Config) -> Result<Sink> {
        config.validate()?;
        let sink = Sink {
            config,
            writer: OnceLock::new(),
            starting: Mutex::new(()),
        };
        if sink.config.eager && sink.config.placement() != crate::config::Placement::Engine {
            // SGLANG_SPEC_CAPTURE_ARENA_EAGER: pay for creating and pre-faulting the arena now,
            // not on the scheduler's thread at the first capture. (An engine arena's memory
            // comes from its owner: `start_with_region`.)
            sink.writer()?;
        }
        Ok(sink)
    }

    /// A sink configured from the environment.
    ///
    /// # Errors
    /// As [`Config::from_env`].
    pub fn from_env() -> Result<Sink> {
        Sink::new(Config::from_env()?)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The writer, started on first use.
    ///
    /// # Errors
    /// As [`Writer::start`] (the arena size is required then); a failed start is retried on the
    /// next call.
    pub fn writer(&self) -> Result<&Writer> {
        self.start(None)
    }

    /// The writer, started on first use; a device arena whose GPU is not configured
    /// (`SGLANG_SPEC_CAPTURE_ARENA_DEVICE`) goes on the GPU of the batch's first device tensor.
    fn writer_for(&self, samples: &[Sample]) -> Result<&Writer> {
        if let Some(w) = self.writer.get() {
            return Ok(w);
        }
        self.start(first_device(samples))
    }

    /// The writer, started now if it has not: as the first capture would, with a device arena
    /// whose GPU is not configured on `device` (default 0).
    ///
    /// # Errors
    /// As [`Sink::writer`].
    pub fn start_on(&self, device: Option<i32>) -> Result<&Writer> {
        self.start(device)
    }

    fn start(&self, device: Option<i32>) -> Result<&Writer> {
        if let Some(w) = self.writer.get() {
            return Ok(w);
        }
        let _guard = self.starting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = self.writer.get() {
            return Ok(w);
        }
        let w = match (self.config.device, device) {
            (None, Some(d)) if self.config.device_publication() => Writer::start(&Config {
                device: Some(d),
                ..self.config.clone()
            })?,
            _ => Writer::start(&self.config)?,
        };
        Ok(self.writer.get_or_init(|| w))
    }

    /// Starts the writer over a region the caller made (memory a transfer engine allocated or
    /// registered: [`crate::memory::ExternalHostRegion`], `ExternalDeviceRegion`) instead of one
    /// from the configuration; results then carry that region's session.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) if the writer has started already; as
    /// [`Writer::start_with_region`].
    pub fn start_with_region(&self, region: Box<dyn crate::memory::Region>) -> Result<&Writer> {
        let _guard = self.starting.lock().unwrap_or_else(|p| p.into_inner());
        if self.writer.get().is_some() {
            return Err(crate::Error::config(
                "arena",
                "this sink's writer has started already; a region is given before the first capture",
            ));
        }
        let w = Writer::start_with_region(&self.config, region)?;
        Ok(self.writer.get_or_init(|| w))
    }

    /// The writer if it has started.
    pub fn started(&self) -> Option<&Writer> {
        self.writer.get()
    }

    /// Builds a sample from a contract request and its captured tensors, with this sink's
    /// `aux_layer_ids`.
    ///
    /// # Errors
    /// As [`Sample::from_spec`].
    pub fn sample(
        &self,
        spec: &SampleSpec,
        aux: Option<Captured>,
        last_hidden: Option<Captured>,
    ) -> Result<Sample> {
        Sample::from_spec(spec, aux, last_hidden, self.config.aux_layer_ids.clone())
    }

    /// Queues a batch (starting the writer if needed), blocking while the queue is full.
    ///
    /// # Errors
    /// As [`Sink::writer`] and [`Writer::submit`].
    pub fn submit(&self, samples: Vec<Sample>) -> Result<BatchHandle> {
        self.writer_for(&samples)?.submit(samples)
    }

    /// Queues a batch and calls `done` on the writer thread when it completes.
    ///
    /// # Errors
    /// As [`Sink::writer`] and [`Writer::submit_with`].
    pub fn submit_with(
        &self,
        samples: Vec<Sample>,
        done: impl FnOnce(Outcome) + Send + 'static,
    ) -> Result<()> {
        self.writer_for(&samples)?.submit_with(samples, done)
    }

    /// As [`Sink::submit_with`] but never blocks.
    ///
    /// # Errors
    /// As [`Sink::writer`] and [`Writer::try_submit_with`] ([`crate::Error::QueueFull`]).
    pub fn try_submit_with(
        &self,
        samples: Vec<Sample>,
        done: impl FnOnce(Outcome) + Send + 'static,
    ) -> Result<()> {
        self.writer_for(&samples)?.try_submit_with(samples, done)
    }

    /// Publishes a batch for a synchronous caller, waiting at most `within` for it to start
    /// ([`Writer::submit_within`]); never starts the writer (a caller's thread must not pay for
    /// creating the arena: start it elsewhere with [`Sink::start_on`]).
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when the writer has not started, else as
    /// [`Writer::submit_within`].
    pub fn put_within(
        &self,
        samples: Vec<Sample>,
        within: std::time::Duration,
    ) -> Result<Vec<crate::Published>> {
        match self.started() {
            Some(w) => w.submit_within(samples, within),
            None => Err(still_starting()),
        }
    }

    /// Publishes each sample as a batch of its own, the whole call waiting for space at most
    /// `within` ([`Writer::submit_each_within`]); never starts the writer (as
    /// [`Sink::put_within`]).
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when the writer has not started, else as
    /// [`Writer::submit_each_within`].
    pub fn put_each_within(
        &self,
        samples: Vec<Sample>,
        within: std::time::Duration,
    ) -> Result<Vec<crate::writer::Outcome>> {
        match self.started() {
            Some(w) => w.submit_each_within(samples, within),
            None => Err(still_starting()),
        }
    }

    /// [`Sink::put_each_within`] returning the samples' handles once queued, without waiting
    /// for them ([`Writer::submit_each`]); never starts the writer.
    ///
    /// # Errors
    /// With the samples, when nothing was queued: [`crate::Error::Timeout`] when the writer
    /// has not started, else as [`Writer::submit_each`].
    pub fn put_each_handles(
        &self,
        samples: Vec<Sample>,
        deadline: std::time::Instant,
        wait_for_queue: bool,
    ) -> std::result::Result<Vec<crate::writer::BatchHandle>, Box<(crate::Error, Vec<Sample>)>>
    {
        match self.started() {
            Some(w) => w.submit_each(samples, deadline, wait_for_queue),
            None => Err(Box::new((still_starting(), samples))),
        }
    }

    /// Frees `keys` from this process ([`Writer::free_local`]); nothing before the writer
    /// has started.
    pub fn free_local(&self, keys: impl IntoIterator<Item = String>) {
        if let Some(w) = self.started() {
            w.free_local(keys);
        }
    }

    /// The arena's memory in this process ([`Writer::local_region`]); `None` before it exists.
    pub fn local_region(&self) -> Option<(u64, u64)> {
        self.started().map(Writer::local_region)
    }

    /// Finishes the writes of objects published from reserved tensors
    /// ([`Writer::finish_writes`]); nothing before the writer has started.
    pub fn finish_writes(&self, keys: impl IntoIterator<Item = String>, ok: bool) {
        if let Some(w) = self.started() {
            w.finish_writes(keys, ok);
        }
    }

    /// [`Writer::fail_writes_of`]; nothing before the writer has started.
    pub fn fail_writes_of(&self, keys: Vec<String>, stamps: Vec<u64>) {
        if let Some(w) = self.started() {
            w.fail_writes_of(keys, stamps);
        }
    }

    /// [`Writer::finish_writes_stamped`]; nothing before the writer has started.
    pub fn finish_writes_stamped(
        &self,
        objects: impl IntoIterator<Item = (String, u64)>,
        ok: bool,
    ) {
        if let Some(w) = self.started() {
            w.finish_writes_stamped(objects, ok);
        }
    }

    /// Finishes (`ok`) or fails the objects their submitter wrote, named by what it checked
    /// ([`Writer::finish_written`]); nothing before the writer has started.
    pub fn finish_written(
        &self,
        objects: impl IntoIterator<Item = crate::sample::Written>,
        ok: bool,
    ) {
        if let Some(w) = self.started() {
            w.finish_written(objects, ok);
        }
    }

    /// Peers refused for the control token ([`Writer::unauthorized_peers`]).
    pub fn unauthorized_peers(&self) -> Vec<crate::report::UnauthorizedPeer> {
        self.started()
            .map(Writer::unauthorized_peers)
            .unwrap_or_default()
    }

    /// The writer's counters (all zero before the first capture).
    pub fn stats(&self) -> StatsSnapshot {
        self.writer.get().map(Writer::stats).unwrap_or_default()
    }

    /// Resident objects per `store_id` ([`Writer::store_usage`]); empty before the first
    /// capture.
    pub fn store_usage(&self) -> Vec<crate::StoreUsage> {
        self.writer
            .get()
            .and_then(Writer::store_usage)
            .unwrap_or_default()
    }
}

/// What a bounded caller gets before the arena exists.
fn still_starting() -> crate::Error {
    crate::Error::Timeout {
        what: "publishing a batch".into(),
        waited: std::time::Duration::ZERO,
        reason: "the arena is still being created (it is made off the caller's thread; about \
                 half a second per GiB of SGLANG_SPEC_CAPTURE_ARENA_BYTES)"
            .into(),
    }
}

/// The GPU of the first device tensor of a batch.
fn first_device(samples: &[Sample]) -> Option<i32> {
    #[cfg(feature = "cuda")]
    for s in samples {
        for (_, t) in &s.tensors {
            if let crate::tensor::TensorData::Device(d) = &t.data {
                return Some(d.device());
            }
        }
    }
    let _ = samples;
    None
}
