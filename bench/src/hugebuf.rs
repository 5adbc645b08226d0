//! Buffers of the transfers, backed by transparent huge pages where the kernel gives them.
//!
//! `ucx_perftest` allocates its buffers through UCX, whose first allocation method on a host
//! without huge-page reservations is `thp`: an anonymous mapping advised `MADV_HUGEPAGE` (a
//! running `tag_bw` receiver at 64 MiB holds 64 MiB of `AnonHugePages`). On 4 KiB pages the
//! kernel's copies into the bench's receive buffers took about a fifth more samples than
//! perftest's into its huge pages (`perf record -a`, tcp, 64 MiB), so the bench gives its own
//! buffers the same backing wherever UCX would ([`on_huge_pages`]), to set kvlink against
//! perftest on equal memory.
//! A kernel with THP off, or one that refuses the advice, leaves ordinary pages, as it does for
//! perftest.
//!
//! On shared memory (`UCX_TLS=posix,sysv,self`) UCX's first method is the sysv memory domain
//! instead: `ucx_perftest`'s buffers are System V segments (`/SYSV00000000` in
//! `/proc/PID/smaps`) on 4 KiB pages, and its never-written send buffer is read-faulted into
//! real pages (16 MiB resident at 16 MiB), not onto the zero page. The bench's buffers for a
//! shared-memory row are the same kind of memory ([`Backing::Shm`]): a shared anonymous
//! mapping, which is shmem as a System V segment is, on small pages.

use std::ops::{Deref, DerefMut};

/// Huge-page alignment; mappings are rounded up to it so each is whole huge pages.
const HUGE: usize = 2 << 20;

/// Whether a buffer of `len` bytes goes on huge pages: by UCX's own rule for its `thp` method,
/// only when rounding it up to whole huge pages takes less than twice its size (so 1 MiB and
/// less stay on small pages, as `ucx_perftest`'s do, and 4096 buffers of 4 KiB do not take
/// 2 MiB each).
fn on_huge_pages(len: usize) -> bool {
    len.div_ceil(HUGE).saturating_mul(HUGE) < len.saturating_mul(2)
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// What a buffer's memory is, as UCX would allocate `ucx_perftest`'s for the row's transport.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A private anonymous mapping, advised onto huge pages where [`on_huge_pages`] says so
    /// (UCX's `thp` method: tcp). Never-written pages read as the shared zero page.
    Thp,
    /// A shared anonymous mapping on small pages (UCX's sysv memory domain: shared memory).
    /// Reading a never-written page allocates it, as for a System V segment.
    Shm,
}

/// A zeroed buffer of `len` bytes in its own anonymous mapping.
pub struct HugeBuf {
    ptr: *mut u8,
    len: usize,
    map_len: usize,
    /// Advised onto huge pages (read by the tests).
    #[cfg_attr(not(test), allow(dead_code))]
    huge: bool,
}

// SAFETY: the mapping is owned by this value alone, like a `Vec<u8>`'s allocation.
unsafe impl Send for HugeBuf {}
// SAFETY: shared access only reads through `&[u8]`.
unsafe impl Sync for HugeBuf {}

impl HugeBuf {
    /// A zeroed buffer of `len` bytes (at least one page is mapped, so `len` 0 is fine).
    /// Where [`on_huge_pages`] says so it lies on whole huge pages; else on small pages, so that
    /// thousands of 4 KiB request buffers do not take 2 MiB each. Panics if the kernel
    /// refuses the mapping, as `vec![0; len]` aborts when out of memory.
    pub fn zeroed(len: usize) -> HugeBuf {
        HugeBuf::zeroed_as(len, len)
    }

    /// A zeroed buffer of `len` bytes on the pages [`on_huge_pages`] gives a buffer of `like`
    /// bytes: a source of `like`-byte transfers with a byte or so more (the patterns' base)
    /// lies where UCX would put `ucx_perftest`'s buffer of that size. Without this, 1 MiB + 1
    /// goes on a huge page where UCX leaves 1 MiB on small ones.
    pub fn zeroed_as(len: usize, like: usize) -> HugeBuf {
        HugeBuf::zeroed_on(len, like, Backing::Thp)
    }

    /// [`HugeBuf::zeroed_as`] on the memory `backing` names: with [`Backing::Shm`] a shared
    /// anonymous mapping on small pages, whatever the size.
    pub fn zeroed_on(len: usize, like: usize, backing: Backing) -> HugeBuf {
        let huge = backing == Backing::Thp && on_huge_pages(like);
        let share = match backing {
            Backing::Thp => libc::MAP_PRIVATE,
            Backing::Shm => libc::MAP_SHARED,
        };
        let unit = if huge { HUGE } else { page_size() };
        let map_len = len.max(1).div_ceil(unit) * unit;
        // Over-map by one huge page, then trim both ends so the buffer starts on a 2 MiB
        // boundary: an unaligned start would keep its first and last pieces on small pages.
        let over = if huge { map_len + HUGE } else { map_len };
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_READ | libc::PROT_WRITE,
                share | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(
            raw != libc::MAP_FAILED,
            "mmap of {over} bytes: {}",
            std::io::Error::last_os_error()
        );
        let start = (raw as usize).div_ceil(unit) * unit;
        let head = start - raw as usize;
        let tail = over - head - map_len;
        // SAFETY: both ranges lie inside the mapping just made and are not used afterwards.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + map_len) as *mut libc::c_void, tail);
            }
            if huge {
                // Advice only: a kernel without THP says EINVAL and the pages stay small.
                libc::madvise(start as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE);
            }
        }
        HugeBuf {
            ptr: start as *mut u8,
            len,
            map_len,
            huge,
        }
    }

    /// Whether the mapping was advised onto huge pages (the kernel may still refuse them).
    #[cfg(test)]
    pub fn huge(&self) -> bool {
        self.huge
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` maps at least `len` readable bytes for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HugeBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `zeroed`, unmapped once.
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.map_len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_zeroed_aligned_and_holds_what_is_written() {
        for len in [0usize, 1, 4096, 1 << 20, (1 << 20) + 1, HUGE - 1, HUGE + 5] {
            let mut b = HugeBuf::zeroed(len);
            assert_eq!(b.len(), len);
            let align = if on_huge_pages(len) {
                HUGE
            } else {
                page_size()
            };
            assert_eq!(b.as_ptr() as usize % align, 0, "len {len}");
            assert!(b.iter().all(|&x| x == 0), "len {len}");
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as u8;
            }
            assert!(b.iter().enumerate().all(|(i, &x)| x == i as u8));
        }
    }

    /// Resident memory of this process, from /proc/self/statm (pages).
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * page_size()
    }

    /// Bytes of `b`'s own pages that are resident (`mincore`): unlike the process's resident
    /// size, other tests running beside it (allocating and freeing) do not move it.
    fn resident_in(b: &HugeBuf) -> usize {
        let pages = b.len().div_ceil(page_size());
        let mut v = vec![0u8; pages];
        // SAFETY: `b` is a live mapping of at least `pages` pages starting at a page boundary,
        // and `v` has a byte per page.
        let rc = unsafe { libc::mincore(b.as_ptr() as *mut libc::c_void, b.len(), v.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().filter(|&&x| x & 1 != 0).count() * page_size()
    }

    #[test]
    fn huge_pages_where_ucx_would_use_them() {
        // UCX's `thp` allocation: rounded up to whole huge pages unless that doubles the size.
        assert!(!on_huge_pages(4096));
        assert!(!on_huge_pages(1 << 20), "1 MiB would take a 2 MiB page");
        assert!(on_huge_pages((1 << 20) + 1));
        assert!(on_huge_pages(16 << 20) && on_huge_pages(64 << 20));
        assert!(!on_huge_pages(0));
    }

    #[test]
    fn thousands_of_small_buffers_take_small_pages() {
        // The 4096-in-flight rows hold 4096 buffers of 4 KiB: on huge pages they would make
        // 8 GiB resident.
        let before = resident_bytes();
        let mut bufs: Vec<HugeBuf> = (0..1024).map(|_| HugeBuf::zeroed(4096)).collect();
        for b in &mut bufs {
            b.fill(1);
        }
        let grown = resident_bytes().saturating_sub(before);
        assert!(
            grown < (64 << 20),
            "1024 buffers of 4 KiB made {grown} bytes resident"
        );
    }

    #[test]
    fn a_shared_memory_buffer_is_on_small_pages_and_reading_it_makes_it_resident() {
        // As a System V segment of ucx_perftest's on shared memory: no huge pages, and a read
        // of a never-written page allocates it (no zero page to read from).
        let len = 16 << 20;
        let b = HugeBuf::zeroed_on(len, len, Backing::Shm);
        assert!(!b.huge());
        assert_eq!(b.as_ptr() as usize % page_size(), 0);
        assert!(b.iter().step_by(4096).all(|&x| x == 0));
        // Its own pages, not the process's resident size: tests beside it free memory too (a
        // CI run once read 14 of 16 MiB grown that way).
        let resident = resident_in(&b);
        assert!(
            resident >= len - (1 << 20),
            "reading 16 MiB of shared memory made only {resident} bytes resident"
        );
    }

    #[test]
    fn a_fresh_buffer_is_not_written_so_reads_of_it_find_the_zero_page() {
        // The transport row's untouched source relies on this (cli `--tr-source`).
        let before = resident_bytes();
        let b = HugeBuf::zeroed(64 << 20);
        let made = resident_bytes();
        assert!(
            made < before + (8 << 20),
            "making 64 MiB made {} bytes resident",
            made.saturating_sub(before)
        );
        assert!(b.iter().step_by(4096).all(|&x| x == 0));
    }
}
