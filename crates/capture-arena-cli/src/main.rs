//! `capture-arena`: the main job (`demo`), its two halves (`produce`, `consume`), `bench`, and the
//! operator's tools (`soak`, `free`, `stats`, `top`, `clean`, `device-info`).
//!
//! `cargo run --release -p capture-arena-cli -- demo`
//!
//! Its modules import only downward (`scripts/layers.py crates/capture-arena-cli/src`): at the
//! bottom the helpers, `workload` (synthetic samples and their checks), `measure` (table rows,
//! medians, the machine) and `gpu` (device copies and buffers); above them one module per
//! command (`nixl_bench` and `device` hold `bench`'s NIXL and device rows).

mod bench;
mod clean;
mod consume;
mod demo;
mod device;
mod free;
mod gpu;
mod inspect;
mod measure;
mod nixl_bench;
mod produce;
mod soak;
mod workload;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// capture-arena: move captured hidden states from an inference server's arena to trainers.
#[derive(Debug, Parser)]
#[command(version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// End-to-end capture -> read -> free run: starts a producer and a trainer process, checks
    /// every byte, and ends with the arena completely free.
    Demo(demo::Args),
    /// Run an arena and publish synthetic capture-shaped samples: one result JSON per line on
    /// stdout; serve frees until every object is freed; a final stats JSON line.
    Produce(produce::Args),
    /// Read result lines on stdin, read and verify every byte, free each sample.
    Consume(consume::Args),
    /// Measure memcpy, publish, read, view and end-to-end bandwidth side by side.
    Bench(bench::Args),
    /// Remove the shared memory of producers that died without removing their arena.
    Clean(clean::Args),
    /// Load and abuse for a fixed time (batches at full rate, trainer clients, hostile clients),
    /// then check that every byte is free and every object was freed exactly once.
    Soak(soak::Args),
    /// Free keys, or everything under a prefix (STORE_ID/ or STORE_ID/SAMPLE_ID/), at a
    /// producer's control endpoint: reclaim what a dead trainer held.
    Free(free::Args),
    /// Ask a running producer (its control endpoint) for its counters and who holds its arena:
    /// resident bytes and objects per store_id and the age of the oldest.
    Stats(inspect::StatsArgs),
    /// A live view of a running producer: occupancy, the largest free extent, rates, peer
    /// counters and the per-store_id table, redrawn every --interval.
    Top(inspect::TopArgs),
    /// What the GPU path finds here: the CUDA driver, the devices, and which handle type a
    /// device arena gets (fabric or POSIX fd) and why. One JSON object on stdout.
    DeviceInfo(device::InfoArgs),
    /// The producer half of `bench --transport nixl` (internal).
    #[command(hide = true)]
    BenchServe(nixl_bench::ServeArgs),
    /// The producer half of `soak` (internal).
    #[command(hide = true)]
    SoakProducer(soak::ProducerArgs),
    /// Serve a producer's arena through NIXL in a process of its own (internal: producers start
    /// it, SGLANG_SPEC_CAPTURE_NIXL_SERVER).
    #[cfg(feature = "nixl")]
    #[command(hide = true)]
    NixlServe(workload::NixlServeArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                // Warnings, plus the per-batch timing line when SGLANG_SPEC_CAPTURE_TIMING=1.
                let timing = capture_arena::writer::TIMING_TARGET;
                tracing_subscriber::EnvFilter::new(format!("warn,{timing}=info"))
            }),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    #[cfg(feature = "nixl")]
    workload::ucx_defaults();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(a) => demo::run(a),
        Command::Produce(a) => produce::run(a),
        Command::Consume(a) => consume::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Clean(a) => clean::run(a),
        Command::Free(a) => free::run(a),
        Command::Soak(a) => soak::run(a),
        Command::Stats(a) => inspect::stats(a),
        Command::Top(a) => inspect::top(a),
        Command::DeviceInfo(a) => device::info(a),
        Command::BenchServe(a) => nixl_bench::serve(a),
        Command::SoakProducer(a) => soak::serve(a),
        #[cfg(feature = "nixl")]
        Command::NixlServe(a) => workload::nixl_serve(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
