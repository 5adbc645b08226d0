//! The sans-IO protocol core (see the crate docs). No I/O, no threads, no clock reads.
#![forbid(unsafe_code)]
