//! The panic boundary every exported function goes through (one place, like rustls-ffi's
//! `panic.rs`). A Rust panic never unwinds into C++ and never aborts the process: it becomes an
//! [`Error`] of kind [`ErrorKind::Panic`].
//!
//! Errors cross into C++ as `rust::Error` (cxx's exception type), whose only payload is text. So
//! that C++ can branch on the kind without parsing text, the kind of the error being returned is
//! also stored in a thread-local slot, read (and cleared) by the C++ facade with
//! `take_last_error_kind()` in the same thread, right after the call threw.
use crate::error::{Error, ErrorKind};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR_KIND: Cell<u8> = const { Cell::new(0) };
}

/// Runs `f`, turning a panic into `ErrorKind::Panic` and recording the kind of any error.
pub fn guard<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    let result = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".to_string());
            Err(Error::new(
                ErrorKind::Panic,
                format!("panic caught at the C++ boundary: {what}"),
            ))
        }
    };
    if let Err(e) = &result {
        LAST_ERROR_KIND.with(|k| k.set(e.kind.code()));
    }
    result
}

/// Returns and clears the kind code of the last error returned on this thread (0 when none).
pub fn take_last_error_kind() -> u8 {
    LAST_ERROR_KIND.with(|k| k.replace(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_becomes_typed_error() {
        let r: Result<(), Error> = guard(|| panic!("boom"));
        let e = r.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Panic);
        assert!(e.message.contains("boom"));
        assert_eq!(take_last_error_kind(), ErrorKind::Panic.code());
        assert_eq!(take_last_error_kind(), 0, "the slot is cleared once read");
    }

    #[test]
    fn ok_leaves_slot_empty() {
        let r = guard(|| Ok::<_, Error>(5));
        assert_eq!(r.unwrap(), 5);
        assert_eq!(take_last_error_kind(), 0);
    }
}
