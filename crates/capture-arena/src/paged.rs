//! A paged cache's rows, copied into an object with no gather.
//!
//! vLLM's cache-only layer (`extract_hidden_states`) keeps a request's hidden states spread over
//! the cache's blocks: `[blocks, k, block_size, row]` through its strides, token `i` in block
//! `block_ids[i / block_size]`, slot `i % block_size`. An object wants them as `[n, k, row]`.
//! [`Paged::plan`] turns a request's blocks into [`Strip`]s, each a 2-D copy (rows of one width,
//! at a pitch on either side), as few as the cache's layout allows: one per block and layer, one
//! per block when a slot holds its k layers side by side, and one for a run of blocks that lie
//! one after another in memory. [`copy_host`] runs them with `memcpy`; `DeviceCopies` (feature
//! `cuda`) enqueues them as `cuMemcpy2DAsync` on a stream of its own, straight from the cache's
//! blocks into a host arena (device-to-host) or a device arena (device-to-device): no staging
//! buffer, and no Python.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::sample::{stamp_offset, ReservedObjects, StampWord, Written, PENDING_BIT, STAMP_BYTES};

/// Where a request's rows are in a paged cache `[blocks, k, block_size, row]` (in bytes, through
/// its strides): each `(block, layer, slot)` row is `row_bytes` contiguous bytes at
/// `base + block * strides.0 + layer * strides.1 + slot * strides.2`, all inside
/// `[base, base + len)`, for `block < blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paged {
    /// The cache's first byte (an address in this process: host or device memory).
    pub base: u64,
    /// The cache's bytes from `base` (the tensor's own extent, not the storage it views: vLLM's
    /// caches are views into buffers other layers share).
    pub len: u64,
    /// The cache's blocks: a block id is below it.
    pub blocks: u64,
    /// The strides of blocks, layers and slots, in bytes.
    pub strides: (u64, u64, u64),
    /// Slots (tokens) per block.
    pub block_size: u64,
    /// Layers per slot.
    pub k: u64,
    /// Bytes of one layer's row.
    pub row_bytes: u64,
}

/// One 2-D copy: `height` rows of `width` bytes, the first at offset `src` of the cache (from
/// its base) and `dst` of the object, each next one `src_pitch` and `dst_pitch` further on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strip {
    /// Offset of the first row from the cache's base.
    pub src: u64,
    /// Bytes from one row to the next in the cache.
    pub src_pitch: u64,
    /// Offset of the first row in the object.
    pub dst: u64,
    /// Bytes from one row to the next in the object.
    pub dst_pitch: u64,
    /// Bytes of each row.
    pub width: u64,
    /// Rows.
    pub height: u64,
}

impl Strip {
    /// One past its last byte on each side, `(cache, object)`; `None` if that overflows.
    fn ends(&self) -> Option<(u64, u64)> {
        let last = self.height.checked_sub(1)?;
        let src = self.src.checked_add(last.checked_mul(self.src_pitch)?)?;
        let dst = self.dst.checked_add(last.checked_mul(self.dst_pitch)?)?;
        Some((src.checked_add(self.width)?, dst.checked_add(self.width)?))
    }

    /// Whether its rows follow one another on both sides (one run of `width * height` bytes).
    fn flat(&self) -> bool {
        self.height == 1 || (self.src_pitch == self.width && self.dst_pitch == self.width)
    }
}

impl Paged {
    /// The strips that copy rows `0..n` of a request (token `i` in block
    /// `block_ids[i / block_size]`) into an object of `dst_len` bytes laid out `[n, k, row]`,
    /// each checked to lie inside the cache and the object, which the rows must fill exactly.
    ///
    /// # Errors
    /// Why not, naming the numbers: sizes that do not match, too few blocks, a row outside the
    /// cache.
    pub fn plan(&self, dst_len: u64, block_ids: &[u64], n: u64) -> Result<Vec<Strip>, String> {
        self.check()?;
        let kr = self.k.checked_mul(self.row_bytes).ok_or_else(|| {
            format!(
                "the rows' size overflows ({} layers of {} bytes)",
                self.k, self.row_bytes
            )
        })?;
        let want = n
            .checked_mul(kr)
            .ok_or_else(|| format!("the rows' size overflows ({n} rows of {kr} bytes)"))?;
        if want != dst_len {
            return Err(format!(
                "{n} rows of {} x {} bytes (one per token id read) do not fill the {dst_len}-byte \
                 object of {} rows",
                self.k,
                self.row_bytes,
                dst_len / kr
            ));
        }
        if n > (block_ids.len() as u64).saturating_mul(self.block_size) {
            return Err(format!(
                "{n} rows need more than {} blocks of {}",
                block_ids.len(),
                self.block_size
            ));
        }
        // A slot's k layers side by side: each block's rows are one strip of k rows' width.
        let slot_whole = self.k == 1 || self.strides.1 == self.row_bytes;
        let mut strips: Vec<Strip> = Vec::new();
        for (j, &block) in block_ids.iter().enumerate() {
            let first = j as u64 * self.block_size;
            if first >= n {
                break;
            }
            if block >= self.blocks {
                return Err(format!(
                    "block {block} is not in the cache, which has {} blocks",
                    self.blocks
                ));
            }
            let height = self.block_size.min(n - first);
            for layer in 0..if slot_whole { 1 } else { self.k } {
                let src = block
                    .checked_mul(self.strides.0)
                    .and_then(|b| b.checked_add(layer.checked_mul(self.strides.1)?))
                    .ok_or_else(|| format!("block {block} lies outside the cache"))?;
                let s = Strip {
                    src,
                    src_pitch: self.strides.2,
                    dst: first * kr + layer * self.row_bytes,
                    dst_pitch: kr,
                    width: if slot_whole { kr } else { self.row_bytes },
                    height,
                };
                let inside = s.ends().is_some_and(|(a, b)| a <= self.len && b <= dst_len);
                if !inside {
                    return Err(format!(
                        "rows {first}..{} of layer {layer} (block {block}) lie outside the cache \
                         ({} bytes, strides {:?})",
                        first + height,
                        self.len,
                        self.strides
                    ));
                }
                push_strip(&mut strips, s);
            }
        }
        Ok(strips)
    }

    /// Whether the description can be planned from at all: a cache at an address, whose range
    /// does not wrap, with blocks, layers and rows of some size.
    fn check(&self) -> Result<(), String> {
        let end = self.base.checked_add(self.len);
        if self.base == 0
            || end.is_none()
            || self.block_size == 0
            || self.k == 0
            || self.row_bytes == 0
        {
            return Err(format!(
                "the cache is not one to copy from (base {:#x}, {} bytes, {} blocks of {} slots, \
                 {} layers of {} bytes)",
                self.base, self.len, self.blocks, self.block_size, self.k, self.row_bytes
            ));
        }
        Ok(())
    }

    /// Whether the cache's bytes and `[at, at + size)` share any.
    fn overlaps(&self, (at, size): (u64, u64)) -> bool {
        at < self.base.saturating_add(self.len) && self.base < at.saturating_add(size)
    }
}

/// Appends `s` to `strips`: as rows of their own when its source rows overlap (a pitch below
/// the width, which a 2-D copy refuses), as one flat run when its rows follow one another, and
/// merged into the last strip when both are flat and `s` continues it on both sides (blocks
/// next to one another in memory).
fn push_strip(strips: &mut Vec<Strip>, s: Strip) {
    if s.height > 1 && s.src_pitch < s.width {
        for r in 0..s.height {
            push_strip(
                strips,
                Strip {
                    src: s.src + r * s.src_pitch,
                    dst: s.dst + r * s.dst_pitch,
                    height: 1,
                    ..s
                },
            );
        }
        return;
    }
    let s = if s.flat() {
        Strip {
            src_pitch: s.width * s.height,
            dst_pitch: s.width * s.height,
            width: s.width * s.height,
            height: 1,
            ..s
        }
    } else {
        s
    };
    if let Some(last) = strips.last_mut() {
        if s.height == 1
            && last.height == 1
            && last.src + last.width == s.src
            && last.dst + last.width == s.dst
        {
            last.width += s.width;
            last.src_pitch = last.width;
            last.dst_pitch = last.width;
            return;
        }
    }
    strips.push(s);
}

/// Copies `strips` from the cache at `src_base` into the object at `dst_base` with `memcpy`.
///
/// # Safety
/// Every strip lies inside the cache and the object ([`Paged::plan`] checks both against their
/// lengths); both ranges are valid host memory for the call and do not overlap.
pub unsafe fn copy_host(src_base: u64, dst_base: u64, strips: &[Strip]) {
    for s in strips {
        for r in 0..s.height {
            // SAFETY: the caller's promise (above).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (src_base + s.src + r * s.src_pitch) as usize as *const u8,
                    (dst_base + s.dst + r * s.dst_pitch) as usize as *mut u8,
                    s.width as usize,
                )
            };
        }
    }
}

/// One request's copy ([`copy_requests`]): its token ids and rows, where they go, and its
/// objects' keys (failed by them if it fails).
pub struct Request {
    /// Its objects' keys.
    pub keys: Vec<String>,
    /// Where its token ids go (`[n]` int64).
    pub ids_dst: u64,
    /// The stamp of the object at `ids_dst`, as its reservation's result gives it.
    pub ids_stamp: u64,
    /// Its token ids: `n` of them.
    pub ids: Vec<i64>,
    /// Where its rows go (`[n, k, row]`).
    pub rows_dst: u64,
    /// The stamp of the object at `rows_dst`.
    pub rows_stamp: u64,
    /// The rows' bytes.
    pub rows_len: u64,
    /// Its blocks in the cache, in token order.
    pub block_ids: Vec<u64>,
}

/// How a request's copy ended (what [`copy_requests`] hands its `finished`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Landed {
    /// Every byte is in place: its two objects (token ids, rows), each named by its stamp and
    /// where its bytes went, as checked before they were written. A caller finishes these
    /// ([`crate::Writer::finish_written`]), not the request's keys, so a request given another's
    /// keys cannot finish that other's objects before their bytes.
    Written([Written; 2]),
    /// Its bytes never will be: its two objects, named as for [`Landed::Written`], which the
    /// writer's table vouched for (each the object being written with its stamp, where it
    /// says, of its length). A caller fails these, not the request's keys, so a request given
    /// another's keys cannot fail that other's objects while their own copy writes them.
    Failed([Written; 2]),
    /// Its bytes never will be, and no table vouched for its objects' names (none was given,
    /// or they are not its reservation's): its keys, to fail, and the stamps it was given (none
    /// for a request that could not be read). A caller fails those of a sample with an object
    /// being written with one of the stamps ([`crate::Writer::fail_writes_of`]; by the keys
    /// alone where there is none), so a request given another's keys cannot fail that other's
    /// objects either.
    FailedKeys(Vec<String>, Vec<u64>),
}

impl Request {
    /// The objects it writes, as [`Landed::Written`] names them.
    fn written(&self) -> [Written; 2] {
        [
            Written {
                stamp: self.ids_stamp,
                at: self.ids_dst,
                len: (self.ids.len() as u64) * 8,
            },
            Written {
                stamp: self.rows_stamp,
                at: self.rows_dst,
                len: self.rows_len,
            },
        ]
    }

    /// What its failure fails: its objects by name where `reserved` (the writer's table)
    /// vouches for both, else its keys.
    fn failure(self, reserved: Option<&ReservedObjects>) -> Landed {
        let written = self.written();
        match reserved {
            Some(t) if written.iter().all(|w| t.check(w).is_ok()) => Landed::Failed(written),
            _ => Landed::FailedKeys(self.keys, vec![self.ids_stamp, self.rows_stamp]),
        }
    }

    /// Its rows' strips ([`Paged::plan`]), once both its destinations are checked to lie in
    /// `arena` (`(address, bytes)` as this process maps it) and to be the objects reserved with
    /// its stamps, still being written: in a host arena (`host`) by their stamp words
    /// ([`reserved_at`]), and by the writer's table of them where given (`reserved`,
    /// [`ReservedObjects::check`]: each object exactly, where and how long it is), which is
    /// all a device arena has (its words are device memory).
    fn plan(
        &self,
        src: &Paged,
        arena: (u64, u64),
        host: bool,
        reserved: Option<&ReservedObjects>,
    ) -> Result<Vec<Strip>, String> {
        let ids_len = (self.ids.len() as u64) * 8;
        if !inside(arena, self.ids_dst, ids_len) || !inside(arena, self.rows_dst, self.rows_len) {
            return Err(format!(
                "[{:#x}, +{ids_len}) or [{:#x}, +{}) is not in this sink's arena [{:#x}, +{})",
                self.ids_dst, self.rows_dst, self.rows_len, arena.0, arena.1
            ));
        }
        if src.overlaps(arena) {
            return Err(format!(
                "the cache [{:#x}, +{}) and this sink's arena [{:#x}, +{}) overlap",
                src.base, src.len, arena.0, arena.1
            ));
        }
        let strips = src.plan(self.rows_len, &self.block_ids, self.ids.len() as u64)?;
        if host {
            // SAFETY: a host arena is this process's own mapping, valid for reads (the
            // callers' promise).
            unsafe {
                reserved_at(arena, self.ids_dst, ids_len, self.ids_stamp)?;
                reserved_at(arena, self.rows_dst, self.rows_len, self.rows_stamp)?;
            }
        }
        if let Some(reserved) = reserved {
            for w in &self.written() {
                reserved.check(w)?;
            }
        }
        Ok(strips)
    }

    /// Writes its token ids where they go, in host memory.
    ///
    /// # Safety
    /// `ids_dst` lies in a host arena of this process ([`Request::plan`] checks it against the
    /// arena), which nothing else writes there.
    unsafe fn write_ids(&self) {
        // SAFETY: the caller's promise; the ids are `ids.len() * 8` bytes of this request's own.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ids.as_ptr() as *const u8,
                self.ids_dst as usize as *mut u8,
                self.ids.len() * 8,
            )
        };
    }
}

/// Checks that the `len` bytes at `at`, in a host arena, are the object reserved with `stamp`
/// and not yet finished: its stamp word (the 8 bytes at `at` plus `len` rounded up to 8) is
/// `stamp | PENDING_BIT`, as the writer set it when it placed the reservation. A destination
/// that is not that object (another request's, a freed one's, a size that does not match, a
/// stamp that is not this reservation's) is refused before a byte is written: the addresses and
/// stamps come from the caller, whose bookkeeping this does not take on trust.
///
/// # Safety
/// `arena` is host memory of this process, valid for reads.
unsafe fn reserved_at(arena: (u64, u64), at: u64, len: u64, stamp: u64) -> Result<(), String> {
    let word_at = at
        .checked_add(stamp_offset(len))
        .filter(|&w| w.is_multiple_of(STAMP_BYTES) && inside(arena, w, STAMP_BYTES));
    let Some(word_at) = word_at else {
        return Err(format!(
            "the object [{at:#x}, +{len}) has no aligned stamp word in this sink's arena \
             [{:#x}, +{})",
            arena.0, arena.1
        ));
    };
    // SAFETY: an aligned word inside the arena (checked), which the caller vouched is readable;
    // the writer stores such words whole (`store_word`), so an atomic load sees one or the other.
    let word = unsafe { AtomicU64::from_ptr(word_at as usize as *mut u64) }.load(Ordering::Acquire);
    let word = u64::from_le(word);
    if StampWord::of(word, stamp) != StampWord::Pending {
        return Err(format!(
            "[{at:#x}, +{len}) is not the object reserved with stamp {stamp} and still being \
             written: its stamp word is {word:#x}, not {:#x} (a destination or stamp that is not \
             this request's reservation)",
            stamp | PENDING_BIT
        ));
    }
    Ok(())
}

/// Whether `[at, at + len)` lies inside `[base, base + size)`.
fn inside((base, size): (u64, u64), at: u64, len: u64) -> bool {
    at >= base && at.checked_add(len).is_some_and(|end| end <= base + size)
}

/// Copies each request's token ids and rows into its reserved objects, which must lie in
/// `arena` (`(address, bytes)` as this process maps it) and be the objects being written with
/// the request's stamps (their stamp words, and `reserved`, the writer's table of them, where
/// given), and calls `finished(i, landed)` as soon as request `i`'s bytes have landed (or never
/// will): its readers need not wait for the others.
/// Returns, per request, `None` or why it was not copied (checked before any of its bytes are:
/// a destination outside the arena, rows outside the cache, sizes that do not match). Nothing
/// here needs Python: a caller from Python releases the GIL for it.
///
/// # Safety
/// `[src.base, src.base + src.len)` must be valid for reads until this returns, and `arena`
/// valid for writes; they must not overlap; nothing else may write the requests' objects
/// meanwhile.
pub unsafe fn copy_requests(
    src: &Paged,
    arena: (u64, u64),
    reserved: Option<&ReservedObjects>,
    requests: Vec<Request>,
    mut finished: impl FnMut(usize, Landed),
) -> Vec<Option<String>> {
    let mut out = Vec::with_capacity(requests.len());
    for (i, r) in requests.into_iter().enumerate() {
        let checked = r.plan(src, arena, true, reserved);
        match checked {
            Ok(strips) => {
                // SAFETY: the destinations lie inside the arena and the rows inside the cache
                // (checked above); the caller vouched for both ranges and that nothing else
                // writes these objects.
                unsafe {
                    r.write_ids();
                    copy_host(src.base, r.rows_dst, &strips);
                }
                finished(i, Landed::Written(r.written()));
                out.push(None);
            }
            Err(why) => {
                finished(i, r.failure(reserved));
                out.push(Some(format!("copying cache rows: {why}")));
            }
        }
    }
    out
}

/// The most bytes one device copy of a flat run moves (`DeviceCopies`): a longer run is several
/// copies, between which the copy engine can take the engine's own (vLLM's small copies of a
/// step's inputs and outputs) instead of waiting behind the whole run.
pub const COPY_PIECE: u64 = 64 << 20;

#[cfg(feature = "cuda")]
pub use device::{copy_requests_device, DeviceCopies, DeviceStep, HostPin, Landing};

#[cfg(feature = "cuda")]
mod device {
    use super::{Landed, Paged, Request, ReservedObjects, Strip, Written, COPY_PIECE};
    use crate::driver::{context, Event, Stream};
    use crate::error::Result;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Copies from a device cache on a stream of their own (non-blocking: it never waits for
    /// the legacy default stream), enqueued from any thread without Python.
    pub struct DeviceCopies {
        stream: Stream,
        /// The largest pitch a 2-D copy takes (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`: 2^31 - 1 on
        /// an H100): a strip with a larger one goes row by row.
        max_pitch: u64,
        /// Set once the driver refused a device-to-device 2-D copy whose rows then went
        /// through: later ones go row by row at once.
        d2d_rows: AtomicBool,
    }

    /// A host arena pinned for the device-to-host copies into it: registered with the driver on
    /// a thread of its own, in chunks and in relaxed capture mode (the lazy pin every mapping of
    /// ours uses), while copies go on pageable, slower and correct; unpinned when dropped, after
    /// a registration still running. Nothing where `SGLANG_SPEC_CAPTURE_PIN_HOST` is `0`.
    pub struct HostPin {
        pin: Option<crate::driver::LazyPin>,
        ordinal: i32,
    }

    impl HostPin {
        /// Starts pinning `[address, address + len)` of this process's memory, in device
        /// `ordinal`'s context (portable: for every GPU).
        ///
        /// # Safety
        /// The range stays mapped until the value is dropped.
        pub unsafe fn start(ordinal: i32, address: u64, len: u64) -> HostPin {
            let pin = crate::memory::mapping::pinning_on().then(|| {
                // SAFETY: the caller keeps the range mapped while this lives.
                unsafe { crate::driver::LazyPin::new(address as *mut u8, len as usize, false) }
            });
            let p = HostPin { pin, ordinal };
            p.pinned();
            p
        }

        /// Whether the range is pinned now: false while it is being registered, where
        /// `SGLANG_SPEC_CAPTURE_PIN_HOST` is `0`, and where the driver refused (logged).
        pub fn pinned(&self) -> bool {
            self.pin
                .as_ref()
                .is_some_and(|p| p.pinned(self.ordinal, "the host arena"))
        }
    }

    /// The point a stream's copies had reached when [`DeviceCopies::mark`] was called.
    pub struct Landing(Event);

    impl Landing {
        /// Waits (the thread sleeps) until every copy before the mark has landed.
        ///
        /// # Errors
        /// [`crate::Error::Device`] when a copy failed (the context's error).
        pub fn wait(&self) -> Result<()> {
            self.0.synchronize()
        }

        /// Its raw event, which another stream may wait on ([`DeviceCopies::after`]); valid
        /// while this lives.
        pub fn handle(&self) -> u64 {
            self.0.handle()
        }
    }

    impl DeviceCopies {
        /// A new stream on device `ordinal` (its primary context: torch's).
        ///
        /// # Errors
        /// [`crate::Error::Device`] without a driver or with no such device.
        pub fn new(ordinal: i32) -> Result<DeviceCopies> {
            let ctx = context(ordinal)?;
            let max_pitch = ctx
                .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH);
            Ok(DeviceCopies {
                stream: Stream::new(&ctx)?,
                // A driver that does not say: the smallest limit of any GPU of the last decade.
                max_pitch: if max_pitch > 0 {
                    max_pitch as u64
                } else {
                    i32::MAX as u64
                },
                d2d_rows: AtomicBool::new(false),
            })
        }

        /// Makes every later copy wait for `event`, a raw `CUevent` (a `cudaEvent_t`: torch's
        /// `Event.cuda_event`) recorded on the stream that wrote the cache.
        ///
        /// # Safety
        /// `event` must be a valid event of this process until this returns.
        ///
        /// # Errors
        /// [`crate::Error::Device`] from the driver.
        pub unsafe fn after(&self, event: u64) -> Result<()> {
            // SAFETY: the caller's promise.
            unsafe { self.stream.wait_raw(event) }
        }

        /// Enqueues `strips` from the cache at device address `src_base` into the object at
        /// `dst_base`: host memory (pinned or not) when `dst_host`, else device memory.
        /// - A flat strip (one row: a run of blocks, which may pass 2 GiB) is plain copies of at
        ///   most [`COPY_PIECE`] bytes each, so that no copy of ours holds the copy engine for
        ///   long in front of the engine's own (a 3.2 GB run at 50 GB/s is 64 ms).
        /// - A 2-D strip whose pitch passes the device's limit goes row by row.
        /// - So does a device-to-device 2-D strip the driver refuses: it documents that
        ///   intra-device 2-D copies "may fail for pitches not computed by cuMemAllocPitch". Once
        ///   rows went through where the 2-D copy did not, every later device-to-device strip of
        ///   this stream goes row by row (logged once).
        ///
        /// # Safety
        /// Every strip lies inside the cache and the object ([`super::Paged::plan`]); both stay
        /// valid, and nothing else writes the object, until a later [`Landing`] is waited for.
        ///
        /// # Errors
        /// [`crate::Error::Device`] for the first copy the driver refused (those before it
        /// are enqueued).
        pub unsafe fn rows(
            &self,
            src_base: u64,
            dst_base: u64,
            dst_host: bool,
            strips: &[Strip],
        ) -> Result<()> {
            for s in strips {
                let (src, dst) = (src_base + s.src, dst_base + s.dst);
                let two_d = s.height > 1
                    && s.src_pitch.max(s.dst_pitch) <= self.max_pitch
                    && (dst_host || !self.d2d_rows.load(Ordering::Relaxed));
                if two_d {
                    // SAFETY: the caller's promise; both pitches are at least the width (the
                    // plan's strips) and within the device's limit.
                    let refused = match unsafe {
                        self.stream.copy_2d(
                            src,
                            s.src_pitch,
                            dst,
                            s.dst_pitch,
                            dst_host,
                            s.width,
                            s.height,
                        )
                    } {
                        Ok(()) => continue,
                        Err(e) if dst_host => return Err(e),
                        Err(e) => e,
                    };
                    // SAFETY: as above (a refused copy enqueued nothing).
                    unsafe { self.row_by_row(src, dst, dst_host, s)? };
                    if !self.d2d_rows.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            error = %refused,
                            pitches = ?(s.src_pitch, s.dst_pitch),
                            "the driver refused a device-to-device 2-D copy that row by row \
                             copies took: this stream copies such strips row by row from now on"
                        );
                    }
                    continue;
                }
                // SAFETY: the caller's promise.
                unsafe { self.row_by_row(src, dst, dst_host, s)? };
            }
            Ok(())
        }

        /// Enqueues `s`'s rows one by one (a flat strip's one row in pieces of at most
        /// [`COPY_PIECE`] bytes), from device address `src` to `dst`.
        ///
        /// # Safety
        /// As [`DeviceCopies::rows`], for `s` at `src` and `dst`.
        unsafe fn row_by_row(&self, src: u64, dst: u64, dst_host: bool, s: &Strip) -> Result<()> {
            for r in 0..s.height {
                let (src, dst) = (src + r * s.src_pitch, dst + r * s.dst_pitch);
                let mut done = 0;
                while done < s.width {
                    let n = (s.width - done).min(COPY_PIECE);
                    let (src, dst) = (src + done, dst + done);
                    if dst_host {
                        // SAFETY: the caller's promise (each row lies inside both).
                        unsafe { self.stream.copy_dtoh(dst as usize as *mut u8, src, n)? };
                    } else {
                        // SAFETY: as above.
                        unsafe { self.stream.copy_dtod(dst, src, n)? };
                    }
                    done += n;
                }
            }
            Ok(())
        }

        /// Enqueues a copy of `bytes` (host memory) to device address `dst`; `bytes` may be
        /// dropped once this returns (the driver stages pageable memory before returning).
        ///
        /// # Safety
        /// `dst` must be valid device memory for `bytes.len()` bytes until the copy lands.
        ///
        /// # Errors
        /// [`crate::Error::Device`] from the driver.
        pub unsafe fn bytes(&self, dst: u64, bytes: &[u8]) -> Result<()> {
            // SAFETY: the caller's promise; `bytes` is valid for the call, and pageable memory
            // is staged by the driver before it returns.
            unsafe {
                self.stream
                    .copy_htod(dst, bytes.as_ptr(), bytes.len() as u64)
            }
        }

        /// Marks how far the stream's copies have been enqueued.
        ///
        /// # Errors
        /// [`crate::Error::Device`] from the driver.
        pub fn mark(&self) -> Result<Landing> {
            let e = Event::new_blocking(self.stream.context())?;
            e.record(&self.stream)?;
            Ok(Landing(e))
        }

        /// Waits until every copy enqueued so far has finished (before the objects they
        /// write are given up).
        ///
        /// # Errors
        /// [`crate::Error::Device`] when one failed.
        pub fn synchronize(&self) -> Result<()> {
            self.stream.synchronize()
        }
    }

    /// [`copy_requests`](super::copy_requests) from a cache in device memory, on `copies`' stream:
    /// 1. each request is checked and planned, and its token ids written now into a host arena
    ///    (`dst_host`) or enqueued to a device one: before the wait below, as a copy from
    ///    pageable memory first waits for the stream's earlier work (after the rows of earlier
    ///    requests, each would wait for them);
    /// 2. the stream waits for `after`, a raw event recorded where the cache was written (0: none);
    /// 3. each request's rows are enqueued, and a mark after them;
    /// 4. each mark is waited for in order, and its request's write finished
    ///    (`finished(i, landed)`) as soon as it has landed.
    ///
    /// A request that fails before its copies fails first; one whose copies could not all be
    /// enqueued, once the stream has drained (nothing lands in its space after it is given back).
    /// Each destination is checked against `reserved` (the writer's [`ReservedObjects`]) where
    /// given, all a device arena has (its stamp words are device memory), and a request it
    /// vouched for fails by its objects' names, not its keys. [`DeviceStep`] does the same a
    /// request at a time.
    ///
    /// # Safety
    /// The cache's range must stay valid device memory until this returns; `arena` is this
    /// process's mapping of the sink's arena (host memory when `dst_host`, else device memory),
    /// whose reserved objects nothing else writes; `after` a valid event or 0.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_requests_device(
        copies: &DeviceCopies,
        after: u64,
        src: &Paged,
        arena: (u64, u64),
        dst_host: bool,
        reserved: Option<&ReservedObjects>,
        requests: Vec<Request>,
        finished: impl FnMut(usize, Landed),
    ) -> Vec<Option<String>> {
        let mut step = DeviceStep::new(copies, src, arena, dst_host, reserved);
        for r in requests {
            // SAFETY: the caller's promise, which run's below extends to.
            unsafe { step.add(r) };
        }
        // SAFETY: the caller's promise.
        unsafe { step.run(after, finished) }
    }

    /// A step of [`copy_requests_device`] built a request at a time: [`DeviceStep::add`] is
    /// its step 1 for one request, [`DeviceStep::run`] steps 2 to 4. A caller from Python reads
    /// each request's token ids with the GIL and adds the request without it, so that it never
    /// holds the GIL for more than one request's ids.
    pub struct DeviceStep<'a> {
        copies: &'a DeviceCopies,
        src: &'a Paged,
        arena: (u64, u64),
        dst_host: bool,
        reserved: Option<&'a ReservedObjects>,
        /// Requests added (or refused) so far: the next one's index.
        added: usize,
        /// Each request planned, its ids on their way.
        planned: Vec<Planned>,
        /// `(index, what it fails, why)` of each request that failed before its copies.
        failed: Vec<(usize, Landed, String)>,
    }

    /// A request of a [`DeviceStep`] planned: its index, the objects it writes, what it fails
    /// if it fails ([`Request::failure`]) and its rows' strips.
    struct Planned {
        i: usize,
        written: [Written; 2],
        failure: Landed,
        strips: Vec<Strip>,
    }

    impl<'a> DeviceStep<'a> {
        /// A step with no request yet, into `arena` (host memory when `dst_host`; a device
        /// arena's destinations are checked against `reserved`, the writer's table, if given).
        pub fn new(
            copies: &'a DeviceCopies,
            src: &'a Paged,
            arena: (u64, u64),
            dst_host: bool,
            reserved: Option<&'a ReservedObjects>,
        ) -> DeviceStep<'a> {
            DeviceStep {
                copies,
                src,
                arena,
                dst_host,
                reserved,
                added: 0,
                planned: Vec::new(),
                failed: Vec::new(),
            }
        }

        /// The next request: checked and planned, its token ids written into a host arena or
        /// enqueued to a device one.
        ///
        /// # Safety
        /// As [`copy_requests_device`]'s, from now until [`DeviceStep::run`] returns (which
        /// must be called: it waits for what this enqueued).
        pub unsafe fn add(&mut self, r: Request) {
            let i = self.added;
            self.added += 1;
            let checked = r.plan(self.src, self.arena, self.dst_host, self.reserved);
            let ids = checked.and_then(|strips| {
                // SAFETY: the destination lies in the arena (checked above), which the caller
                // vouched for; a host arena is this process's own mapping.
                unsafe {
                    if self.dst_host {
                        r.write_ids();
                    } else {
                        let ids: Vec<u8> = r.ids.iter().flat_map(|x| x.to_ne_bytes()).collect();
                        // Nothing of it is enqueued if this fails.
                        self.copies
                            .bytes(r.ids_dst, &ids)
                            .map_err(|e| e.to_string())?;
                    }
                }
                Ok(strips)
            });
            match ids {
                Ok(strips) => {
                    let written = r.written();
                    // Planned against the table, where given: it vouched for the names.
                    let failure = match self.reserved {
                        Some(_) => Landed::Failed(written),
                        None => Landed::FailedKeys(r.keys, vec![r.ids_stamp, r.rows_stamp]),
                    };
                    self.planned.push(Planned {
                        i,
                        written,
                        failure,
                        strips,
                    });
                }
                Err(why) => self.failed.push((i, r.failure(self.reserved), why)),
            }
        }

        /// The next request failed before it could be added (its objects' keys, and why).
        pub fn refuse(&mut self, keys: Vec<String>, why: String) {
            self.failed
                .push((self.added, Landed::FailedKeys(keys, Vec::new()), why));
            self.added += 1;
        }

        /// Steps 2 to 4 of [`copy_requests_device`] for the requests added so far (the step is
        /// empty after): `finished(i, landed)` for each (those that failed before their copies
        /// first), and per request `None` or why it was not copied.
        ///
        /// # Safety
        /// As [`DeviceStep::add`]'s; `after` a valid event or 0.
        pub unsafe fn run(
            &mut self,
            after: u64,
            mut finished: impl FnMut(usize, Landed),
        ) -> Vec<Option<String>> {
            let (copies, src, dst_host) = (self.copies, self.src, self.dst_host);
            let added = std::mem::take(&mut self.added);
            let planned = std::mem::take(&mut self.planned);
            let failed = std::mem::take(&mut self.failed);
            let mut out: Vec<Option<String>> = vec![None; added];
            // Request i's write is over: landed, or failed (with why).
            let mut land = |i: usize, landed: Landed, why: Option<String>| {
                if let Some(why) = why {
                    out[i] = Some(format!("copying cache rows: {why}"));
                }
                finished(i, landed);
            };
            for (i, failure, why) in failed {
                land(i, failure, Some(why));
            }
            let waited = if after == 0 {
                Ok(())
            } else {
                // SAFETY: the caller's promise (a valid event).
                unsafe { copies.after(after) }
            };
            if let Err(e) = waited {
                let _ = copies.synchronize(); // their token ids may be on their way
                for p in planned {
                    land(p.i, p.failure, Some(e.to_string()));
                }
                return out;
            }
            let mut landing: Vec<(Planned, Landing)> = Vec::with_capacity(planned.len());
            for p in planned {
                // SAFETY: the rows lie in the cache and the object (the plan), the object in the
                // arena (checked when added); the caller vouched for both ranges.
                let marked = unsafe { copies.rows(src.base, p.written[1].at, dst_host, &p.strips) }
                    .and_then(|()| copies.mark());
                match marked {
                    Ok(mark) => landing.push((p, mark)),
                    Err(e) => {
                        // Some of its copies may be enqueued: they land before its space goes back.
                        let _ = copies.synchronize();
                        land(p.i, p.failure, Some(e.to_string()));
                    }
                }
            }
            for (p, mark) in landing {
                match mark.wait() {
                    Ok(()) => land(p.i, Landed::Written(p.written), None),
                    Err(e) => land(p.i, p.failure, Some(e.to_string())),
                }
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of distinct bytes, `blocks x k x bs x row` in memory order `order` (`true`:
    /// `[blocks, bs, k, row]`, slots outermost in a block; `false`: `[blocks, k, bs, row]`).
    fn cache(blocks: u64, k: u64, bs: u64, row: u64, slot_major: bool) -> (Vec<u8>, Paged) {
        let len = blocks * k * bs * row;
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let strides = if slot_major {
            (k * bs * row, row, k * row)
        } else {
            (k * bs * row, bs * row, row)
        };
        let src = Paged {
            base: bytes.as_ptr() as u64,
            len,
            blocks,
            strides,
            block_size: bs,
            k,
            row_bytes: row,
        };
        (bytes, src)
    }

    /// The object `[n, k, row]` as a row-by-row reading of the cache would make it.
    fn expected(bytes: &[u8], src: &Paged, blocks: &[u64], n: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..n {
            let b = blocks[(i / src.block_size) as usize];
            for l in 0..src.k {
                let at = (b * src.strides.0
                    + l * src.strides.1
                    + (i % src.block_size) * src.strides.2) as usize;
                out.extend_from_slice(&bytes[at..at + src.row_bytes as usize]);
            }
        }
        out
    }

    fn copied(src: &Paged, blocks: &[u64], n: u64) -> (Vec<u8>, Vec<Strip>) {
        let len = n * src.k * src.row_bytes;
        let strips = src.plan(len, blocks, n).unwrap();
        let mut obj = vec![0u8; len as usize];
        // SAFETY: the plan is checked against both lengths; both buffers live for the call.
        unsafe { copy_host(src.base, obj.as_mut_ptr() as u64, &strips) };
        (obj, strips)
    }

    #[test]
    fn every_row_lands_where_the_object_wants_it_in_both_of_vllms_layouts() {
        for (slot_major, k) in [(false, 3), (true, 3), (false, 1)] {
            let (bytes, src) = cache(6, k, 4, 8, slot_major);
            for (blocks, n) in [(vec![2u64, 0, 5], 10u64), (vec![1, 2, 3], 12), (vec![4], 1)] {
                let (obj, _) = copied(&src, &blocks, n);
                assert_eq!(
                    obj,
                    expected(&bytes, &src, &blocks, n),
                    "slot-major {slot_major}, k {k}, blocks {blocks:?}, n {n}"
                );
            }
        }
    }

    #[test]
    fn strips_are_as_few_as_the_layout_allows() {
        // [blocks, k, bs, row]: one strip per block and layer.
        let (_b, src) = cache(6, 3, 4, 8, false);
        let (_, strips) = copied(&src, &[2, 0, 5], 10);
        assert_eq!(strips.len(), 9);
        assert!(strips
            .iter()
            .all(|s| s.width == 8 && s.dst_pitch == 24 && s.src_pitch == 8));
        // [blocks, bs, k, row]: a block's rows are one run, and blocks next to one another in
        // memory one run together (blocks 1, 2, 3: the whole request in one copy).
        let (_b, src) = cache(6, 3, 4, 8, true);
        let (_, strips) = copied(&src, &[2, 0, 5], 10);
        assert_eq!(strips.len(), 3);
        let (_, strips) = copied(&src, &[1, 2, 3], 12);
        assert_eq!(
            strips,
            [Strip {
                src: 96,
                src_pitch: 288,
                dst: 0,
                dst_pitch: 288,
                width: 288,
                height: 1
            }]
        );
    }

    #[test]
    fn rows_that_do_not_fill_the_object_or_lie_outside_the_cache_are_refused() {
        let (_b, src) = cache(2, 2, 4, 8, false);
        assert!(src
            .plan(2 * 2 * 8 + 1, &[0], 2)
            .unwrap_err()
            .contains("do not fill"));
        assert!(src
            .plan(5 * 2 * 8, &[0], 5)
            .unwrap_err()
            .contains("need more than 1 blocks of 4"));
        assert!(src
            .plan(6 * 2 * 8, &[1, 9], 6)
            .unwrap_err()
            .contains("block 9 is not in the cache, which has 2 blocks"));
        assert!(src
            .plan(2 * 2 * 8, &[u64::MAX], 2)
            .unwrap_err()
            .contains("not in the cache"));
        // A block id below the count whose rows still lie past the bytes given (a cache
        // described with fewer bytes than its blocks span).
        let short = Paged { len: 100, ..src };
        assert!(short
            .plan(6 * 2 * 8, &[0, 1], 6)
            .unwrap_err()
            .contains("(block 1) lie outside the cache (100 bytes"));
        // Descriptions nothing can be copied from.
        for bad in [
            Paged { base: 0, ..src },
            Paged {
                base: u64::MAX - 8,
                ..src
            },
            Paged { k: 0, ..src },
            Paged {
                row_bytes: 0,
                ..src
            },
            Paged {
                block_size: 0,
                ..src
            },
        ] {
            assert!(bad
                .plan(0, &[0], 0)
                .unwrap_err()
                .contains("the cache is not one to copy from"));
        }
    }

    #[test]
    fn overlapping_source_rows_are_copied_one_by_one() {
        // A slot stride of 0 (every slot the same row): a 2-D copy refuses a pitch below its
        // width, so each row is a strip of its own.
        let bytes: Vec<u8> = (0..64u8).collect();
        let src = Paged {
            base: bytes.as_ptr() as u64,
            len: 64,
            blocks: 2,
            strides: (32, 16, 0),
            block_size: 4,
            k: 2,
            row_bytes: 16,
        };
        let (obj, strips) = copied(&src, &[1], 3);
        assert!(strips.iter().all(|s| s.height == 1));
        assert_eq!(
            obj,
            [&bytes[32..64], &bytes[32..64], &bytes[32..64]].concat()
        );
    }

    #[test]
    fn each_request_is_copied_and_finished_in_order_and_a_bad_one_costs_only_itself() {
        let (k, bs, row) = (2u64, 4u64, 8u64);
        let (bytes, src) = cache(4, k, bs, row, false);
        let mut words = vec![0u64; 512]; // the arena: 4096 bytes, its stamp words aligned
        let base = words.as_mut_ptr() as u64;
        let n = 6u64; // blocks [2, 0]: rows 0..4 from block 2, 4..6 from block 0
        let rows_len = n * k * row;
        // Each request's two objects reserved as the writer does: stamp words pending.
        for (i, at) in [0u64, 1024, 2048, 3072].into_iter().enumerate() {
            let stamp = 10 + i as u64;
            words[(at + n * 8) as usize / 8] = stamp | PENDING_BIT;
            words[(at + 64 + rows_len) as usize / 8] = stamp | PENDING_BIT;
        }
        let good = |at: u64, keys: &str| Request {
            keys: vec![keys.into()],
            ids_dst: base + at,
            ids_stamp: 10 + at / 1024,
            ids: (0..n as i64).map(|i| 100 + i).collect(),
            rows_dst: base + at + 64,
            rows_stamp: 10 + at / 1024,
            rows_len,
            block_ids: vec![2, 0],
        };
        let mut outside = good(1024, "outside");
        outside.rows_dst = base + 4096 - 8; // past the arena's end
        let mut beyond = good(2048, "beyond");
        beyond.block_ids = vec![2, 9]; // block 9 is not in the cache
        let (written_a, written_b) = (good(0, "a").written(), good(3072, "b").written());
        let requests = vec![good(0, "a"), outside, beyond, good(3072, "b")];
        let mut finished = Vec::new();
        // SAFETY: both buffers live until the call returns and do not overlap.
        let why = unsafe {
            copy_requests(&src, (base, 4096), None, requests, |i, landed| {
                finished.push((i, landed))
            })
        };
        let arena: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        // A copied request names the objects it wrote (their stamps and where), a failed one
        // the keys it was given.
        assert_eq!(
            finished,
            [
                (0, Landed::Written(written_a)),
                (1, Landed::FailedKeys(vec!["outside".into()], vec![11, 11])),
                (2, Landed::FailedKeys(vec!["beyond".into()], vec![12, 12])),
                (3, Landed::Written(written_b))
            ]
        );
        assert_eq!(
            written_a,
            [
                Written {
                    stamp: 10,
                    at: base,
                    len: n * 8
                },
                Written {
                    stamp: 10,
                    at: base + 64,
                    len: rows_len
                }
            ]
        );
        assert!(why[0].is_none() && why[3].is_none());
        assert!(
            why[1]
                .as_deref()
                .unwrap()
                .contains("not in this sink's arena"),
            "{why:?}"
        );
        assert!(
            why[2]
                .as_deref()
                .unwrap()
                .contains("block 9 is not in the cache, which has 4 blocks"),
            "{why:?}"
        );
        for at in [0usize, 3072] {
            let ids: Vec<i64> = arena[at..at + 48]
                .chunks(8)
                .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(ids, (100..106).collect::<Vec<i64>>());
            for i in 0..n {
                let block = [2u64, 0][(i / bs) as usize];
                for layer in 0..k {
                    let from = (block * k * bs * row + layer * bs * row + (i % bs) * row) as usize;
                    let to = at + 64 + ((i * k + layer) * row) as usize;
                    assert_eq!(
                        arena[to..to + row as usize],
                        bytes[from..from + row as usize],
                        "row {i} layer {layer}"
                    );
                }
            }
        }
        let untouched = |at: usize| {
            let stamps = [at + 48, at + 64 + rows_len as usize];
            (at..at + 1024)
                .filter(|i| !stamps.iter().any(|s| (*s..*s + 8).contains(i)))
                .all(|i| arena[i] == 0)
        };
        assert!(untouched(1024) && untouched(2048));
    }

    #[test]
    fn a_destination_that_is_not_the_requests_own_reservation_is_refused_before_any_byte() {
        // The caller's addresses and stamps are checked against the stamp words the writer set
        // when it placed the reservations: another request's object, one whose write is
        // finished, a stamp not the reservation's, or a length that does not end at its stamp
        // word each fail the request alone, and nothing of it is written.
        let (k, bs, row) = (2u64, 4u64, 8u64);
        let (_, src) = cache(4, k, bs, row, false);
        let mut words = vec![0u64; 512];
        let base = words.as_mut_ptr() as u64;
        let n = 4u64;
        let rows_len = n * k * row; // 64 bytes
                                    // Objects at 0 (stamp 7) and 512 (stamp 8), pending; at 1024 (stamp 9), finished.
        for (at, word) in [(0u64, 7 | PENDING_BIT), (512, 8 | PENDING_BIT), (1024, 9)] {
            words[(at + n * 8) as usize / 8] = word;
            words[(at + 64 + rows_len) as usize / 8] = word;
        }
        let at = |at: u64, stamp: u64| Request {
            keys: vec![format!("{at}")],
            ids_dst: base + at,
            ids_stamp: stamp,
            ids: (0..n as i64).collect(),
            rows_dst: base + at + 64,
            rows_stamp: stamp,
            rows_len,
            block_ids: vec![1],
        };
        let mut other_rows = at(0, 7);
        other_rows.rows_dst = base + 512 + 64; // the other request's rows object
        let mut short = at(0, 7);
        short.rows_len -= k * row; // one row fewer: neither object ends at its stamp word
        short.ids.pop();
        let requests = vec![
            at(512, 7),  // another reservation's objects, this request's stamp
            other_rows,  // its ids right, its rows another's
            at(1024, 9), // finished already
            at(0, 8),    // a stamp that is not this reservation's
            short,       // sizes that do not end at the stamp words
            at(0, 7),    // its own
        ];
        let mut finished = Vec::new();
        // SAFETY: both buffers live until the call returns and do not overlap.
        let why = unsafe {
            copy_requests(&src, (base, 4096), None, requests, |i, landed| {
                finished.push((i, matches!(landed, Landed::Written(_))))
            })
        };
        assert_eq!(
            finished,
            [
                (0, false),
                (1, false),
                (2, false),
                (3, false),
                (4, false),
                (5, true)
            ],
            "{why:?}"
        );
        for w in &why[..5] {
            assert!(
                w.as_deref()
                    .unwrap()
                    .contains("not the object reserved with stamp")
                    || w.as_deref().unwrap().contains("has no aligned stamp word"),
                "{why:?}"
            );
        }
        assert!(
            why[3].as_deref().unwrap().contains("stamp 8"),
            "{:?}",
            why[3]
        );
        // Only request 5's bytes were written: objects 512 and 1024 hold nothing but their words.
        let arena: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        for at in [512usize, 1024] {
            let stamps = [at + 32, at + 64 + rows_len as usize];
            assert!((at..at + 512)
                .filter(|i| !stamps.iter().any(|s| (*s..*s + 8).contains(i)))
                .all(|i| arena[i] == 0));
        }
        assert_ne!(arena[64..64 + rows_len as usize], [0u8; 64]);
    }

    #[test]
    fn a_cache_that_overlaps_the_arena_copies_nothing() {
        // An arena never lies in a cache (the copy's memcpy assumes it): described so, every
        // request fails before any byte is written.
        let (k, bs, row) = (2u64, 4u64, 8u64);
        let (mut bytes, src) = cache(4, k, bs, row, false);
        let before = bytes.clone();
        let base = bytes.as_mut_ptr() as u64;
        // The cache is 256 bytes; the "arena" its second half and past it, the request's
        // destinations in the cache's own bytes (were they written, `bytes` would change).
        let request = Request {
            keys: vec!["a".into()],
            ids_dst: base + 128,
            ids_stamp: 1,
            ids: vec![1, 2],
            rows_dst: base + 160,
            rows_stamp: 1,
            rows_len: 2 * k * row,
            block_ids: vec![0],
        };
        let mut finished = Vec::new();
        // SAFETY: every destination lies in `bytes`, which lives for the call.
        let why = unsafe {
            copy_requests(&src, (base + 128, 256), None, vec![request], |i, landed| {
                finished.push((i, matches!(landed, Landed::Written(_))))
            })
        };
        assert_eq!(finished, [(0, false)]);
        assert!(why[0].as_deref().unwrap().contains("overlap"), "{why:?}");
        assert_eq!(bytes, before);
    }
}
