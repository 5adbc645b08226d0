//! `cargo +nightly fuzz run wire_decode -- kvlink-proto/tests/corpus/wire` (from the repository
//! root, with `fuzz/` as the fuzz directory). Stable CI covers the same properties with proptest
//! in `kvlink-proto/tests/proto_wire.rs`; crashes found here belong in
//! `kvlink-proto/tests/corpus/wire/`.
#![no_main]
use kvlink_proto::wire::{frame_len, VERSION};
use kvlink_proto::{Message, Refusal};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
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
});
