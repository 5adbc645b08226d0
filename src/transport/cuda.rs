//! CUDA through `cudarc` with dynamic loading: the library builds and runs without CUDA, and a
//! CUDA region on a machine without a driver is a typed `ErrorKind::Cuda` error, never a panic.
//!
//! The system UCX is built without CUDA, so device memory moves through a pinned host bounce
//! buffer: device -> pinned host before a send, pinned host -> device after a receive.
use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::{sys, CudaContext, PinnedHostSlice};
use std::sync::Arc;

/// Whether the CUDA driver library can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { sys::is_culib_present() }
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::new(ErrorKind::Cuda, format!("{what}: {e:?}"))
}

/// Checks that `device` exists on a machine with a CUDA driver.
pub fn check_device(device: i32) -> Result<()> {
    if !driver_present() {
        return Err(Error::new(
            ErrorKind::Cuda,
            "CUDA region, but no CUDA driver (libcuda) is present",
        ));
    }
    let count = std::panic::catch_unwind(CudaContext::device_count)
        .map_err(|_| cuda_err("cuDeviceGetCount", "panicked"))?
        .map_err(|e| cuda_err("cuDeviceGetCount", e))?;
    if device < 0 || device >= count {
        return Err(Error::invalid(format!(
            "CUDA device {device} does not exist ({count} present)"
        )));
    }
    Ok(())
}

/// A pinned host buffer on one device's context, used to stage device memory.
pub struct Staging {
    ctx: Arc<CudaContext>,
    buf: PinnedHostSlice<u8>,
}

impl Staging {
    pub fn new(device: i32, len: usize) -> Result<Staging> {
        check_device(device)?;
        let ctx = CudaContext::new(device as usize).map_err(|e| cuda_err("cuCtxCreate", e))?;
        // SAFETY: the bytes are uninitialised until a copy fills them; they are only read after.
        let buf = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }
            .map_err(|e| cuda_err("cuMemHostAlloc", e))?;
        Ok(Staging { ctx, buf })
    }

    /// The pinned buffer, for UCX to send from or receive into.
    pub fn host_ptr(&mut self) -> Result<*mut u8> {
        self.buf
            .as_mut_ptr()
            .map_err(|e| cuda_err("pinned buffer", e))
    }

    /// The pinned buffer's bytes (what a send of staged device data reads).
    pub fn host_slice(&self, len: usize) -> Result<&[u8]> {
        let all = self
            .buf
            .as_slice()
            .map_err(|e| cuda_err("pinned buffer", e))?;
        all.get(..len)
            .ok_or_else(|| Error::new(ErrorKind::OutOfBounds, "staging buffer too small"))
    }

    /// Copies `len` bytes from device address `src` into the pinned buffer.
    pub fn from_device(&mut self, src: u64, len: usize) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        let dst = self
            .buf
            .as_mut_slice()
            .map_err(|e| cuda_err("pinned buffer", e))?;
        let dst = dst
            .get_mut(..len)
            .ok_or_else(|| Error::new(ErrorKind::OutOfBounds, "staging buffer too small"))?;
        // SAFETY: `src` is a device address inside a region registered by its owner for `len`
        // bytes (checked by the caller against the registry).
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, src) }
            .map_err(|e| cuda_err("cuMemcpyDtoH", e))
    }

    /// Copies `len` bytes from the pinned buffer to device address `dst`.
    pub fn to_device(&mut self, dst: u64, len: usize) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        let src = self
            .buf
            .as_slice()
            .map_err(|e| cuda_err("pinned buffer", e))?;
        let src = src
            .get(..len)
            .ok_or_else(|| Error::new(ErrorKind::OutOfBounds, "staging buffer too small"))?;
        // SAFETY: as in from_device, for the destination.
        unsafe { cudarc::driver::result::memcpy_htod_sync(dst, src) }
            .map_err(|e| cuda_err("cuMemcpyHtoD", e))
    }
}
