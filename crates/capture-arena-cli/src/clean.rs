//! `capture-arena clean`: give back the shared memory of producers that died without removing
//! their arena (killed outright, out of memory). A live producer's arena is never touched: its
//! producer holds a lock on it for its whole life, which `clean` tests (this works across PID
//! namespaces, unlike the pid in the name).

use std::path::Path;
use std::process::ExitCode;

use capture_arena::memory::shm::{is_abandoned, owner_pid, NAME_PREFIX};

use crate::workload::gib;

/// Flags of `clean`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Only list what would be removed.
    #[arg(long)]
    pub dry_run: bool,
    /// The shared-memory folder.
    #[arg(long, default_value = "/dev/shm")]
    pub dir: std::path::PathBuf,
}

/// Removes `/dev/shm/capture-arena-<pid>-*` objects that no producer holds any more.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut removed = (0u64, 0u64);
    let mut failed = 0;
    let entries = std::fs::read_dir(&args.dir)
        .map_err(|e| anyhow::anyhow!("listing {}: {e}", args.dir.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = owner_pid(&name) else {
            continue;
        };
        let bytes = entry.metadata().map_or(0, |m| m.len());
        let gone = if Path::new(&format!("/proc/{pid}")).exists() {
            format!("pid {pid} is running here")
        } else {
            format!("pid {pid} is not running here")
        };
        // An empty object is one being created this instant (before its producer locks it).
        match is_abandoned(&entry.path()) {
            Ok(true) if bytes > 0 => {}
            Ok(_) => {
                println!(
                    "in use   {name} ({}, held by its producer; {gone})",
                    gib(bytes)
                );
                continue;
            }
            Err(e) => {
                eprintln!("cannot check {name}: {e}");
                failed += 1;
                continue;
            }
        }
        if args.dry_run {
            println!(
                "stale    {name} ({}, no producer holds it; {gone})",
                gib(bytes)
            );
            removed = (removed.0 + 1, removed.1 + bytes);
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => {
                println!(
                    "removed  {name} ({}, no producer holds it; {gone})",
                    gib(bytes)
                );
                removed = (removed.0 + 1, removed.1 + bytes);
            }
            Err(e) => {
                eprintln!("cannot remove {name}: {e}");
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
        "{verb} {} stale {NAME_PREFIX}* objects, {}",
        removed.0,
        gib(removed.1)
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
