//! `capture-arena free`: frees keys, or everything under a prefix, at a producer's control
//! endpoint, for an operator or a restarted trainer reclaiming what a dead trainer held.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use capture_arena::Key;

/// Flags of `free`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The producer's control endpoint, HOST:PORT (a result's `arena.control`).
    #[arg(long)]
    pub control: String,
    /// The control token, when the producer has one (a result's `arena.token`).
    #[arg(
        long,
        env = "SGLANG_SPEC_CAPTURE_CONTROL_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// Free every resident object under this prefix: `STORE_ID/`, `STORE_ID/SAMPLE_ID/` or
    /// `STORE_ID/SAMPLE_ID/gGEN/` (repeatable).
    #[arg(long)]
    pub prefix: Vec<String>,
    /// Seconds to wait for the connection.
    #[arg(long, default_value_t = 5.0)]
    pub timeout: f64,
    /// Keys to free (`STORE_ID/SAMPLE_ID/gGEN/NAME`).
    pub keys: Vec<String>,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        !args.keys.is_empty() || !args.prefix.is_empty(),
        "nothing to free: give keys, or --prefix STORE_ID/ (or STORE_ID/SAMPLE_ID/)"
    );
    let keys = args
        .keys
        .iter()
        .map(|k| k.parse::<Key>())
        .collect::<capture_arena::Result<Vec<Key>>>()?;
    let timeout = Duration::try_from_secs_f64(args.timeout)
        .map_err(|_| anyhow::anyhow!("--timeout {} is not a number of seconds", args.timeout))?;
    anyhow::ensure!(
        args.token.as_deref() != Some("auto"),
        "the token is `auto` (a producer's setting, maybe from SGLANG_SPEC_CAPTURE_CONTROL_TOKEN \
         in this shell): pass the producer's token, a result's arena.token, with --token"
    );
    let token = args.token.as_deref();
    capture_arena::client::send_frees(&args.control, token, &keys, &args.prefix, timeout)
        .with_context(|| format!("freeing at {}", args.control))?;
    println!(
        "sent to {}: {} keys, {} prefixes{} (frees are one-way: see the producer's stats)",
        args.control,
        keys.len(),
        args.prefix.len(),
        if token.is_some() {
            ", with the token"
        } else {
            ""
        }
    );
    Ok(ExitCode::SUCCESS)
}
