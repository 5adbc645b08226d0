//! The handshake and what a stranger's control frame can do.
//! `cargo +nightly fuzz run handshake` (scripts/fuzz.sh runs it, seeded from
//! kvlink-proto/tests/corpus/).
//!
//! For every input:
//! 1. The input as the body of a `Hello` frame: decode never panics; a refusal is a protocol
//!    error inside the frame; an acceptance is a `Hello` that re-encodes to the very same bytes.
//! 2. The input as a `Hello` value (rank, instance, then a name): encode and decode round trip
//!    exactly, and encode refuses exactly the names decode would refuse.
//! 4. The input as frames a stranger sends during the handshake (as `Hello`, `Proof`, `Welcome`,
//!    `Refuse` and raw), to an answering and to a dialling rank that hold a deployment secret: the
//!    stranger, who does not hold it, is never bound.
//! 5. The same frames fed to a peer table (`Peers::on_handshake`, as the engine drives it) that
//!    holds a deployment secret and has two ranks bound, one that dialled it and one it dialled,
//!    on an endpoint the stranger made and on one this side dialled to it: no rank is bound to
//!    the stranger's endpoints, and no binding moves, closes or is lost.
//! 3. A whole request between a generation endpoint (rank 0) and a context endpoint (rank 1),
//!    with frames built from the input (raw, as a `Hello`, and as a body of each other message
//!    type) injected into both endpoints as if sent by rank 7, a peer neither knows, before and
//!    in the middle of the exchange. The request's key is the one the raw frame names, if any. The request must still complete on both sides, its buffer
//!    must come back to the pool, and nothing may be sent to rank 7 or on its behalf.
#![no_main]
use std::time::{Duration, Instant};

use kvlink_proto::error::{ErrorKind, Outcome};
use kvlink_proto::peers::{HandshakeAction, Peers};
use kvlink_proto::wire::{HEADER_LEN, MAGIC, MAX_NAME, VERSION};
use kvlink_proto::{
    Action, BufferDesc, BufferKind, BufferPool, Config, Endpoint, Event, Handshake, Identity,
    Message, RankId, ReceiveFlow, ReceiveSpec, RequestKey, Role, Secret, Step, Token,
};
use libfuzzer_sys::fuzz_target;

const GEN: RankId = RankId(0);
const CTX: RankId = RankId(1);
const STRANGER: RankId = RankId(7);

/// A well-formed header of type `t` around `body` (the body itself may be anything).
fn frame(t: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_LEN + body.len());
    f.extend_from_slice(&MAGIC);
    f.extend_from_slice(&VERSION.to_le_bytes());
    f.push(t);
    f.push(0);
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

fn check_hello_frame(bytes: &[u8]) {
    match Message::decode(bytes) {
        Ok(m) => {
            assert!(
                matches!(m, Message::Hello { .. }),
                "type 1 decoded as {m:?}"
            );
            assert_eq!(m.to_bytes().expect("accepted Hello must encode"), bytes);
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Protocol);
            assert!(e.offset <= bytes.len(), "{e} beyond {} bytes", bytes.len());
        }
    }
}

fn check_hello_value(data: &[u8]) {
    let mut r = [0u8; 12];
    let n = data.len().min(12);
    r[..n].copy_from_slice(&data[..n]);
    let rank = RankId(u32::from_le_bytes(r[..4].try_into().unwrap()));
    let instance = u64::from_le_bytes(r[4..].try_into().unwrap());
    let agent_name = String::from_utf8_lossy(&data[n..]).into_owned();
    let fits = !agent_name.is_empty() && agent_name.len() <= MAX_NAME;
    let proof = (data.len() % 2 == 1).then_some([data.len() as u8; 32]);
    let m = Message::Hello {
        agent_name,
        rank,
        instance,
        challenge: !instance,
        proof,
    };
    match m.to_bytes() {
        Ok(bytes) => {
            assert!(fits, "encoded a Hello the decoder must refuse");
            assert_eq!(Message::decode(&bytes).expect("own Hello must decode"), m);
        }
        Err(_) => assert!(!fits, "refused to encode a valid Hello"),
    }
}

/// One request `key`, generation rank 0 <- context rank 1, with `intruder` frames from rank 7
/// delivered to both endpoints at rounds 0 and 2.
fn request_survives_stranger(key: RequestKey, intruder: &[Vec<u8>]) {
    let t0 = Instant::now();
    let mut now = t0;
    let cfg = Config::default();
    let mut pool = BufferPool::new(1);
    let lease = pool.lease(key).expect("one free buffer");
    let desc = BufferDesc {
        kind: BufferKind::Kv,
        segment: 0,
        addr: 0x1000,
        len: 64,
        device_id: -1,
        token: Token(0x5eed),
    };
    let mut gen = Endpoint::new(GEN, cfg);
    let mut ctx = Endpoint::new(CTX, cfg);
    gen.start_receive(
        now,
        ReceiveSpec {
            key,
            receivers: vec![GEN],
            flows: vec![ReceiveFlow {
                sender: CTX,
                buffers: vec![(lease, desc)],
            }],
            request_info: b"fuzz".to_vec(),
            timeout: None,
        },
    )
    .expect("start_receive");

    let (mut gen_done, mut ctx_done) = (None, None);
    for round in 0..64 {
        if round == 0 || round == 2 {
            for f in intruder {
                // Errors are the expected answer to garbage; only panics and effects matter.
                let _ = gen.handle_frame(now, STRANGER, f);
                let _ = ctx.handle_frame(now, STRANGER, f);
            }
        }
        let mut moved = false;
        while let Some(t) = gen.poll_transmit() {
            moved = true;
            let bytes = t.message.to_bytes().expect("own message must encode");
            match t.to {
                CTX => ctx
                    .handle_frame(now, GEN, &bytes)
                    .expect("ctx takes gen's frame"),
                // Answers to the stranger's own requests (its advertisement, its vote) are
                // fine; anything about our request is not.
                STRANGER => assert_ne!(t.message.key(), Some(key), "gen told rank 7: {t:?}"),
                other => panic!("gen sent to unknown {other}: {t:?}"),
            }
        }
        while let Some(t) = ctx.poll_transmit() {
            moved = true;
            let bytes = t.message.to_bytes().expect("own message must encode");
            match t.to {
                GEN => gen
                    .handle_frame(now, CTX, &bytes)
                    .expect("gen takes ctx's frame"),
                STRANGER => assert_ne!(t.message.key(), Some(key), "ctx told rank 7: {t:?}"),
                other => panic!("ctx sent to unknown {other}: {t:?}"),
            }
        }
        while let Some(a) = ctx.poll_action() {
            moved = true;
            match a {
                Action::Send {
                    key: k,
                    to,
                    desc: d,
                } => {
                    assert_eq!(
                        (k, to, d),
                        (key, GEN, desc),
                        "ctx sends what it was not asked"
                    );
                    gen.handle_segment_landed(now, k, d.segment)
                        .expect("landing");
                    ctx.handle_send_done(now, k, to, d.segment, true)
                        .expect("send done");
                }
                Action::AbortSend {
                    key: k,
                    to,
                    segment,
                } => {
                    ctx.handle_send_done(now, k, to, segment, false)
                        .expect("abort");
                }
                other => panic!("ctx asked for {other:?}"),
            }
        }
        while let Some(a) = gen.poll_action() {
            moved = true;
            match a {
                Action::Release { key: k, lease: l } => {
                    assert_eq!(k, key);
                    pool.release(l).expect("release a live lease");
                }
                other => panic!("gen asked for {other:?} on a clean request"),
            }
        }
        while let Some(ev) = ctx.poll_event() {
            moved = true;
            match ev {
                Event::Advertised { key: k, from, .. } if from == GEN => {
                    ctx.accept(now, k, from, true).expect("accept")
                }
                Event::Terminal {
                    key: k,
                    role: Role::Sender { receiver },
                    outcome,
                    ..
                } if k == key && receiver == GEN => {
                    assert!(ctx_done.replace(outcome).is_none(), "two terminals at ctx");
                }
                Event::Terminal { role, .. } => {
                    assert_ne!(role, Role::Receiver, "ctx has no receive: {ev:?}")
                }
                // The stranger may advertise and notify; nobody answers it here.
                Event::Advertised { .. } | Event::Notified { .. } => {}
            }
        }
        while let Some(ev) = gen.poll_event() {
            moved = true;
            match ev {
                Event::Terminal {
                    key: k,
                    role: Role::Receiver,
                    outcome,
                    ..
                } => {
                    assert_eq!(k, key, "gen ended a receive it never started: {ev:?}");
                    assert!(gen_done.replace(outcome).is_none(), "two terminals at gen");
                }
                Event::Terminal { .. } | Event::Advertised { .. } | Event::Notified { .. } => {}
            }
        }
        if gen_done.is_some() && ctx_done.is_some() {
            break;
        }
        if !moved {
            // Nothing left to deliver: let retransmits and deadlines fire (well within 60 s).
            now += cfg.retransmit;
            gen.handle_timeout(now);
            ctx.handle_timeout(now);
        }
    }
    assert!(
        now.duration_since(t0) < Duration::from_secs(10),
        "took {:?}",
        now.duration_since(t0)
    );
    assert_eq!(gen_done, Some(Outcome::Completed), "generation side");
    assert_eq!(ctx_done, Some(Outcome::Completed), "context side");
    pool.check_all_returned().expect("buffer back in the pool");
}

/// A stranger without the secret talks to a rank that holds one: it must never be bound.
fn stranger_is_never_bound(frames: &[Vec<u8>]) {
    let me = Identity {
        rank: RankId(1),
        name: "ctx".into(),
        instance: 77,
        secret: Secret::new(b"deployment secret".to_vec()),
    };
    let mut answering = Handshake::answer(1234);
    let (mut dialling, _) = Handshake::dial(&me, 5678);
    for f in frames {
        let Ok(msg) = Message::decode(f) else {
            continue;
        };
        if msg.key().is_some() {
            continue; // not a handshake message: the engine never hands it to a handshake
        }
        for hs in [&mut answering, &mut dialling] {
            let _ = hs.handle(&me, msg.clone());
            // The engine would now decide; say yes, as if the rank were free.
            let _ = hs.accept(&me, None);
            assert!(hs.peer().is_none(), "a stranger was bound: {msg:?}");
        }
    }
}

/// A member of the deployment (it holds the secret).
fn member(rank: u32, instance: u64) -> Identity {
    Identity {
        rank: RankId(rank),
        name: format!("r{rank}"),
        instance,
        secret: Secret::new(b"deployment secret".to_vec()),
    }
}

/// The first message the actions send.
fn sent(out: Vec<HandshakeAction<u64>>) -> Message {
    out.into_iter()
        .find_map(|a| match a {
            HandshakeAction::Send(m) => Some(m),
            _ => None,
        })
        .expect("a message to send")
}

fn stranger_moves_no_binding(frames: &[Vec<u8>]) {
    let now = Instant::now();
    let me = member(1, 77);
    let mut peers: Peers<u64> = Peers::default();
    // Rank 2 dialled this side (endpoint 10).
    let them = member(2, 88);
    peers.accepted(10, None, now);
    let (mut theirs, hello) = Handshake::dial(&them, 3);
    let answer = sent(peers.on_handshake(&me, 10, hello, now, 4));
    assert!(matches!(
        theirs.handle(&them, answer),
        Step::Verified { .. }
    ));
    let proof = theirs.accept(&them, None).unwrap();
    let _ = peers.on_handshake(&me, 10, proof, now, 5);
    // This side dialled rank 3 (endpoint 11).
    let other = member(3, 99);
    let (hs, hello) = Handshake::dial(&me, 6);
    peers.handshakes.insert(11, hs);
    peers.handshake_started(11, now);
    let mut theirs = Handshake::answer(7);
    let Step::Reply(answer) = theirs.handle(&other, hello) else {
        panic!("no answer")
    };
    let proof = sent(peers.on_handshake(&me, 11, answer, now, 8));
    assert!(matches!(theirs.handle(&other, proof), Step::Proven { .. }));
    let welcome = theirs.accept(&other, None).unwrap();
    let _ = peers.on_handshake(&me, 11, welcome, now, 9);
    assert_eq!(peers.endpoint(RankId(2)), Some(10));
    assert_eq!(peers.endpoint(RankId(3)), Some(11));
    // The stranger: it dialled this side on 20, and this side dialled it on 21.
    peers.accepted(20, None, now);
    let (hs, _) = Handshake::dial(&me, 10);
    peers.handshakes.insert(21, hs);
    for f in frames {
        let Ok(msg) = Message::decode(f) else {
            continue;
        };
        if msg.key().is_some() {
            continue; // not a handshake message: the engine never hands it to a handshake
        }
        for ep in [20, 21] {
            for a in peers.on_handshake(&me, ep, msg.clone(), now, 11) {
                assert!(
                    !matches!(
                        a,
                        HandshakeAction::Bound(..)
                            | HandshakeAction::Lost(_)
                            | HandshakeAction::Close(10 | 11)
                    ),
                    "{a:?} after {msg:?} on {ep}"
                );
            }
            assert_eq!(peers.rank_of(ep), None, "the stranger was bound: {msg:?}");
        }
        assert_eq!(peers.endpoint(RankId(2)), Some(10), "moved by {msg:?}");
        assert_eq!(peers.endpoint(RankId(3)), Some(11), "moved by {msg:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let hello = frame(1, data);
    check_hello_frame(&hello);
    check_hello_value(data);

    let mut intruder = vec![data.to_vec(), hello];
    if let Some((&t, body)) = data.split_first() {
        // Every other message type around the same bytes (1..=10), so bodies reach the endpoint.
        intruder.push(frame(t % 10 + 1, body));
    }
    let mut hs_frames = intruder.clone();
    for t in [8u8, 9, 10] {
        hs_frames.push(frame(t, data));
    }
    stranger_is_never_bound(&hs_frames);
    stranger_moves_no_binding(&hs_frames);
    // The request is the one the stranger's frame names, when it names one: its messages then
    // aim at live state instead of missing it by key.
    let key = Message::decode(data)
        .ok()
        .and_then(|m| m.key())
        .unwrap_or(RequestKey::new(42, 3));
    request_survives_stranger(key, &intruder);
});
