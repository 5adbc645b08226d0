//! CUDA through `cudarc` with dynamic loading: the library builds and runs without CUDA, and a
//! CUDA region on a machine without a driver is a typed `ErrorKind::Cuda` error, never a panic.
//!
//! Device memory moves through a pinned host bounce buffer: device -> pinned host before a send,
//! pinned host -> device after a receive (the system UCX is built without CUDA, and no UCX here
//! reports CUDA memory support: `DevicePath::Staged`). The pinned buffers come from a pool per
//! device, allocated on first use per size class and reused, instead of one allocation (and one
//! context creation) per buffer per request.
//!
//! Every call leaves the calling thread's current CUDA context as it found it: cudarc makes the
//! device's primary context current for its work, and `send_device` runs on the caller's thread.
use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::{sys, CudaContext, PinnedHostSlice};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Whether the CUDA driver library can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { sys::is_culib_present() }
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::new(ErrorKind::Cuda, format!("{what}: {e:?}"))
}

/// Runs CUDA work that may panic: with dynamic loading, cudarc resolves each driver symbol at
/// its first call and panics when the loaded `libcuda` lacks it (a stub, or a driver older
/// than the API cudarc was built for). That is a CUDA error like any other, not an unwind
/// through the engine (its lock held, posted receives never taken back) or the progress thread.
fn no_panic<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panicked".to_string());
        Err(cuda_err(what, why))
    })
}

/// Checks that `device` exists on a machine with a CUDA driver.
pub fn check_device(device: i32) -> Result<()> {
    if !driver_present() {
        return Err(Error::new(
            ErrorKind::Cuda,
            "CUDA region, but no CUDA driver (libcuda) is present",
        ));
    }
    let count = no_panic("cuDeviceGetCount", || {
        CudaContext::device_count().map_err(|e| cuda_err("cuDeviceGetCount", e))
    })?;
    if device < 0 || device >= count {
        return Err(Error::invalid(format!(
            "CUDA device {device} does not exist ({count} present)"
        )));
    }
    Ok(())
}

/// Smallest pinned buffer the pool hands out: size classes are powers of two from here.
const MIN_CLASS: usize = 64 << 10;
/// Pinned bytes a device's pool keeps for reuse; a buffer given back past this is freed.
const POOL_CAP: usize = 1 << 30;

/// A free list of buffers by size class (a power of two >= `MIN_CLASS`), bounded in bytes.
/// Its lock is held only to push or pop: allocation happens outside it, and copies never touch
/// it, so requests staging at the same time do not wait for each other's copies.
pub struct BufferPool<B> {
    free: Mutex<(Vec<(usize, B)>, usize)>,
    cap: usize,
}

impl<B> BufferPool<B> {
    pub fn new(cap: usize) -> Self {
        BufferPool {
            free: Mutex::new((Vec::new(), 0)),
            cap,
        }
    }

    /// The size class that holds `len` bytes: `InvalidArgument` past the largest class, half
    /// the address space (no power of two above it is an allocation size: `isize::MAX` bounds
    /// every allocation, and the next power of two of a larger `len` overflows).
    pub fn class(len: usize) -> Result<usize> {
        len.max(1)
            .checked_next_power_of_two()
            .filter(|c| *c <= isize::MAX as usize)
            .map(|c| c.max(MIN_CLASS))
            .ok_or_else(|| Error::invalid(format!("no staging buffer holds {len} bytes")))
    }

    /// A buffer of `len`'s class: a free one if there is one, else `alloc(class)` (called
    /// without the lock held). `InvalidArgument` for a `len` no class holds.
    pub fn take(&self, len: usize, alloc: impl FnOnce(usize) -> Result<B>) -> Result<(usize, B)> {
        let class = Self::class(len)?;
        {
            let mut free = self.free.lock();
            if let Some(i) = free.0.iter().position(|(c, _)| *c == class) {
                let (c, b) = free.0.swap_remove(i);
                free.1 -= c;
                return Ok((c, b));
            }
        }
        Ok((class, alloc(class)?))
    }

    /// Gives a buffer back. Returns it when the pool is full, for the caller to free (outside
    /// the lock: freeing pinned memory synchronizes).
    pub fn give(&self, class: usize, b: B) -> Option<B> {
        let mut free = self.free.lock();
        if free.1 + class > self.cap {
            return Some(b);
        }
        free.1 += class;
        free.0.push((class, b));
        None
    }

    /// Buffers and bytes kept for reuse.
    pub fn cached(&self) -> (usize, usize) {
        let free = self.free.lock();
        (free.0.len(), free.1)
    }
}

/// One device's context and its pool of pinned buffers, made on first use and kept.
struct DevicePool {
    ctx: Arc<CudaContext>,
    pool: BufferPool<PinnedHostSlice<u8>>,
}

/// The calling thread's current CUDA context, made current again when this is dropped. cudarc
/// makes a device's context current before its calls (`bind_to_thread`: `cuCtxSetCurrent`) and
/// leaves it so; staging runs on the caller's threads (`send_device`), where the current context
/// (another device's, or one of the caller's own) decides where the caller's next CUDA runtime
/// call goes. Made only once the driver is loaded and initialised (a device was checked): before
/// `cuInit` nothing is current, and there is nothing to put back.
struct KeepCurrent(Option<sys::CUcontext>);

impl KeepCurrent {
    fn new() -> Self {
        // A driver without `cuCtxGetCurrent` panics (see `no_panic`): then nothing is put back.
        let current =
            std::panic::catch_unwind(cudarc::driver::result::ctx::get_current).unwrap_or(Ok(None));
        KeepCurrent(current.ok().map(|c| c.unwrap_or(std::ptr::null_mut())))
    }
}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        if let Some(ctx) = self.0 {
            // SAFETY: `ctx` was current on this thread when this was made (or is null: none
            // was), and nothing in between destroys a context.
            let _ = std::panic::catch_unwind(|| unsafe {
                cudarc::driver::result::ctx::set_current(ctx)
            });
        }
    }
}

fn pools() -> &'static Mutex<HashMap<i32, Arc<DevicePool>>> {
    static POOLS: OnceLock<Mutex<HashMap<i32, Arc<DevicePool>>>> = OnceLock::new();
    POOLS.get_or_init(|| Mutex::new(HashMap::new()))
}

fn device_pool(device: i32) -> Result<Arc<DevicePool>> {
    let pools = pools();
    if let Some(p) = pools.lock().get(&device) {
        return Ok(p.clone());
    }
    check_device(device)?;
    let ctx = no_panic("cuCtxCreate", || {
        let _keep = KeepCurrent::new();
        CudaContext::new(device as usize).map_err(|e| cuda_err("cuCtxCreate", e))
    })?;
    let made = Arc::new(DevicePool {
        ctx,
        pool: BufferPool::new(POOL_CAP),
    });
    Ok(pools.lock().entry(device).or_insert(made).clone())
}

/// A pinned host buffer on one device's context, used to stage device memory. It comes from
/// that device's pool (allocated once per size class and reused, not per request) and goes back
/// to it when dropped.
pub struct Staging {
    pool: Arc<DevicePool>,
    class: usize,
    buf: Option<PinnedHostSlice<u8>>,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            // Over the pool's cap it comes back and is freed here, outside the pool's lock.
            if let Some(b) = self.pool.pool.give(self.class, b) {
                // Never a panic out of a drop (an abort while unwinding).
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let _keep = KeepCurrent::new();
                    drop(b);
                }));
            }
        }
    }
}

impl Staging {
    /// A buffer of at least `len` bytes on `device`: `InvalidArgument` for a `len` no buffer
    /// can have (checked first: a bad size is the caller's, whatever the device).
    pub fn new(device: i32, len: usize) -> Result<Staging> {
        BufferPool::<PinnedHostSlice<u8>>::class(len)?;
        let pool = device_pool(device)?;
        let ctx = pool.ctx.clone();
        let (class, buf) = pool.pool.take(len, |class| {
            no_panic("cuMemHostAlloc", || {
                let _keep = KeepCurrent::new();
                // SAFETY: the bytes are uninitialised until a copy fills them; they are only
                // read after.
                unsafe { ctx.alloc_pinned_with_flags::<u8>(class, 0) }
                    .map_err(|e| cuda_err("cuMemHostAlloc", e))
            })
        })?;
        Ok(Staging {
            pool,
            class,
            buf: Some(buf),
        })
    }

    fn buf(&self) -> Result<&PinnedHostSlice<u8>> {
        self.buf
            .as_ref()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "staging buffer already returned"))
    }

    fn buf_mut(&mut self) -> Result<&mut PinnedHostSlice<u8>> {
        self.buf
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "staging buffer already returned"))
    }

    /// The pinned buffer, for UCX to send from or receive into.
    pub fn host_ptr(&mut self) -> Result<*mut u8> {
        let buf = self.buf_mut()?;
        no_panic("pinned buffer", || {
            let _keep = KeepCurrent::new();
            buf.as_mut_ptr().map_err(|e| cuda_err("pinned buffer", e))
        })
    }

    /// The pinned buffer's bytes (what a send of staged device data reads).
    pub fn host_slice(&self, len: usize) -> Result<&[u8]> {
        let buf = self.buf()?;
        let all = no_panic("pinned buffer", || {
            let _keep = KeepCurrent::new();
            buf.as_slice().map_err(|e| cuda_err("pinned buffer", e))
        })?;
        all.get(..len)
            .ok_or_else(|| Error::new(ErrorKind::OutOfBounds, "staging buffer too small"))
    }

    /// Copies `len` bytes from device address `src` into the pinned buffer.
    pub fn from_device(&mut self, src: u64, len: usize) -> Result<()> {
        no_panic("cuMemcpyDtoH", || self.copy_from_device(src, len))
    }

    fn copy_from_device(&mut self, src: u64, len: usize) -> Result<()> {
        let _keep = KeepCurrent::new();
        self.pool
            .ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind", e))?;
        let dst = self
            .buf_mut()?
            .as_mut_slice()
            .map_err(|e| cuda_err("pinned buffer", e))?;
        let dst = dst
            .get_mut(..len)
            .ok_or_else(|| Error::new(ErrorKind::OutOfBounds, "staging buffer too small"))?;
        // SAFETY: `dst` is host memory of ours, `len` bytes long (checked above). `src` is the
        // caller's device address, not checked here against anything: the driver reads device
        // memory only, and an address it does not know for `len` bytes is an error it returns
        // (`CUDA_ERROR_INVALID_VALUE`), never a host access.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, src) }
            .map_err(|e| cuda_err("cuMemcpyDtoH", e))
    }

    /// Copies `len` bytes from the pinned buffer to device address `dst`.
    pub fn to_device(&mut self, dst: u64, len: usize) -> Result<()> {
        no_panic("cuMemcpyHtoD", || self.copy_to_device(dst, len))
    }

    fn copy_to_device(&mut self, dst: u64, len: usize) -> Result<()> {
        let _keep = KeepCurrent::new();
        self.pool
            .ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind", e))?;
        let src = self
            .buf()?
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

/// Buffers and bytes `device`'s staging pool keeps for reuse (0 before its first use).
pub fn staging_cached(device: i32) -> (usize, usize) {
    let pool = pools().lock().get(&device).cloned();
    pool.map_or((0, 0), |p| p.pool.cached())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn buffers_are_reused_by_size_class_and_bounded() {
        let pool: BufferPool<Vec<u8>> = BufferPool::new(4 << 20);
        let allocs = AtomicUsize::new(0);
        let alloc = |c: usize| {
            allocs.fetch_add(1, Ordering::Relaxed);
            Ok(vec![0u8; c])
        };
        let (c1, b1) = pool.take(1000, alloc).unwrap();
        assert_eq!(c1, MIN_CLASS);
        assert_eq!(b1.len(), MIN_CLASS);
        assert!(pool.give(c1, b1).is_none());
        // The same class again: the buffer comes back, nothing is allocated.
        let (c2, b2) = pool.take(MIN_CLASS, alloc).unwrap();
        assert_eq!((c2, allocs.load(Ordering::Relaxed)), (MIN_CLASS, 1));
        // Another class: a new allocation of the next power of two.
        let (c3, b3) = pool.take((1 << 20) + 1, alloc).unwrap();
        assert_eq!((c3, allocs.load(Ordering::Relaxed)), (2 << 20, 2));
        assert!(pool.give(c2, b2).is_none());
        assert!(pool.give(c3, b3).is_none());
        assert_eq!(pool.cached(), (2, MIN_CLASS + (2 << 20)));
        // Past the cap a buffer is handed back to be freed, not kept.
        let (c4, b4) = pool.take(3 << 20, alloc).unwrap();
        assert_eq!(c4, 4 << 20);
        assert!(pool.give(c4, b4).is_some());
        assert_eq!(pool.cached(), (2, MIN_CLASS + (2 << 20)));
        // A failed allocation is an error and leaves the pool as it was.
        let e = pool
            .take(8 << 20, |_| Err(Error::new(ErrorKind::Cuda, "no memory")))
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Cuda);
        assert_eq!(pool.cached(), (2, MIN_CLASS + (2 << 20)));
    }

    #[test]
    fn a_length_no_class_holds_is_refused_not_wrapped() {
        // Past half the address space the next power of two overflows (a panic in a debug
        // build, 0 in a release build: a 64 KiB buffer for a receive posted at `len` bytes), and
        // 2^63 itself is past `isize::MAX`, which cudarc's pinned allocation asserts against.
        let pool: BufferPool<Vec<u8>> = BufferPool::new(1 << 30);
        for len in [(1usize << 62) + 1, 1 << 63, (1 << 63) + 1, usize::MAX] {
            let e = pool
                .take(len, |c| panic!("allocated {c} bytes for {len}"))
                .unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{len}: {e}");
            // Before any device is asked: the same error with or without a driver.
            let e = Staging::new(0, len).err().unwrap();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{len}: {e}");
        }
        assert_eq!(BufferPool::<Vec<u8>>::class(1 << 62).unwrap(), 1 << 62);
        assert_eq!(pool.cached(), (0, 0));
    }

    #[test]
    fn a_slow_allocation_does_not_hold_the_pool() {
        // One thread allocates slowly (pinned allocation takes milliseconds); another takes a
        // cached buffer meanwhile and must not wait for it.
        let pool = Arc::new(BufferPool::<Vec<u8>>::new(1 << 30));
        assert!(pool.give(MIN_CLASS, vec![0; MIN_CLASS]).is_none());
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let slow = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                pool.take(1 << 20, |c| {
                    started_tx.send(()).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(500));
                    Ok(vec![0; c])
                })
                .unwrap()
            })
        };
        started_rx.recv().unwrap();
        let t0 = std::time::Instant::now();
        let (c, _b) = pool
            .take(100, |_| panic!("a cached buffer was there"))
            .unwrap();
        assert_eq!(c, MIN_CLASS);
        assert!(
            t0.elapsed() < std::time::Duration::from_millis(100),
            "waited {:?} behind another allocation",
            t0.elapsed()
        );
        assert_eq!(slow.join().unwrap().0, 1 << 20);
    }

    /// A `libcuda` that lacks a symbol cudarc calls (a stub, a driver older than the API cudarc
    /// was built for): cudarc's dynamic loading panics at the call ("Missing symbol"). Staging
    /// must turn that into `ErrorKind::Cuda`, not unwind through the engine (its lock held, its
    /// posted receives' leases never taken back; `ErrorKind::Panic` at the C++ boundary, or the
    /// progress thread killed by a copy on landing). Shown with a fake driver that has only
    /// `cuInit` and `cuDeviceGetCount` (one device), in a child process whose loader finds it.
    #[test]
    fn a_driver_missing_a_symbol_is_a_cuda_error_not_a_panic() {
        const CHILD: &str = "KVLINK_TEST_FAKE_LIBCUDA_CHILD";
        if std::env::var_os(CHILD).is_some() {
            assert!(driver_present(), "the fake libcuda is not found");
            check_device(0).expect("the fake driver reports one device");
            for len in [4096, 1 << 20] {
                let e = Staging::new(0, len)
                    .err()
                    .expect("no context without a driver");
                assert_eq!(e.kind, ErrorKind::Cuda, "{e}");
            }
            assert_eq!(staging_cached(0), (0, 0));
            return;
        }
        if driver_present() {
            println!("a CUDA driver is present: the fake one cannot be loaded instead");
            return;
        }
        let dir = std::env::temp_dir().join(format!("kvlink-fake-libcuda-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("fake.c");
        std::fs::write(
            &src,
            "int cuInit(unsigned f) { (void)f; return 0; }\n\
             int cuDeviceGetCount(int *n) { *n = 1; return 0; }\n",
        )
        .unwrap();
        let built = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join("libcuda.so"))
            .arg(&src)
            .status();
        if !matches!(built, Ok(s) if s.success()) {
            println!("SKIP: no C compiler to build the fake libcuda ({built:?})");
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "transport::cuda::tests::a_driver_missing_a_symbol_is_a_cuda_error_not_a_panic",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("LD_LIBRARY_PATH", &dir)
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "child failed:\n{text}"
        );
    }

    #[test]
    fn staging_without_a_driver_is_a_cuda_error() {
        if driver_present() {
            println!("a CUDA driver is present: tests/gpu.rs covers staging");
            return;
        }
        let e = Staging::new(0, 4096).err().unwrap();
        assert_eq!(e.kind, ErrorKind::Cuda);
        assert_eq!(staging_cached(0), (0, 0));
    }
}
