//! The versioned wire codec for every control message.
//!
//! # Frame layout (all integers little-endian, fixed width)
//! ```text
//! offset size field
//!      0    4 magic      b"KVLK"
//!      4    2 version    4 (3: the same frames, but a peer that cannot take several control
//!                        messages in one UCX active message, which 4 may send; 2: Hello
//!                        without instance, challenge and proof; 1: Advertise without
//!                        timeout_ms)
//!      6    1 type       1 Hello, 2 Advertise, 3 Ready, 4 Notify, 5 Vote, 6 Verdict, 7 Quiesced,
//!                        8 Proof, 9 Welcome, 10 Refuse, 11 Leaving
//!      7    1 flags      0 (any other value is rejected)
//!      8    4 body_len   exact number of body bytes that follow, <= MAX_BODY
//!     12    . body
//! ```
//! Bodies (`key` = request u64, generation u32):
//! ```text
//! Hello     rank u32, instance u64, challenge u64, has_proof u8 (0 | 1), proof (32 bytes, if
//!           has_proof), name_len u16, name (UTF-8, 1..=MAX_NAME bytes)
//! Advertise key, src_rank u32, timeout_ms u32 (1..), info_len u32, info (<= MAX_INFO), count u16 (1..=MAX_BUFFERS),
//!           count x BufferDesc { kind u8, segment u32, addr u64, len u64, device_id i32,
//!                                token u64 }                                      (33 bytes)
//! Ready     key, ready u8 (0 | 1)
//! Notify    key, payload_len u32, payload (<= MAX_PAYLOAD)
//! Vote      key, outcome u8 (error::Outcome numbering)
//! Verdict   key, outcome u8
//! Quiesced  key
//! Proof     proof (32 bytes), has_resume u8 (0 | 1), resume proof (32 bytes, if has_resume)
//! Welcome   (empty)
//! Refuse    reason u8 (1 auth failed, 2 rank in use, 3 wire version)
//! Leaving   (empty)
//! ```
//! `Hello`, `Proof`, `Welcome` and `Refuse` make the handshake ([`super::handshake`]).
//! `Leaving` came after version 4's other frames without a version step: a release of version 4
//! from before it counts the frame as undecodable (`UnknownType(11)`) and drops it, and learns
//! of the leave as it did before, when the connection fails. A rank told `Leaving` answers with
//! its own `Leaving` before it closes the connection; the leaving rank takes that as the sign its
//! message arrived (it closes after it, so its close cannot overtake the message), and answers
//! nothing.
//! One frame is read whatever version its header names: a `Refuse` of reason 3 (12 header bytes
//! with type 10, flags 0 and body_len 1, then the byte 3). Every version keeps that frame as it
//! is, so a rank of another version that dials learns why it was refused (at once, as the typed
//! error [`ErrorKind::Protocol`]) instead of waiting for a handshake that cannot finish; the
//! header's version field tells it which version the refusing side speaks.
//! Decoding never panics and never allocates more than the bytes actually present: every length
//! is checked against both its hard cap and the remaining input before anything is reserved. A
//! frame must be consumed exactly; trailing bytes are an error. Encoding applies the same limits,
//! so kvlink never emits a frame it would refuse.
use std::fmt;

use super::auth::PROOF_LEN;
use super::id::{Generation, RankId, RequestId, RequestKey, Token};
use crate::error::{Error, ErrorKind, Outcome};

pub const MAGIC: [u8; 4] = *b"KVLK";
pub const VERSION: u16 = 4;
pub const HEADER_LEN: usize = 12;
/// Largest body accepted.
pub const MAX_BODY: usize = 2 << 20;
/// Largest agent name in `Hello`.
pub const MAX_NAME: usize = 256;
/// Largest opaque TensorRT-LLM request info in `Advertise`.
pub const MAX_INFO: usize = 1 << 20;
/// Most buffer descriptors in one `Advertise`.
pub const MAX_BUFFERS: usize = 1024;
/// Largest `Notify` payload.
pub const MAX_PAYLOAD: usize = 64 << 10;
const DESC_LEN: usize = 33;

/// What kind of cache a buffer holds (TensorRT-LLM's buffer kinds).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferKind {
    Kv = 0,
    KvIndexer = 1,
    Rnn = 2,
}

impl BufferKind {
    pub fn from_u8(v: u8) -> Option<BufferKind> {
        match v {
            0 => Some(BufferKind::Kv),
            1 => Some(BufferKind::KvIndexer),
            2 => Some(BufferKind::Rnn),
            _ => None,
        }
    }
}

/// One receive buffer a generation rank advertises. `token` is the tag of the posted receive
/// that will take this segment's data (see [`super::id`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferDesc {
    pub kind: BufferKind,
    pub segment: u32,
    pub addr: u64,
    pub len: u64,
    /// CUDA device ordinal, or -1 for host memory.
    pub device_id: i32,
    pub token: Token,
}

impl BufferDesc {
    /// The checks the decoder applies to every descriptor.
    pub fn validate(&self) -> Result<(), WireReason> {
        if self.len == 0 {
            return Err(WireReason::ZeroLength);
        }
        if self.addr.checked_add(self.len).is_none() {
            return Err(WireReason::AddressOverflow);
        }
        if self.device_id < -1 {
            return Err(WireReason::BadDeviceId);
        }
        Ok(())
    }
}

/// Every control message kvlink sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// First message on a connection each way: who is speaking, its instance (a nonce drawn at
    /// start, which keys its tags), a fresh challenge for the peer, and (from the side that
    /// answers a `Hello`) its proof for the peer's challenge.
    Hello {
        agent_name: String,
        rank: RankId,
        instance: u64,
        challenge: u64,
        proof: Option<[u8; PROOF_LEN]>,
    },
    /// Generation side -> context side: the request and the receive buffers for it.
    Advertise {
        key: RequestKey,
        src_rank: RankId,
        /// What is left of the request's deadline when this frame was sent, in milliseconds
        /// (at least 1): the sender's deadline for the request.
        timeout_ms: u32,
        request_info: Vec<u8>,
        buffers: Vec<BufferDesc>,
    },
    /// Context side -> generation side: accept (`true`) or reject before any data moves.
    Ready { key: RequestKey, ready: bool },
    /// A generic ordered notification for the request.
    Notify { key: RequestKey, payload: Vec<u8> },
    /// A rank's local result for the request (receiver -> coordinator, sender -> its receiver).
    Vote { key: RequestKey, outcome: Outcome },
    /// The agreed result (coordinator -> receivers, receiver -> its senders).
    Verdict { key: RequestKey, outcome: Outcome },
    /// Sender -> receiver: the verdict is known here and every send of this request to you has
    /// finished or been aborted; nothing more will be sent for this key.
    Quiesced { key: RequestKey },
    /// Handshake, dialling side: its proof for the challenge in the answering `Hello`, and (when
    /// it held a session with that rank before) its proof that it still holds that session.
    Proof {
        proof: [u8; PROOF_LEN],
        resume: Option<[u8; PROOF_LEN]>,
    },
    /// Handshake, answering side: the dialler's proof holds and its rank is bound here.
    Welcome,
    /// Handshake: this side will not bind the peer, and closes the connection.
    Refuse { reason: Refusal },
    /// This side is going away (its engine is being dropped): close the connection and end the
    /// requests on it now. Over shared memory nothing else would tell the peer while the
    /// process lives on (UCX's keepalive checks the process).
    Leaving,
}

/// Why a handshake was refused.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The peer's proof did not verify: it does not hold this deployment's secret.
    AuthFailed = 1,
    /// The peer's rank is bound here to another live process, or is the answering engine's
    /// own.
    RankInUse = 2,
    /// The peer's frames carry a wire version this side does not speak. Sent in the one frame
    /// every version reads (see the module docs).
    WireVersion = 3,
}

impl Refusal {
    pub fn from_u8(v: u8) -> Option<Refusal> {
        match v {
            1 => Some(Refusal::AuthFailed),
            2 => Some(Refusal::RankInUse),
            3 => Some(Refusal::WireVersion),
            _ => None,
        }
    }

    /// The typed error a refusal is reported as.
    pub fn kind(self) -> ErrorKind {
        match self {
            Refusal::AuthFailed => ErrorKind::AuthFailed,
            Refusal::RankInUse => ErrorKind::RankInUse,
            Refusal::WireVersion => ErrorKind::Protocol,
        }
    }

    /// Why, in words, for errors and logs.
    pub fn describe(self) -> &'static str {
        match self {
            Refusal::AuthFailed => {
                "a proof did not verify: the two sides hold different deployment secrets, or one \
                 holds none"
            }
            Refusal::RankInUse => {
                "the rank is bound to another live process, or is the dialled engine's own (rank \
                 ids must be unique in a deployment)"
            }
            Refusal::WireVersion => {
                "the two sides speak different wire versions (kvlink releases that cannot talk)"
            }
        }
    }
}

/// The wire version a frame's header names, if the frame starts with kvlink's magic (for
/// reports about a peer of another version: [`Message::decode`] refuses its frames).
pub fn frame_version(bytes: &[u8]) -> Option<u16> {
    (bytes.len() >= 6 && bytes[..4] == MAGIC).then(|| u16::from_le_bytes([bytes[4], bytes[5]]))
}

/// Whether a header (at least [`HEADER_LEN`] bytes) is that of the frame every version reads: a
/// `Refuse` with a one-byte body.
fn version_neutral(prefix: &[u8]) -> bool {
    prefix[6] == 10 && prefix[7] == 0 && prefix[8..12] == 1u32.to_le_bytes()
}

impl Message {
    /// The request a message is about (`None` for the handshake).
    pub fn key(&self) -> Option<RequestKey> {
        match self {
            Message::Hello { .. }
            | Message::Proof { .. }
            | Message::Welcome
            | Message::Refuse { .. }
            | Message::Leaving => None,
            Message::Advertise { key, .. }
            | Message::Ready { key, .. }
            | Message::Notify { key, .. }
            | Message::Vote { key, .. }
            | Message::Verdict { key, .. }
            | Message::Quiesced { key } => Some(*key),
        }
    }

    fn type_code(&self) -> u8 {
        match self {
            Message::Hello { .. } => 1,
            Message::Advertise { .. } => 2,
            Message::Ready { .. } => 3,
            Message::Notify { .. } => 4,
            Message::Vote { .. } => 5,
            Message::Verdict { .. } => 6,
            Message::Quiesced { .. } => 7,
            Message::Proof { .. } => 8,
            Message::Welcome => 9,
            Message::Refuse { .. } => 10,
            Message::Leaving => 11,
        }
    }

    /// Encodes one frame onto `out`. Fails (and leaves `out` unchanged) when a field breaks a
    /// limit the decoder enforces.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
        let start = out.len();
        // The header, its length field filled in once the body is written after it: one
        // buffer, grown at most once for all but the largest messages.
        out.reserve(HEADER_LEN + 64);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(self.type_code());
        out.push(0);
        out.extend_from_slice(&[0; 4]);
        let body_start = out.len();
        if let Err(e) = self.encode_body(out) {
            out.truncate(start);
            return Err(e);
        }
        let len = (out.len() - body_start) as u32;
        out[body_start - 4..body_start].copy_from_slice(&len.to_le_bytes());
        Ok(())
    }

    /// The body of the frame, after the header (see [`Message::encode`]).
    /// The limits a frame of this message must keep, as `decode` enforces them on what
    /// arrives: a name of 1 to `MAX_NAME` bytes, an advertisement with a positive timeout, at
    /// most `MAX_INFO` bytes of request info and 1 to `MAX_BUFFERS` valid buffers with distinct
    /// segments and tokens, a notification of at most `MAX_PAYLOAD` bytes. `encode` refuses a
    /// message that breaks them, and so does the endpoint when a message is handed to it
    /// without a frame (`Endpoint::handle_message`).
    pub fn check(&self) -> Result<(), WireReason> {
        match self {
            Message::Hello { agent_name, .. }
                if agent_name.is_empty() || agent_name.len() > MAX_NAME =>
            {
                Err(WireReason::TooLarge)
            }
            Message::Advertise {
                timeout_ms,
                request_info,
                buffers,
                ..
            } => {
                if *timeout_ms == 0 {
                    return Err(WireReason::ZeroTimeout);
                }
                if request_info.len() > MAX_INFO || buffers.len() > MAX_BUFFERS {
                    return Err(WireReason::TooLarge);
                }
                if buffers.is_empty() {
                    return Err(WireReason::NoBuffers);
                }
                check_descs(buffers)
            }
            Message::Notify { payload, .. } if payload.len() > MAX_PAYLOAD => {
                Err(WireReason::TooLarge)
            }
            _ => Ok(()),
        }
    }

    fn encode_body(&self, body: &mut Vec<u8>) -> Result<(), WireError> {
        self.check()
            .map_err(|reason| WireError { reason, offset: 0 })?;
        match self {
            Message::Hello {
                agent_name,
                rank,
                instance,
                challenge,
                proof,
            } => {
                body.extend_from_slice(&rank.0.to_le_bytes());
                body.extend_from_slice(&instance.to_le_bytes());
                body.extend_from_slice(&challenge.to_le_bytes());
                put_opt_proof(body, proof);
                body.extend_from_slice(&(agent_name.len() as u16).to_le_bytes());
                body.extend_from_slice(agent_name.as_bytes());
            }
            Message::Advertise {
                key,
                src_rank,
                timeout_ms,
                request_info,
                buffers,
            } => {
                body.reserve(30 + request_info.len() + buffers.len() * 33);
                put_key(body, key);
                body.extend_from_slice(&src_rank.0.to_le_bytes());
                body.extend_from_slice(&timeout_ms.to_le_bytes());
                body.extend_from_slice(&(request_info.len() as u32).to_le_bytes());
                body.extend_from_slice(request_info);
                body.extend_from_slice(&(buffers.len() as u16).to_le_bytes());
                for d in buffers {
                    body.push(d.kind as u8);
                    body.extend_from_slice(&d.segment.to_le_bytes());
                    body.extend_from_slice(&d.addr.to_le_bytes());
                    body.extend_from_slice(&d.len.to_le_bytes());
                    body.extend_from_slice(&d.device_id.to_le_bytes());
                    body.extend_from_slice(&d.token.0.to_le_bytes());
                }
            }
            Message::Ready { key, ready } => {
                put_key(body, key);
                body.push(*ready as u8);
            }
            Message::Notify { key, payload } => {
                put_key(body, key);
                body.extend_from_slice(&(payload.len() as u32).to_le_bytes());
                body.extend_from_slice(payload);
            }
            Message::Vote { key, outcome } | Message::Verdict { key, outcome } => {
                put_key(body, key);
                body.push(*outcome as u8);
            }
            Message::Quiesced { key } => put_key(body, key),
            Message::Proof { proof, resume } => {
                body.extend_from_slice(proof);
                put_opt_proof(body, resume);
            }
            Message::Welcome | Message::Leaving => {}
            Message::Refuse { reason } => body.push(*reason as u8),
        }
        Ok(())
    }

    /// Encodes one frame into a fresh vector.
    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        let mut out = Vec::new();
        self.encode(&mut out)?;
        Ok(out)
    }

    /// Decodes exactly one frame; `bytes` must hold that frame and nothing else.
    pub fn decode(bytes: &[u8]) -> Result<Message, WireError> {
        let total = match frame_len(bytes)? {
            Some(n) => n,
            None => return Err(WireError::at(WireReason::Truncated, bytes.len())),
        };
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != VERSION
            && (bytes.len() != total || bytes[HEADER_LEN] != Refusal::WireVersion as u8)
        {
            // Of another version's frames only its version refusal, exactly, is read: anything
            // else (of any length) is refused for its version, which a dialler is told.
            return Err(WireError::at(WireReason::UnsupportedVersion(version), 4));
        }
        if bytes.len() < total {
            return Err(WireError::at(WireReason::Truncated, bytes.len()));
        }
        if bytes.len() > total {
            return Err(WireError::at(WireReason::TrailingBytes, total));
        }
        let mut r = Reader {
            buf: bytes,
            pos: HEADER_LEN,
        };
        let msg = match bytes[6] {
            1 => {
                let rank = RankId(r.u32()?);
                let instance = r.u64()?;
                let challenge = r.u64()?;
                let proof = r.opt_proof()?;
                let len = r.u16()? as usize;
                if len == 0 || len > MAX_NAME {
                    return Err(r.err(WireReason::TooLarge));
                }
                let at = r.pos;
                let raw = r.take(len)?;
                let agent_name = std::str::from_utf8(raw)
                    .map_err(|_| WireError::at(WireReason::BadUtf8, at))?
                    .to_owned();
                Message::Hello {
                    agent_name,
                    rank,
                    instance,
                    challenge,
                    proof,
                }
            }
            2 => {
                let key = r.key()?;
                let src_rank = RankId(r.u32()?);
                let at = r.pos;
                let timeout_ms = r.u32()?;
                if timeout_ms == 0 {
                    return Err(WireError::at(WireReason::ZeroTimeout, at));
                }
                let info_len = r.u32()? as usize;
                if info_len > MAX_INFO {
                    return Err(r.err(WireReason::TooLarge));
                }
                let request_info = r.take(info_len)?.to_vec();
                let count = r.u16()? as usize;
                if count == 0 {
                    return Err(r.err(WireReason::NoBuffers));
                }
                if count > MAX_BUFFERS {
                    return Err(r.err(WireReason::TooLarge));
                }
                if count * DESC_LEN > r.remaining() {
                    return Err(r.err(WireReason::Truncated));
                }
                let mut buffers = Vec::with_capacity(count);
                for _ in 0..count {
                    let at = r.pos;
                    let kind_raw = r.u8()?;
                    let kind = BufferKind::from_u8(kind_raw)
                        .ok_or(WireError::at(WireReason::BadBufferKind, at))?;
                    let d = BufferDesc {
                        kind,
                        segment: r.u32()?,
                        addr: r.u64()?,
                        len: r.u64()?,
                        device_id: r.u32()? as i32,
                        token: Token(r.u64()?),
                    };
                    d.validate().map_err(|reason| WireError::at(reason, at))?;
                    buffers.push(d);
                }
                check_descs(&buffers).map_err(|reason| r.err(reason))?;
                Message::Advertise {
                    key,
                    src_rank,
                    timeout_ms,
                    request_info,
                    buffers,
                }
            }
            3 => {
                let key = r.key()?;
                let at = r.pos;
                let ready = match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(WireError::at(WireReason::BadBool, at)),
                };
                Message::Ready { key, ready }
            }
            4 => {
                let key = r.key()?;
                let len = r.u32()? as usize;
                if len > MAX_PAYLOAD {
                    return Err(r.err(WireReason::TooLarge));
                }
                let payload = r.take(len)?.to_vec();
                Message::Notify { key, payload }
            }
            t @ (5 | 6) => {
                let key = r.key()?;
                let at = r.pos;
                let outcome =
                    outcome_from_u8(r.u8()?).ok_or(WireError::at(WireReason::BadOutcome, at))?;
                if t == 5 {
                    Message::Vote { key, outcome }
                } else {
                    Message::Verdict { key, outcome }
                }
            }
            7 => Message::Quiesced { key: r.key()? },
            8 => {
                let proof = r.proof()?;
                let resume = r.opt_proof()?;
                Message::Proof { proof, resume }
            }
            9 => Message::Welcome,
            10 => {
                let at = r.pos;
                let reason =
                    Refusal::from_u8(r.u8()?).ok_or(WireError::at(WireReason::BadRefusal, at))?;
                Message::Refuse { reason }
            }
            11 => Message::Leaving,
            _ => unreachable_type(),
        };
        if r.remaining() != 0 {
            return Err(r.err(WireReason::TrailingBytes));
        }
        Ok(msg)
    }
}

// `frame_len` has already rejected unknown types; keep the decoder total anyway.
fn unreachable_type() -> Message {
    Message::Quiesced {
        key: RequestKey::new(0, 0),
    }
}

/// Length of the frame that starts at `prefix[0]`, once its header is present: `Ok(None)` while
/// fewer than [`HEADER_LEN`] bytes are available. Validates the whole header, so a stream reader
/// never waits for (or allocates) a body whose header is already bad.
pub fn frame_len(prefix: &[u8]) -> Result<Option<usize>, WireError> {
    if prefix.len() < HEADER_LEN {
        // Reject a bad magic as early as its bytes are present.
        let n = prefix.len().min(4);
        if prefix[..n] != MAGIC[..n] {
            return Err(WireError::at(WireReason::BadMagic, 0));
        }
        return Ok(None);
    }
    if prefix[..4] != MAGIC {
        return Err(WireError::at(WireReason::BadMagic, 0));
    }
    let version = u16::from_le_bytes([prefix[4], prefix[5]]);
    if version != VERSION && !version_neutral(prefix) {
        return Err(WireError::at(WireReason::UnsupportedVersion(version), 4));
    }
    if !(1..=11).contains(&prefix[6]) {
        return Err(WireError::at(WireReason::UnknownType(prefix[6]), 6));
    }
    if prefix[7] != 0 {
        return Err(WireError::at(WireReason::BadFlags, 7));
    }
    let body = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as usize;
    if body > MAX_BODY {
        return Err(WireError::at(WireReason::TooLarge, 8));
    }
    Ok(Some(HEADER_LEN + body))
}

fn check_descs(buffers: &[BufferDesc]) -> Result<(), WireReason> {
    for d in buffers {
        d.validate()?;
    }
    if any_repeated(buffers.len(), |i| buffers[i].segment) {
        return Err(WireReason::DuplicateSegment);
    }
    if any_repeated(buffers.len(), |i| buffers[i].token) {
        return Err(WireReason::DuplicateToken);
    }
    Ok(())
}

/// Whether two of the `n` values `at(0..n)` are equal: pairwise for a few, sorted beyond, so a
/// list of [`MAX_BUFFERS`] descriptors costs n log n to check, not n².
pub(crate) fn any_repeated<T: Ord>(n: usize, at: impl Fn(usize) -> T) -> bool {
    if n <= 16 {
        return (1..n).any(|i| (0..i).any(|j| at(j) == at(i)));
    }
    let mut v: Vec<T> = (0..n).map(at).collect();
    v.sort_unstable();
    v.windows(2).any(|w| w[0] == w[1])
}

/// A flag byte (0 | 1), then the proof if there is one.
fn put_opt_proof(out: &mut Vec<u8>, proof: &Option<[u8; PROOF_LEN]>) {
    out.push(proof.is_some() as u8);
    if let Some(p) = proof {
        out.extend_from_slice(p);
    }
}

fn put_key(out: &mut Vec<u8>, key: &RequestKey) {
    out.extend_from_slice(&key.request.0.to_le_bytes());
    out.extend_from_slice(&key.generation.0.to_le_bytes());
}

pub(crate) fn outcome_from_u8(v: u8) -> Option<Outcome> {
    match v {
        0 => Some(Outcome::Completed),
        1 => Some(Outcome::TimedOut),
        2 => Some(Outcome::Cancelled),
        3 => Some(Outcome::PeerLost),
        4 => Some(Outcome::Rejected),
        _ => None,
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn err(&self, reason: WireReason) -> WireError {
        WireError::at(reason, self.pos)
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.remaining() {
            return Err(self.err(WireReason::Truncated));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn proof(&mut self) -> Result<[u8; PROOF_LEN], WireError> {
        self.array()
    }
    /// A flag byte (0 | 1), then a proof if it is 1.
    fn opt_proof(&mut self) -> Result<Option<[u8; PROOF_LEN]>, WireError> {
        let at = self.pos;
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.proof()?)),
            _ => Err(WireError::at(WireReason::BadBool, at)),
        }
    }
    fn key(&mut self) -> Result<RequestKey, WireError> {
        Ok(RequestKey {
            request: RequestId(self.u64()?),
            generation: Generation(self.u32()?),
        })
    }
}

/// Why a frame was refused. Every variant maps to [`ErrorKind::Protocol`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireReason {
    Truncated,
    BadMagic,
    UnsupportedVersion(u16),
    UnknownType(u8),
    BadFlags,
    /// A length or count beyond its hard cap.
    TooLarge,
    TrailingBytes,
    BadUtf8,
    BadBool,
    BadOutcome,
    BadBufferKind,
    BadDeviceId,
    ZeroLength,
    AddressOverflow,
    NoBuffers,
    DuplicateSegment,
    DuplicateToken,
    /// An `Advertise` whose deadline has no time left in it.
    ZeroTimeout,
    /// A `Refuse` with a reason this version does not know.
    BadRefusal,
}

/// A refused frame: the reason and the byte offset where decoding stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WireError {
    pub reason: WireReason,
    pub offset: usize,
}

impl WireError {
    fn at(reason: WireReason, offset: usize) -> Self {
        WireError { reason, offset }
    }
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::Protocol
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad frame: {:?} at byte {}", self.reason, self.offset)
    }
}

impl std::error::Error for WireError {}

impl From<WireError> for Error {
    fn from(e: WireError) -> Error {
        Error::new(ErrorKind::Protocol, e.to_string())
    }
}
