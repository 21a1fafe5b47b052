//! Where captured samples wait for trainers, decided in one place.

/// Where captured samples wait for trainers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// capture-arena's own arena: host shared memory (`shm://` sessions), or device memory with
    /// device publication (`cuda://`); read with capture-arena's readers.
    Arena,
    /// An arena inside a Mooncake TransferEngine: device memory from its
    /// `allocate_managed_buffer` under `nvlink`/`nvlink_intra`, a host buffer registered with it
    /// under other protocols. Results carry the engine's session (`<host>:<rpc_port>`) and its
    /// virtual addresses, so any TransferEngine reader can read them. The engine is created by
    /// the Python package; a Rust embedder passes its memory to `Sink::start_with_region`.
    Engine,
    /// The Mooncake store, one object per tensor (SpecForge's placement).
    Store,
}

impl Placement {
    /// Its name in `SGLANG_SPEC_CAPTURE_PLACEMENT`.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Arena => "arena",
            Placement::Engine => "engine",
            Placement::Store => "store",
        }
    }
}

/// True for the NVLink protocols (`nvlink`, `nvlink_intra`, any case).
pub fn is_nvlink(protocol: Option<&str>) -> bool {
    protocol.is_some_and(|p| {
        let p = p.trim();
        p.eq_ignore_ascii_case("nvlink") || p.eq_ignore_ascii_case("nvlink_intra")
    })
}

/// The one place placement is decided: `SGLANG_SPEC_CAPTURE_PLACEMENT` when set (`arena`,
/// `engine`, `store`), else (`auto`) the engine's device arena under `nvlink`/`nvlink_intra` and
/// the Mooncake store under every other protocol, as the seed's deployment has it.
pub fn placement(protocol: Option<&str>, setting: Option<Placement>) -> Placement {
    match setting {
        Some(p) => p,
        None if is_nvlink(protocol) => Placement::Engine,
        None => Placement::Store,
    }
}

/// Parses `SGLANG_SPEC_CAPTURE_PLACEMENT`: `auto` is `None`.
pub fn parse_placement(v: &str) -> std::result::Result<Option<Placement>, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(None),
        "arena" => Ok(Some(Placement::Arena)),
        "engine" => Ok(Some(Placement::Engine)),
        "store" => Ok(Some(Placement::Store)),
        _ => Err(format!("{v:?} is not one of auto, arena, engine, store")),
    }
}

/// `SGLANG_SPEC_CAPTURE_PLACEMENT`: `auto` (default), `arena`, `engine` or `store`; see
/// [`placement`].
pub const ENV_PLACEMENT: &str = "SGLANG_SPEC_CAPTURE_PLACEMENT";
