//! `cargo +nightly fuzz run wire_decode -- kvlink-proto/tests/corpus/wire` (from the repository
//! root, with `fuzz/` as the fuzz directory). Stable CI covers the same properties with proptest
//! in `kvlink-proto/tests/proto_wire.rs` and the unit tests of `kvlink_proto::batch` and
//! `kvlink_proto::worker_address`; a malformed frame found here belongs in
//! `kvlink-proto/tests/corpus/wire/`, any other finding in `kvlink-proto/tests/corpus/wire_decode/`.
//!
//! Every decoder of bytes a peer sends before anything about it is known, each on the whole
//! input:
//! 1. A control frame: decode never panics; whatever decodes re-encodes to the very same bytes.
//! 2. A control batch (several frames in one transport message, `kvlink_proto::batch`): split
//!    never panics; what splits accounts for every byte, in messages that push back into the
//!    very same batch, and each message goes through (1), as the engine hands each on.
//! 3. A sealed worker address (a peer's `Bind`, `kvlink_proto::worker_address`): open never
//!    panics, refuses with `InvalidArgument`, and what opens seals back to the very same bytes;
//!    the input sealed opens back to itself.
#![no_main]
use kvlink_proto::batch::{self, BATCH_MAX, MSG_MAX};
use kvlink_proto::error::ErrorKind;
use kvlink_proto::wire::{frame_len, VERSION};
use kvlink_proto::worker_address;
use kvlink_proto::{Message, Refusal};
use libfuzzer_sys::fuzz_target;

fn check_frame(data: &[u8]) {
    let _ = frame_len(data);
    if let Ok(m) = Message::decode(data) {
        // Anything accepted is canonical: it re-encodes to the very same bytes, but for the
        // version refusal, which is read under any version and re-encodes under this one.
        let mut expect = data.to_vec();
        if m == (Message::Refuse {
            reason: Refusal::WireVersion,
        }) {
            expect[4..6].copy_from_slice(&VERSION.to_le_bytes());
        }
        assert_eq!(m.to_bytes().expect("decoded message must encode"), expect);
    }
}

fn check_batch(data: &[u8]) {
    let Some(msgs) = batch::split(data) else {
        return;
    };
    assert!(!msgs.is_empty() && data.len() <= BATCH_MAX, "{msgs:?}");
    let mut again = Vec::new();
    for m in &msgs {
        assert!(!m.is_empty() && m.len() <= MSG_MAX, "{} bytes", m.len());
        assert!(batch::fits(&again, m), "split more than fits");
        batch::push(&mut again, m);
        check_frame(m);
    }
    assert_eq!(
        again,
        data,
        "split {} messages that push back otherwise",
        msgs.len()
    );
}

fn check_worker_address(data: &[u8]) {
    match worker_address::open(data) {
        Ok(raw) => assert_eq!(worker_address::seal(raw), data),
        Err(e) => assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}"),
    }
    if !data.is_empty() {
        let sealed = worker_address::seal(data);
        assert_eq!(worker_address::open(&sealed).expect("own seal opens"), data);
    }
}

fuzz_target!(|data: &[u8]| {
    check_frame(data);
    check_batch(data);
    check_worker_address(data);
});
