//! Memory a script call allocates, counted where it is allocated: [`Counted`] wraps the global
//! allocator and keeps a per-thread tally of bytes allocated minus bytes freed. The sandbox reads
//! the tally between operations and stops a call that has grown past `Limits::max_memory`.
//!
//! Rhai's own size limits look only at strings, arrays and maps as they are assigned; values kept
//! in closures, curried `Fn` pointers or shadowed variables escape them. Counting bytes at the
//! allocator covers every way to hold memory at once. The binary installs it (src/main.rs); a
//! program that does not gets only Rhai's structural limits ([`installed`] says which).
use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    /// Bytes allocated minus bytes freed by this thread (frees of other threads' memory make it
    /// drift down, which only errs on the lenient side).
    static NET: Cell<i64> = const { Cell::new(0) };
}

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// A global allocator that counts each thread's allocations: `#[global_allocator] static A:
/// Counted<System> = Counted(System);`.
pub struct Counted<A>(pub A);

fn add(bytes: i64) {
    // `try_with`: during thread teardown the slot may be gone; those bytes are not a script's.
    let _ = NET.try_with(|n| n.set(n.get().wrapping_add(bytes)));
}

// SAFETY: every method forwards to the wrapped allocator unchanged; the tally touches only a
// const-initialised thread-local `Cell`, which never allocates.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counted<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        add(layout.size() as i64);
        self.0.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as i64);
        self.0.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add(-(layout.size() as i64));
        self.0.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        add(new_size as i64 - layout.size() as i64);
        self.0.realloc(ptr, layout, new_size)
    }
}

/// Whether [`Counted`] is this program's allocator (so `Limits::max_memory` is enforced).
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// This thread's tally now (compare two readings).
pub(crate) fn net() -> i64 {
    NET.try_with(Cell::get).unwrap_or(0)
}
