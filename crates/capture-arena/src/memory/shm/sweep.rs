//! The sweep of abandoned arenas: which arena objects in `/dev/shm` no producer holds any more
//! (the creator's shared `flock` is gone: see the shm module docs), and their removal.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::NAME_PREFIX;
use crate::error::{Error, Result};

/// An empty object younger than this may be one being created this instant (before its
/// producer locks it); older ones are abandoned.
const CREATING_GRACE: Duration = Duration::from_secs(60);

/// The pid in an arena's shared-memory name (`capture-arena-<pid>-<nonce>`), or `None` for
/// any other name.
pub fn owner_pid(name: &str) -> Option<u32> {
    let (pid, nonce) = name.strip_prefix(NAME_PREFIX)?.split_once('-')?;
    let digits = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (digits && nonce.len() == 32 && nonce.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| pid.parse().ok())
        .flatten()
}

/// True when no producer holds the arena object at `path` (see the module docs). Another
/// process checking the same object at the same instant holds the lock for that instant, so a
/// `false` can be wrong (ask again later), a `true` never is.
///
/// # Errors
/// If the object cannot be opened, is no regular file, or the lock attempt fails for another
/// reason.
pub fn is_abandoned(path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    // Anyone can make a FIFO under an arena's name: opened without O_NONBLOCK it would wait
    // for a writer for good; it is no arena either way.
    super::regular(&f)?;
    // SAFETY: plain FFI on a descriptor `f` owns; the lock goes with it when `f` closes.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::WouldBlock {
        Ok(false)
    } else {
        Err(e)
    }
}

/// One arena object [`remove_abandoned`] looked at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swept {
    /// The object's name in the folder.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The pid in its name.
    pub pid: u32,
    /// What happened to it.
    pub outcome: SweptOutcome,
}

/// What [`remove_abandoned`] did with one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SweptOutcome {
    /// Held by a live producer: left alone.
    InUse,
    /// Abandoned and removed (or, in a dry run, would be).
    Removed,
    /// Could not be checked or removed (another user's object, a race): the reason.
    Failed(String),
}

/// Finds the arena objects in `dir` whose producer is gone and removes them (unless `dry_run`),
/// returning one entry per arena object seen. A live producer's arena is never touched.
///
/// # Errors
/// [`Error::Io`] if `dir` cannot be listed.
pub fn remove_abandoned(dir: &Path, dry_run: bool) -> Result<Vec<Swept>> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = owner_pid(&name) else {
            continue;
        };
        let meta = entry.metadata();
        let bytes = meta.as_ref().map_or(0, |m| m.len());
        let young = meta
            .as_ref()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_none_or(|age| age < CREATING_GRACE);
        let outcome = match is_abandoned(&entry.path()) {
            Ok(true) if bytes == 0 && young => SweptOutcome::InUse,
            Ok(true) if dry_run => SweptOutcome::Removed,
            Ok(true) => match std::fs::remove_file(entry.path()) {
                Ok(()) => SweptOutcome::Removed,
                Err(e) => SweptOutcome::Failed(format!("cannot remove: {e}")),
            },
            Ok(false) => SweptOutcome::InUse,
            Err(e) => SweptOutcome::Failed(format!("cannot check: {e}")),
        };
        out.push(Swept {
            name,
            bytes,
            pid,
            outcome,
        });
    }
    Ok(out)
}
