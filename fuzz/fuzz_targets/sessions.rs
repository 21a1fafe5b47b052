//! Session strings from results (a trainer parses them before it maps or connects anything):
//! every parser refuses, or returns a session that prints as a string it parses back to the same
//! session (the NIXL parser accepts only that canonical string).
#![no_main]

use capture_arena::memory::cuda::CudaSession;
use capture_arena::memory::ShmSession;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(s) = text.parse::<ShmSession>() {
        let printed = s.to_string();
        assert_eq!(printed.parse::<ShmSession>().ok(), Some(s));
    }
    if let Ok(s) = text.parse::<CudaSession>() {
        let printed = s.to_string();
        assert_eq!(printed.parse::<CudaSession>().ok(), Some(s));
    }
    #[cfg(feature = "nixl")]
    if let Ok(s) = text.parse::<capture_arena::memory::nixl::NixlSession>() {
        let printed = s.to_string();
        assert_eq!(printed, text, "canonical form only");
        assert_eq!(
            printed
                .parse::<capture_arena::memory::nixl::NixlSession>()
                .ok(),
            Some(s)
        );
    }
});
