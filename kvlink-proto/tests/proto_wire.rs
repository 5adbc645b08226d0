//! The wire codec on stable: round trips, arbitrary and mutated bytes never panic, lengths from
//! the wire never size an allocation, and the committed corpus of malformed frames keeps failing
//! with the reason its file name records (`<Reason>__<what>.bin`).
use kvlink_proto::error::{ErrorKind, Outcome};
use kvlink_proto::wire::{frame_len, frame_version, HEADER_LEN, MAX_BUFFERS, MAX_INFO, VERSION};
use kvlink_proto::{
    BufferDesc, BufferKind, Message, RankId, Refusal, RequestKey, Token, WireReason,
};
use proptest::prelude::*;

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        Just(Outcome::Completed),
        Just(Outcome::TimedOut),
        Just(Outcome::Cancelled),
        Just(Outcome::PeerLost),
        Just(Outcome::Rejected),
    ]
}

fn key() -> impl Strategy<Value = RequestKey> {
    (any::<u64>(), any::<u32>()).prop_map(|(r, g)| RequestKey::new(r, g))
}

fn descs() -> impl Strategy<Value = Vec<BufferDesc>> {
    prop::collection::vec(
        (0u8..3, any::<u64>(), 1u64..1 << 40, -1i32..8, any::<u64>()),
        1..6,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (kind, addr, len, device_id, tok))| BufferDesc {
                kind: BufferKind::from_u8(kind).unwrap(),
                segment: i as u32,
                addr: addr % (u64::MAX - len),
                len,
                device_id,
                token: Token(tok.wrapping_mul(64).wrapping_add(i as u64)),
            })
            .collect()
    })
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            "[a-zA-Z0-9_.:-]{1,40}",
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            prop::option::of(any::<[u8; 32]>())
        )
            .prop_map(
                |(agent_name, r, instance, challenge, proof)| Message::Hello {
                    agent_name,
                    rank: RankId(r),
                    instance,
                    challenge,
                    proof,
                }
            ),
        (any::<[u8; 32]>(), prop::option::of(any::<[u8; 32]>()))
            .prop_map(|(proof, resume)| Message::Proof { proof, resume }),
        Just(Message::Welcome),
        Just(Message::Leaving),
        prop_oneof![
            Just(Refusal::AuthFailed),
            Just(Refusal::RankInUse),
            Just(Refusal::WireVersion)
        ]
        .prop_map(|reason| Message::Refuse { reason }),
        (
            key(),
            any::<u32>(),
            1..=u32::MAX,
            prop::collection::vec(any::<u8>(), 0..64),
            descs()
        )
            .prop_map(|(key, r, timeout_ms, request_info, buffers)| {
                Message::Advertise {
                    key,
                    src_rank: RankId(r),
                    timeout_ms,
                    request_info,
                    buffers,
                }
            }),
        (key(), any::<bool>()).prop_map(|(key, ready)| Message::Ready { key, ready }),
        (key(), prop::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(key, payload)| Message::Notify { key, payload }),
        (key(), outcome()).prop_map(|(key, outcome)| Message::Vote { key, outcome }),
        (key(), outcome()).prop_map(|(key, outcome)| Message::Verdict { key, outcome }),
        key().prop_map(|key| Message::Quiesced { key }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn round_trip(m in message()) {
        let bytes = m.to_bytes().unwrap();
        prop_assert_eq!(frame_len(&bytes).unwrap(), Some(bytes.len()));
        prop_assert_eq!(Message::decode(&bytes).unwrap(), m);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = Message::decode(&bytes);
        let _ = frame_len(&bytes);
    }

    /// Valid header, random body: exercises the body decoders rather than the magic check.
    #[test]
    fn random_bodies_never_panic(t in 0u8..12, body in prop::collection::vec(any::<u8>(), 0..300)) {
        let mut bytes = b"KVLK".to_vec();
        bytes.extend_from_slice(&kvlink_proto::wire::VERSION.to_le_bytes());
        bytes.push(t);
        bytes.push(0);
        bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&body);
        if let Ok(m) = Message::decode(&bytes) {
            // Whatever decodes must re-encode to the same bytes (one encoding per message).
            prop_assert_eq!(m.to_bytes().unwrap(), bytes);
        }
    }

    /// Mutations of valid frames: decode is total; anything accepted is canonical and valid.
    #[test]
    fn mutated_frames(m in message(), edits in prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..6)) {
        let mut bytes = m.to_bytes().unwrap();
        for (at, val, op) in edits {
            let at = at % (bytes.len() + 1);
            match op {
                0 if at < bytes.len() => bytes[at] = val,
                1 => bytes.insert(at, val),
                _ if at < bytes.len() => { bytes.remove(at); }
                _ => {}
            }
        }
        match Message::decode(&bytes) {
            Ok(m2) => {
                prop_assert_eq!(m2.to_bytes().unwrap(), as_this_version(&m2, &bytes));
                if let Message::Advertise { buffers, .. } = &m2 {
                    for d in buffers {
                        prop_assert!(d.len > 0 && d.addr.checked_add(d.len).is_some());
                    }
                }
            }
            Err(e) => {
                prop_assert_eq!(e.kind(), ErrorKind::Protocol);
                prop_assert!(e.offset <= bytes.len());
            }
        }
    }

    /// Every strict prefix of a valid frame is refused as truncated, never misread.
    #[test]
    fn prefixes_are_truncated(m in message()) {
        let bytes = m.to_bytes().unwrap();
        for n in 0..bytes.len() {
            let e = Message::decode(&bytes[..n]).unwrap_err();
            prop_assert_eq!(e.reason, WireReason::Truncated);
        }
    }
}

/// `bytes` as this version would encode the message they decoded to: the version refusal is read
/// whatever version its header names, and re-encodes under this one.
fn as_this_version(m: &Message, bytes: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    if *m
        == (Message::Refuse {
            reason: Refusal::WireVersion,
        })
    {
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    }
    b
}

/// `m` encoded with another version in its header.
fn under_version(m: &Message, v: u16) -> Vec<u8> {
    let mut b = m.to_bytes().unwrap();
    b[4..6].copy_from_slice(&v.to_le_bytes());
    b
}

proptest! {
    /// Of another version's frames only the version refusal is read (whatever the version its
    /// header names): a rank of another version learns why it was refused, and reads nothing
    /// else from the other.
    #[test]
    fn another_versions_frames_are_refused_but_its_version_refusal(
        m in message(),
        v in any::<u16>().prop_filter("another version", |v| *v != VERSION),
    ) {
        let bytes = under_version(&m, v);
        prop_assert_eq!(frame_version(&bytes), Some(v));
        match Message::decode(&bytes) {
            Ok(got) => {
                prop_assert_eq!(&got, &Message::Refuse { reason: Refusal::WireVersion });
                prop_assert_eq!(&got, &m);
            }
            Err(e) => {
                prop_assert_ne!(&m, &Message::Refuse { reason: Refusal::WireVersion });
                prop_assert_eq!(e.reason, WireReason::UnsupportedVersion(v));
                prop_assert_eq!(e.kind(), ErrorKind::Protocol);
            }
        }
    }
}

#[test]
fn the_version_refusal_frame_is_fixed_and_only_it_is_read_across_versions() {
    let refusal = Message::Refuse {
        reason: Refusal::WireVersion,
    };
    // Its bytes, which every version keeps: header (type 10, flags 0, body 1), then reason 3.
    let mut expect = b"KVLK".to_vec();
    expect.extend_from_slice(&VERSION.to_le_bytes());
    expect.extend_from_slice(&[10, 0, 1, 0, 0, 0, 3]);
    assert_eq!(refusal.to_bytes().unwrap(), expect);
    for v in [0, 1, VERSION - 1, VERSION + 1, u16::MAX] {
        assert_eq!(
            Message::decode(&under_version(&refusal, v)).unwrap(),
            refusal
        );
        // The other refusals of another version are not read...
        for reason in [Refusal::AuthFailed, Refusal::RankInUse] {
            let e = Message::decode(&under_version(&Message::Refuse { reason }, v)).unwrap_err();
            assert_eq!(e.reason, WireReason::UnsupportedVersion(v));
        }
        // ... nor the version refusal with a byte more (another version's longer body).
        let mut longer = under_version(&refusal, v);
        longer[8] = 2;
        longer.push(0);
        assert_eq!(
            frame_len(&longer).unwrap_err().reason,
            WireReason::UnsupportedVersion(v)
        );
        let e = Message::decode(&longer).unwrap_err();
        assert_eq!(e.reason, WireReason::UnsupportedVersion(v));
        // Its header with a byte too many or too few after it: refused for the version (which
        // the sender is told), not for the length.
        let exact = under_version(&refusal, v);
        for bytes in [
            [exact.as_slice(), &[0]].concat(),
            exact[..HEADER_LEN].to_vec(),
        ] {
            let e = Message::decode(&bytes).unwrap_err();
            assert_eq!(e.reason, WireReason::UnsupportedVersion(v), "{bytes:?}");
        }
    }
    assert_eq!(frame_version(b"KVLK"), None);
    assert_eq!(frame_version(b"XVLK\x04\x00"), None);
    assert_eq!(Refusal::WireVersion.kind(), ErrorKind::Protocol);
}

#[test]
fn corpus_of_malformed_frames() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/corpus/wire");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("bin") {
            continue;
        }
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let expected = name.split("__").next().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let err =
            Message::decode(&bytes).expect_err(&format!("{name}: malformed frame was accepted"));
        let got = format!("{:?}", err.reason);
        assert!(
            got.starts_with(expected),
            "{name}: expected {expected}, got {got}"
        );
        let e: kvlink_proto::error::Error = err.into();
        assert_eq!(e.kind, ErrorKind::Protocol);
        n += 1;
    }
    assert!(n >= 30, "corpus has only {n} files");
}

#[test]
fn hostile_lengths_allocate_nothing_they_cannot_see() {
    // A header that claims the largest body: refused as truncated before any body is read.
    let mut bytes = b"KVLK".to_vec();
    bytes.extend_from_slice(&kvlink_proto::wire::VERSION.to_le_bytes());
    bytes.extend_from_slice(&[2, 0]);
    bytes.extend_from_slice(&(2u32 << 20).to_le_bytes());
    assert_eq!(frame_len(&bytes).unwrap(), Some(HEADER_LEN + (2 << 20)));
    assert_eq!(
        Message::decode(&bytes).unwrap_err().reason,
        WireReason::Truncated
    );
    // Caps are enforced on encode too: we never emit what we would refuse.
    let k = RequestKey::new(1, 0);
    let d = BufferDesc {
        kind: BufferKind::Kv,
        segment: 0,
        addr: 0,
        len: 1,
        device_id: -1,
        token: Token(1),
    };
    let big = Message::Advertise {
        key: k,
        src_rank: RankId(0),
        timeout_ms: 1000,
        request_info: vec![0; MAX_INFO + 1],
        buffers: vec![d],
    };
    assert_eq!(big.to_bytes().unwrap_err().reason, WireReason::TooLarge);
    let many: Vec<BufferDesc> = (0..=MAX_BUFFERS as u32)
        .map(|i| BufferDesc {
            segment: i,
            token: Token(i as u64),
            ..d
        })
        .collect();
    let big = Message::Advertise {
        key: k,
        src_rank: RankId(0),
        timeout_ms: 1000,
        request_info: vec![],
        buffers: many,
    };
    assert_eq!(big.to_bytes().unwrap_err().reason, WireReason::TooLarge);
    // A bad magic is refused as soon as its first byte is visible.
    assert_eq!(frame_len(b"X").unwrap_err().reason, WireReason::BadMagic);
    assert_eq!(frame_len(b"KV").unwrap(), None);
}

#[test]
fn ids_equal_mod_4096_encode_distinctly() {
    let a = Message::Ready {
        key: RequestKey::new(7, 0),
        ready: true,
    };
    let b = Message::Ready {
        key: RequestKey::new(7 + 4096, 0),
        ready: true,
    };
    let c = Message::Ready {
        key: RequestKey::new(7 + (1 << 40), 0),
        ready: true,
    };
    let (ea, eb, ec) = (
        a.to_bytes().unwrap(),
        b.to_bytes().unwrap(),
        c.to_bytes().unwrap(),
    );
    assert_ne!(ea, eb);
    assert_ne!(ea, ec);
    assert_eq!(Message::decode(&eb).unwrap(), b);
    assert_eq!(Message::decode(&ec).unwrap(), c);
}

/// The valid seeds are what the encoder writes: each decodes, as the type its name starts with,
/// and encodes back to the very same bytes (a stale seed after a format change fails here).
#[test]
fn corpus_of_valid_frames_round_trips() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/corpus/valid");
    let mut types = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let bytes = std::fs::read(&path).unwrap();
        let m = Message::decode(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ty = name.split("__").next().unwrap().to_owned();
        assert!(format!("{m:?}").starts_with(&ty), "{name} decoded as {m:?}");
        assert_eq!(m.to_bytes().unwrap(), bytes, "{name} does not re-encode");
        types.insert(ty);
    }
    assert_eq!(
        types.len(),
        11,
        "a valid seed of every message type: {types:?}"
    );
}

/// The batch seeds are batches of what the encoder writes: each splits whole, and every message
/// in it decodes and encodes back to the very same bytes; the worker address seeds open.
#[test]
fn corpus_of_batches_and_worker_addresses_is_valid() {
    let files = |sub: &str| {
        let dir = format!("{}/tests/corpus/{sub}", env!("CARGO_MANIFEST_DIR"));
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    let batches = files("batch");
    assert!(!batches.is_empty());
    for path in batches {
        let bytes = std::fs::read(&path).unwrap();
        let msgs = kvlink_proto::batch::split(&bytes)
            .unwrap_or_else(|| panic!("{}: does not split", path.display()));
        assert!(msgs.len() > 1, "{}: one message", path.display());
        for m in msgs {
            let d = Message::decode(m).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(d.to_bytes().unwrap(), m, "{}", path.display());
        }
    }
    let addresses = files("worker_address");
    assert!(!addresses.is_empty());
    for path in addresses {
        let bytes = std::fs::read(&path).unwrap();
        let raw = kvlink_proto::worker_address::open(&bytes)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(kvlink_proto::worker_address::seal(raw), bytes);
    }
}

/// A repeated segment or token is refused wherever it sits in the list, short or as long as
/// the wire allows (checked by sorting beyond a few descriptors), on encode and on decode; a
/// list without repeats passes both.
#[test]
fn repeats_are_found_anywhere_in_short_and_long_descriptor_lists() {
    let desc = |i: u32| BufferDesc {
        kind: BufferKind::Kv,
        segment: i,
        addr: 0x1000,
        len: 64,
        device_id: -1,
        token: Token(u64::from(i) * 7 + 3),
    };
    let advert = |buffers: Vec<BufferDesc>| Message::Advertise {
        key: RequestKey::new(9, 1),
        src_rank: RankId(2),
        timeout_ms: 1000,
        request_info: vec![],
        buffers,
    };
    for n in [2u32, 3, 16, 17, 100, MAX_BUFFERS as u32] {
        let clean: Vec<BufferDesc> = (0..n).map(desc).collect();
        let bytes = advert(clean.clone()).to_bytes().unwrap();
        assert!(Message::decode(&bytes).is_ok(), "{n} distinct descriptors");
        for (a, b) in [(0, n - 1), (n / 2 - 1, n / 2), (n - 2, n - 1)] {
            let mut seg = clean.clone();
            seg[b as usize].segment = seg[a as usize].segment;
            let mut tok = clean.clone();
            tok[b as usize].token = tok[a as usize].token;
            for (list, want) in [
                (seg, WireReason::DuplicateSegment),
                (tok, WireReason::DuplicateToken),
            ] {
                let m = advert(list);
                assert_eq!(m.to_bytes().unwrap_err().reason, want, "n {n}, {a} and {b}");
                // The same frame forced past the encoder: the decoder refuses it too.
                let mut forged = bytes.clone();
                let at = forged.len() - (n - b) as usize * 33;
                let Message::Advertise { buffers, .. } = &m else {
                    unreachable!()
                };
                forged[at + 1..at + 5].copy_from_slice(&buffers[b as usize].segment.to_le_bytes());
                forged[at + 25..at + 33]
                    .copy_from_slice(&buffers[b as usize].token.0.to_le_bytes());
                assert_eq!(
                    Message::decode(&forged).unwrap_err().reason,
                    want,
                    "decoded, n {n}, {a} and {b}"
                );
            }
        }
    }
}
