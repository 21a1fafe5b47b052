//! `capture-arena clean`: give back the shared memory of producers that died without removing
//! their arena (killed outright, out of memory). A live producer's arena is never touched: its
//! producer holds a lock on it for its whole life, which `clean` tests (this works across PID
//! namespaces, unlike the pid in the name).

use std::path::Path;
use std::process::ExitCode;

use capture_arena::memory::shm::{remove_abandoned, SweptOutcome, NAME_PREFIX, SHM_DIR};

use crate::workload::gib;

/// Flags of `clean`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Only list what would be removed.
    #[arg(long)]
    pub dry_run: bool,
    /// The shared-memory folder.
    #[arg(long, default_value = SHM_DIR)]
    pub dir: std::path::PathBuf,
}

/// Removes `/dev/shm/capture-arena-<pid>-*` objects that no producer holds any more (what every
/// producer also does when it creates its arena).
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let seen = remove_abandoned(&args.dir, args.dry_run)?;
    let (mut removed, mut bytes, mut failed) = (0u64, 0u64, 0u64);
    for s in seen {
        let here = if Path::new(&format!("/proc/{}", s.pid)).exists() {
            "running here"
        } else {
            "not running here"
        };
        match s.outcome {
            SweptOutcome::InUse => println!(
                "in use   {} ({}, held by its producer; pid {} is {here})",
                s.name,
                gib(s.bytes),
                s.pid
            ),
            SweptOutcome::Removed => {
                let verb = if args.dry_run { "stale   " } else { "removed " };
                println!(
                    "{verb} {} ({}, no producer holds it; pid {} is {here})",
                    s.name,
                    gib(s.bytes),
                    s.pid
                );
                removed += 1;
                bytes += s.bytes;
            }
            SweptOutcome::Failed(why) => {
                eprintln!("{}: {why}", s.name);
                failed += 1;
            }
        }
    }
    let verb = if args.dry_run {
        "would remove"
    } else {
        "removed"
    };
    println!(
        "{verb} {removed} stale {NAME_PREFIX}* objects, {}",
        gib(bytes)
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
