//! `cargo +nightly fuzz run wire_decode -- tests/corpus/wire` (from the repository root, with
//! `fuzz/` as the fuzz directory). Stable CI covers the same properties with proptest in
//! `tests/proto_wire.rs`; crashes found here belong in `tests/corpus/wire/`.
#![no_main]
use kvlink::proto::wire::frame_len;
use kvlink::proto::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = frame_len(data);
    if let Ok(m) = Message::decode(data) {
        // Anything accepted is canonical: it re-encodes to the very same bytes.
        assert_eq!(m.to_bytes().expect("decoded message must encode"), data);
    }
});
