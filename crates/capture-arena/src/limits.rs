//! Bounds every input is checked against before it costs memory, shared by the modules that
//! parse (the control protocol, results, settings) so none imports another for them.

/// The longest line accepted; a longer one closes its connection. One MiB holds 25,574 keys of
/// 41 bytes (`free_latency`'s).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The shortest and longest token accepted.
pub const TOKEN_BYTES: std::ops::RangeInclusive<usize> = 16..=256;

/// True for a token this protocol carries: 16 to 256 bytes of `A-Z a-z 0-9 . _ ~ + / = -` (no
/// byte needs escaping in JSON, a URL or a shell).
pub fn is_valid_token(t: &str) -> bool {
    TOKEN_BYTES.contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_~+/=".contains(&b))
}

/// The instant `within` from now; a year from now for a bound too large to add (a caller's
/// timeout of `1e19` seconds is a wait, never an overflow panic).
pub fn deadline_in(within: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(within)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(86_400 * 365))
}

/// The most memory this process may use, and whose limit it is: the host's, or its cgroup's
/// (v2 `memory.max`, v1 `memory.limit_in_bytes`) where that is lower (Python's readers ask it
/// too: `_reader._memory_limit`). A read whose fresh outputs need more is refused: past a
/// cgroup's limit the kernel kills the process, where an error costs only that read. Read once.
pub fn memory_limit() -> (u64, &'static str) {
    static LIMIT: std::sync::OnceLock<(u64, &'static str)> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        memory_limit_in(
            host_memory(),
            &cgroup,
            std::path::Path::new("/sys/fs/cgroup"),
        )
    })
}

/// This host's memory in bytes (`u64::MAX` where it cannot be told).
fn host_memory() -> u64 {
    // SAFETY: sysconf only reads the system's configuration.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGE_SIZE),
        )
    };
    match (u64::try_from(pages), u64::try_from(size)) {
        (Ok(p), Ok(s)) if p > 0 && s > 0 => p.saturating_mul(s),
        _ => u64::MAX,
    }
}

/// [`memory_limit`] from the host's memory, `/proc/self/cgroup`'s text and the cgroup mount.
fn memory_limit_in(host: u64, cgroup: &str, root: &std::path::Path) -> (u64, &'static str) {
    let mut candidates = Vec::new();
    for line in cgroup.lines().take(64) {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next(), parts.next(), parts.next().unwrap_or(""));
        let path = path.trim_start_matches('/');
        if id == Some("0") && controllers == Some("") {
            candidates.push(root.join(path).join("memory.max"));
        } else if controllers.is_some_and(|c| c.split(',').any(|c| c == "memory")) {
            candidates.push(root.join("memory").join(path).join("memory.limit_in_bytes"));
        }
    }
    candidates.push(root.join("memory.max"));
    candidates.push(root.join("memory/memory.limit_in_bytes"));
    let mut limit = (host, "this host");
    for c in candidates {
        let Ok(raw) = std::fs::read_to_string(&c) else {
            continue;
        };
        if let Ok(n) = raw.trim().parse::<u64>() {
            if n < limit.0 {
                limit = (n, "this process's cgroup");
            }
        }
    }
    limit
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_limit_is_the_lowest_of_the_host_and_the_cgroups_v2_or_v1() {
        let root =
            std::env::temp_dir().join(format!("capture-arena-limits-{}", std::process::id()));
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::create_dir_all(root.join("memory/c")).unwrap();
        std::fs::write(root.join("a/b/memory.max"), "1048576\n").unwrap();
        std::fs::write(root.join("memory/c/memory.limit_in_bytes"), "2097152\n").unwrap();
        std::fs::write(root.join("memory.max"), "max\n").unwrap();
        assert_eq!(
            memory_limit_in(1 << 40, "0::/a/b\n", &root),
            (1 << 20, "this process's cgroup")
        );
        assert_eq!(
            memory_limit_in(1 << 40, "4:memory,cpu:/c\n", &root),
            (2 << 20, "this process's cgroup")
        );
        assert_eq!(
            memory_limit_in(1 << 19, "0::/a/b\n", &root),
            (1 << 19, "this host")
        );
        assert_eq!(
            memory_limit_in(1 << 40, "0::/elsewhere\n", &root),
            (1 << 40, "this host")
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
