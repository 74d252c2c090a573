//! MLX's allocator: memory in use, peak, cache, and the limits that bound them.
//!
//! These numbers are process-wide (shared by all threads).

use crate::lock::locked;
use crate::Result;
use rmlx_sys::ffi;

/// Bytes held by live arrays (not counting the cache).
pub fn active_memory() -> usize {
    ffi::get_active_memory()
}

/// Highest [`active_memory`] since the start or the last [`reset_peak_memory`].
pub fn peak_memory() -> usize {
    ffi::get_peak_memory()
}

/// Starts peak tracking afresh.
pub fn reset_peak_memory() {
    locked(ffi::reset_peak_memory)
}

/// Bytes kept in the allocator's cache for reuse.
pub fn cache_memory() -> usize {
    ffi::get_cache_memory()
}

/// Sets the memory limit that evaluation tries to stay under; returns the previous one.
pub fn set_memory_limit(bytes: usize) -> Result<usize> {
    Ok(locked(|| ffi::set_memory_limit(bytes))?)
}

/// The current memory limit.
pub fn memory_limit() -> usize {
    ffi::get_memory_limit()
}

/// Sets how much freed memory the cache may keep (0 disables caching); returns the previous limit.
pub fn set_cache_limit(bytes: usize) -> Result<usize> {
    Ok(locked(|| ffi::set_cache_limit(bytes))?)
}

/// Sets the wired (resident) memory limit; returns the previous one. Only Metal on macOS 15+ acts
/// on it; elsewhere it is accepted and has no effect.
pub fn set_wired_limit(bytes: usize) -> Result<usize> {
    Ok(locked(|| ffi::set_wired_limit(bytes))?)
}

/// Returns the cached memory to the system.
pub fn clear_cache() {
    locked(ffi::clear_cache)
}
