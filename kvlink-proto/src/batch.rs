//! The format of a control batch: several control messages (whole frames, see [`crate::wire`])
//! sent to one peer as one transport message. The transport batches the messages to a peer whose
//! receive queue is full (kvlink's `transport::ucx::batch` says when); the receiver hands them on
//! one by one ([`split`]), and a batch that does not split exactly is dropped whole. Wire version
//! 4 ([`crate::wire::VERSION`]) marks the peers that take batches.
//!
//! Each message is its length (4 bytes, little-endian) and its bytes, 1..=[`MSG_MAX`] of them;
//! the whole batch, lengths included, is at most [`BATCH_MAX`] bytes. Its bytes come from a
//! peer: [`split`] never panics, sizes nothing by a length it reads (its list grows only by
//! messages present in the bytes), and accounts for every byte or refuses the batch.
use smallvec::SmallVec;

/// The longest batch, its lengths included: well within one eager fragment of the
/// shared-memory and tcp transports (8 KiB segments).
pub const BATCH_MAX: usize = 4096;

const LEN_BYTES: usize = 4;

/// The longest message that is batched (a longer one goes alone, after the batch).
pub const MSG_MAX: usize = BATCH_MAX - LEN_BYTES;

/// Whether `msg` fits in `batch` without taking it past [`BATCH_MAX`].
pub fn fits(batch: &[u8], msg: &[u8]) -> bool {
    batch.len() + LEN_BYTES + msg.len() <= BATCH_MAX
}

/// Appends `msg` (1..=[`MSG_MAX`] bytes) to `batch`.
pub fn push(batch: &mut Vec<u8>, msg: &[u8]) {
    debug_assert!(!msg.is_empty() && msg.len() <= MSG_MAX);
    batch.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    batch.extend_from_slice(msg);
}

/// The messages of a batch, in order; None unless the batch is at most [`BATCH_MAX`] bytes of
/// one or more messages, each 1..=[`MSG_MAX`] bytes, that end exactly at its end.
pub fn split(mut bytes: &[u8]) -> Option<SmallVec<[&[u8]; 16]>> {
    let mut out = SmallVec::new();
    if bytes.len() > BATCH_MAX {
        return None;
    }
    while !bytes.is_empty() {
        let (len, rest) = bytes.split_first_chunk::<LEN_BYTES>()?;
        let len = u32::from_le_bytes(*len) as usize;
        if len == 0 || len > MSG_MAX || len > rest.len() {
            return None;
        }
        let (msg, rest) = rest.split_at(len);
        out.push(msg);
        bytes = rest;
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_batch_splits_into_its_messages_and_a_bad_one_into_nothing() {
        let mut b = Vec::new();
        push(&mut b, b"one");
        push(&mut b, &[7u8; MSG_MAX - 20]);
        push(&mut b, b"x");
        let parts = split(&b).unwrap();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0], b"one");
        assert_eq!(parts[1], &[7u8; MSG_MAX - 20][..]);
        assert_eq!(parts[2], b"x");
        // Empty; cut inside a length or inside a message; one byte too many; a zero length; a
        // length over the bound; a whole batch over the bound.
        assert!(split(&[]).is_none());
        assert!(split(&b[..2]).is_none());
        assert!(split(&b[..b.len() - 1]).is_none());
        assert!(split(&[b.as_slice(), &[0]].concat()).is_none());
        assert!(split(&[0, 0, 0, 0]).is_none());
        let mut long = ((MSG_MAX + 1) as u32).to_le_bytes().to_vec();
        long.extend(std::iter::repeat_n(1u8, MSG_MAX + 1));
        assert!(split(&long).is_none());
        let mut big = Vec::new();
        while big.len() <= BATCH_MAX {
            push(&mut big, &[3u8; 1000]);
        }
        assert!(split(&big).is_none());
        // The largest message fits an empty batch exactly, and nothing fits after it.
        let mut full = Vec::new();
        assert!(fits(&full, &[1u8; MSG_MAX]) && !fits(&full, &[1u8; MSG_MAX + 1]));
        push(&mut full, &[1u8; MSG_MAX]);
        assert_eq!(full.len(), BATCH_MAX);
        assert!(!fits(&full, b"x"));
        assert_eq!(split(&full).unwrap().len(), 1);
    }

    proptest! {
        #[test]
        fn what_is_pushed_splits_back_whole_and_in_order(
            // At most 35 x (4 + 99) bytes: within one batch.
            msgs in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..100), 1..36)
        ) {
            let mut b = Vec::new();
            for m in &msgs {
                push(&mut b, m);
            }
            let parts = split(&b).unwrap();
            prop_assert_eq!(parts.len(), msgs.len());
            for (p, m) in parts.iter().zip(&msgs) {
                prop_assert_eq!(*p, m.as_slice());
            }
        }

        /// A good batch with one byte changed, or cut short, or with bytes added: split whole
        /// into messages that account for every byte, or refused.
        #[test]
        fn a_damaged_batch_splits_exactly_or_not_at_all(
            msgs in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..200), 1..12),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
            how in 0u8..3,
        ) {
            let mut b = Vec::new();
            for m in &msgs {
                push(&mut b, m);
            }
            let i = at.index(b.len());
            match how {
                0 => b[i] = byte,
                1 => b.truncate(i),
                _ => b.splice(i..i, [byte; 3]).for_each(drop),
            }
            let parts = split(&b).map(|p| p.iter().map(|m| m.len()).collect::<Vec<_>>());
            if let Some(lens) = parts {
                let total: usize = lens.iter().map(|l| l + LEN_BYTES).sum();
                prop_assert_eq!(total, b.len());
                prop_assert!(lens.iter().all(|&l| l > 0 && l <= MSG_MAX));
            }
        }

        #[test]
        fn any_bytes_split_without_panicking_into_messages_that_fit(
            bytes in prop::collection::vec(any::<u8>(), 0..600)
        ) {
            if let Some(parts) = split(&bytes) {
                let total: usize = parts.iter().map(|p| p.len() + LEN_BYTES).sum();
                prop_assert_eq!(total, bytes.len());
                prop_assert!(parts.iter().all(|p| !p.is_empty() && p.len() <= MSG_MAX));
            }
        }
    }
}
