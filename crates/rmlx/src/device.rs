//! Devices and streams: where operations run.
//!
//! Every op runs on a stream. By default that is rmlx's stream for MLX's default device (the GPU when
//! one is present, else the CPU): one stream per device, shared by all threads. [`with_device`] and [`with_stream`] redirect the ops that the
//! current thread builds inside a closure; [`set_default_device`] changes the process-wide default.
//!
//! ```
//! use rmlx::{Array, Device};
//! let y = rmlx::with_device(Device::cpu(), || Array::from_slice(&[1.0f32, 2.0], &[2])?.exp())?;
//! assert_eq!(y.shape(), &[2]);
//! # Ok::<(), rmlx::Error>(())
//! ```

use crate::lock::{evaluating, locked};
use crate::{Error, Result};
use rmlx_sys::ffi::{self, StreamSpec};
use std::cell::Cell;

/// CPU or GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceType {
    Cpu,
    Gpu,
}

/// A device: its type and index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    pub kind: DeviceType,
    pub index: i32,
}

impl Device {
    /// The CPU.
    pub fn cpu() -> Device {
        Device { kind: DeviceType::Cpu, index: 0 }
    }
    /// The first GPU (CUDA or Metal, whichever MLX was built for).
    pub fn gpu() -> Device {
        Device { kind: DeviceType::Gpu, index: 0 }
    }
    fn code(self) -> u8 {
        match self.kind {
            DeviceType::Cpu => 0,
            DeviceType::Gpu => 1,
        }
    }
    /// Whether MLX can run ops on this device in this process.
    pub fn is_available(self) -> bool {
        ffi::is_available(self.code(), self.index)
    }
    /// Number of devices of a type.
    pub fn count(kind: DeviceType) -> usize {
        ffi::device_count(if kind == DeviceType::Cpu { 0 } else { 1 }).max(0) as usize
    }
    /// Properties the backend reports (`device_name`, `architecture`, memory sizes, …).
    pub fn info(self) -> Result<Vec<(String, String)>> {
        let flat = locked(|| ffi::device_info(self.code(), self.index))?;
        Ok(flat.chunks(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect())
    }
    /// The stream rmlx uses for this device by default (one per device, shared by all threads).
    pub fn default_stream(self) -> Result<Stream> {
        Ok(Stream(locked(|| ffi::default_stream(self.code(), self.index))?))
    }
    /// A new stream on this device, usable from any thread. Ops on different streams may run
    /// concurrently on the device.
    pub fn new_stream(self) -> Result<Stream> {
        Ok(Stream(locked(|| ffi::new_stream(self.code(), self.index))?))
    }
    fn from_spec(s: StreamSpec) -> Device {
        Device { kind: if s.device_type == 0 { DeviceType::Cpu } else { DeviceType::Gpu }, index: s.device_index }
    }
}

/// A stream of a device: a queue that ops are scheduled on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream(StreamSpec);

impl Stream {
    /// The device the stream belongs to.
    pub fn device(&self) -> Device {
        Device::from_spec(self.0)
    }
    /// Blocks until all work queued on this stream is done.
    pub fn synchronize(&self) -> Result<()> {
        Ok(evaluating(|| ffi::synchronize(self.0))?)
    }
}

const DEFAULT: StreamSpec = StreamSpec { kind: 0, device_type: 0, device_index: 0, stream_index: 0 };

thread_local! {
    static CURRENT: Cell<StreamSpec> = const { Cell::new(DEFAULT) };
}

/// Where the next op built on this thread runs.
pub(crate) fn current() -> StreamSpec {
    CURRENT.with(|c| c.get())
}

/// The device the next op built on this thread runs on: the one [`with_device`] or [`with_stream`]
/// chose for the enclosing scope, else the process's [`default_device`]. Code choosing between a
/// CPU and a GPU implementation asks this, so a caller can place work without changing the default
/// for every other thread.
///
/// ```
/// use rmlx::{current_device, with_device, Device, DeviceType};
/// assert_eq!(with_device(Device::cpu(), current_device).kind, DeviceType::Cpu);
/// ```
pub fn current_device() -> Device {
    let spec = current();
    if spec.kind == 0 {
        default_device()
    } else {
        Device::from_spec(spec)
    }
}

/// The spec of `device`'s default (shared) stream.
pub(crate) fn device_spec(device: Device) -> StreamSpec {
    StreamSpec { kind: 1, device_type: device.code(), device_index: device.index, stream_index: 0 }
}

pub(crate) fn with_stream_spec<T>(spec: StreamSpec, f: impl FnOnce() -> T) -> T {
    struct Restore(StreamSpec);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(spec)));
    f()
}

/// Runs `f` with every op built on this thread placed on `device`'s default stream.
pub fn with_device<T>(device: Device, f: impl FnOnce() -> T) -> T {
    with_stream_spec(device_spec(device), f)
}

/// Runs `f` with every op built on this thread placed on `stream`.
pub fn with_stream<T>(stream: Stream, f: impl FnOnce() -> T) -> T {
    with_stream_spec(stream.0, f)
}

/// MLX's default device for this process.
pub fn default_device() -> Device {
    Device::from_spec(ffi::default_device())
}

/// Changes MLX's default device for this process. Fails if the device is not available.
pub fn set_default_device(device: Device) -> Result<()> {
    if !device.is_available() {
        return Err(Error::InvalidArgument(format!("{device:?} is not available")));
    }
    Ok(locked(|| ffi::set_default_device(device.code(), device.index))?)
}

/// Blocks until all work queued on the default stream is done.
pub fn synchronize() -> Result<()> {
    Ok(evaluating(|| ffi::synchronize(DEFAULT))?)
}

/// The version of the MLX library in use, e.g. `"0.32.4"`.
pub fn mlx_version() -> String {
    ffi::mlx_version()
}
