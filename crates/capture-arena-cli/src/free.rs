//! `capture-arena free`: frees keys, or everything under a prefix, at a producer's control
//! endpoint, for an operator or a restarted trainer reclaiming what a dead trainer held.

use std::process::ExitCode;

use anyhow::Context;
use capture_arena::Key;

/// Flags of `free`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub target: crate::inspect::Target,
    /// Free every resident object under this prefix: `STORE_ID/`, `STORE_ID/SAMPLE_ID/` or
    /// `STORE_ID/SAMPLE_ID/gGEN/` (repeatable).
    #[arg(long)]
    pub prefix: Vec<String>,
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
    let (timeout, token) = args.target.checked()?;
    let control = &args.target.control;
    capture_arena::client::send_frees(control, token, &keys, &args.prefix, timeout)
        .with_context(|| format!("freeing at {control}"))?;
    println!(
        "applied at {}: {} keys, {} prefixes{} (the producer confirmed them; keys it did not \
         hold are counted in its stats, not errors)",
        control,
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
