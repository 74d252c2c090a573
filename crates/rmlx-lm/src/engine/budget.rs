//! How many bytes the running batch's keys and values may take when the user sets no bound:
//! derived from MLX's memory limit for the device (on a GPU the device's memory, on the CPU a
//! share of the machine's), less what the model already holds and the prompt cache may take.

/// Three quarters of what `limit` leaves after `in_use` and `reserved` bytes (the quarter is
/// headroom for a step's activations and MLX's buffer cache); 0 when nothing is left.
///
/// ```
/// use rmlx_lm::engine::kv_budget;
/// assert_eq!(kv_budget(80_000, 10_000, 2_000), 51_000);
/// assert_eq!(kv_budget(8_000, 7_000, 2_000), 0);
/// ```
pub fn kv_budget(limit: usize, in_use: usize, reserved: usize) -> usize {
    limit.saturating_sub(in_use.saturating_add(reserved)) / 4 * 3
}

/// [`kv_budget`] with MLX's memory limit, what the model's `weights` take (or what MLX has
/// allocated, if more) and `reserved` (the prompt cache's budget): the default of
/// [`super::EngineOptions::max_kv_bytes`] in `rmlx serve`.
pub fn device_kv_budget(weights: usize, reserved: usize) -> usize {
    kv_budget(rmlx::memory::memory_limit(), weights.max(rmlx::memory::active_memory()), reserved)
}
