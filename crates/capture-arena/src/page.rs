//! Pages: this host's page size and the arithmetic on it. x86-64 has 4 KiB pages; Grace
//! (GB200/GB300, aarch64) kernels often use 64 KiB. Mapping lengths and offsets, page-aligned
//! buffers and pinned ranges take the size from [`page_size`], never from a constant; formats
//! and alignments that must hold on every host use [`MIN_PAGE`], which divides every page size.

/// The smallest page size of the platforms we run on (x86-64; aarch64 with 4 KiB kernels). Grace
/// kernels often use 64 KiB pages; every page size is a power-of-two multiple of this one.
pub const MIN_PAGE: usize = 4096;

/// This host's page size (`sysconf(_SC_PAGESIZE)`: 4 KiB on x86-64, often 64 KiB on Grace), at
/// least [`MIN_PAGE`]. Mapping lengths and offsets, page-aligned buffers and pinned ranges take
/// it from here, never from a constant.
pub fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p)
            .ok()
            .filter(|p| p.is_power_of_two() && *p >= MIN_PAGE)
            .unwrap_or(MIN_PAGE)
    })
}

/// `n` rounded up to a multiple of `page` (a power of two); `None` if that overflows.
pub fn round_up_to_page(n: usize, page: usize) -> Option<usize> {
    debug_assert!(page.is_power_of_two());
    n.checked_add(page - 1).map(|m| m & !(page - 1))
}

/// The start of the page of `page` bytes that holds `addr`.
pub fn page_start(addr: usize, page: usize) -> usize {
    debug_assert!(page.is_power_of_two());
    addr & !(page - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: usize = 64 << 10;

    #[test]
    fn rounds_at_64k_pages_as_at_4k() {
        assert_eq!(round_up_to_page(0, GRACE), Some(0));
        assert_eq!(round_up_to_page(1, GRACE), Some(GRACE));
        assert_eq!(round_up_to_page(4096, GRACE), Some(GRACE));
        assert_eq!(round_up_to_page(GRACE, GRACE), Some(GRACE));
        assert_eq!(round_up_to_page(GRACE + 1, GRACE), Some(2 * GRACE));
        assert_eq!(round_up_to_page(usize::MAX - 10, GRACE), None);
        assert_eq!(round_up_to_page(4097, MIN_PAGE), Some(8192));
        assert_eq!(page_start(0x1_2345, GRACE), 0x1_0000);
        assert_eq!(page_start(0x1_2345, MIN_PAGE), 0x1_2000);
    }

    #[test]
    fn this_hosts_page_is_a_power_of_two_multiple_of_the_smallest() {
        let p = page_size();
        assert!(p.is_power_of_two() && p.is_multiple_of(MIN_PAGE), "{p}");
        // SAFETY: sysconf has no preconditions.
        assert_eq!(p as libc::c_long, unsafe {
            libc::sysconf(libc::_SC_PAGESIZE)
        });
    }
}
