//! Heap use of the `core` command: a global allocator that counts, per thread, the allocations
//! made and the bytes they hold, and passes every call to the system allocator. Per thread, so
//! the count is the one thread's that runs the core (nothing shared between the peers' threads,
//! nor between tests that run side by side).
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

pub struct Counting;

thread_local! {
    // Const-initialised and without a destructor: reading them never allocates, and they stay
    // readable while the thread exits.
    static CALLS: Cell<u64> = const { Cell::new(0) };
    static LIVE: Cell<usize> = const { Cell::new(0) };
}

/// This thread's allocations so far (a `realloc` counts as one) and the bytes they hold. Bytes
/// freed here that another thread allocated are subtracted too, so compare two readings with
/// wrapping arithmetic.
#[derive(Clone, Copy, Debug)]
pub struct Heap {
    pub calls: u64,
    pub live: usize,
}

pub fn now() -> Heap {
    Heap {
        calls: CALLS.with(Cell::get),
        live: LIVE.with(Cell::get),
    }
}

fn grew(by: usize) {
    CALLS.with(|c| c.set(c.get() + 1));
    LIVE.with(|l| l.set(l.get().wrapping_add(by)));
}

fn shrank(by: usize) {
    LIVE.with(|l| l.set(l.get().wrapping_sub(by)));
}

// SAFETY: every call goes to `System` unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            grew(new_size);
            shrank(layout.size());
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What this thread allocates and frees shows in its counts, and nothing else does.
    #[test]
    fn counts_this_threads_allocations_and_the_bytes_they_hold() {
        // Made on another thread (the spawn itself allocates here too, so before `before`).
        let other = std::thread::spawn(|| vec![1u8; 4 << 20]).join().unwrap();
        let before = now();
        let held = vec![7u8; 1 << 20];
        let during = now();
        assert_eq!(during.calls - before.calls, 1, "one allocation here");
        assert_eq!(during.live.wrapping_sub(before.live), 1 << 20);
        drop(held);
        assert_eq!(now().live, before.live, "freed again");
        drop(other);
        assert_eq!(
            now().live.wrapping_sub(before.live),
            (4usize << 20).wrapping_neg()
        );
    }
}
