//! Who may speak and who may fill a buffer: the deployment secret, handshake proofs, and the
//! per-pair keys that turn a receive's token into its UCX tag.
//!
//! Pure functions of their inputs (no clock, no randomness): the engine supplies the random
//! challenges and instance nonces, so everything here is tested deterministically.
//!
//! # Proofs
//! With a deployment [`Secret`] `S`, a rank proves it holds `S` by answering the peer's fresh
//! 64-bit challenge with `HMAC-SHA256(S, "kvlink/proof/v1" | peer_challenge | own_challenge |
//! own_rank | own_instance)`. Without a secret the key is empty: the handshake runs the same
//! way and only proves that neither side has one, so one side with a secret and one without
//! never agree.
//!
//! # Tags
//! A receive's [`Token`] is sent to its sender in the `Advertise`, but the receive is posted
//! under `tag = SipHash-2-4(K, token)` with `K = HMAC-SHA256(S, "kvlink/tag/v1" |
//! receiver_instance | sender_instance)[..16]`. The instances are the 64-bit nonces each engine
//! draws at start and gives in its `Hello`. A process that learns a token (by guessing, or by
//! seeing it in a log) but is not the peer the buffer was offered to cannot name its tag: its
//! data matches no receive. With a secret, even a process that sees the whole handshake cannot
//! derive `K`.
use hmac::{Hmac, Mac};
use sha2::Sha256;
use siphasher::sip::SipHasher24;
use std::fmt;
use std::hash::Hasher;

use super::id::{RankId, Token};

type HmacSha256 = Hmac<Sha256>;

/// Length of a handshake proof (HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

/// The deployment secret shared by every rank allowed to join; empty means none.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Secret {
        Secret(bytes.into())
    }

    pub fn none() -> Secret {
        Secret(Vec::new())
    }

    pub fn is_set(&self) -> bool {
        !self.0.is_empty()
    }

    fn mac(&self, label: &[u8]) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        m.update(label);
        m
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret itself.
        f.write_str(if self.is_set() {
            "Secret(set)"
        } else {
            "Secret(none)"
        })
    }
}

fn proof_mac(
    secret: &Secret,
    challenge_of_verifier: u64,
    challenge_of_prover: u64,
    rank: RankId,
    instance: u64,
) -> HmacSha256 {
    let mut m = secret.mac(b"kvlink/proof/v1");
    m.update(&challenge_of_verifier.to_le_bytes());
    m.update(&challenge_of_prover.to_le_bytes());
    m.update(&rank.0.to_le_bytes());
    m.update(&instance.to_le_bytes());
    m
}

/// The proof a rank (`my_rank`, `my_instance`) sends in answer to `peer_challenge`.
pub fn proof(
    secret: &Secret,
    peer_challenge: u64,
    my_challenge: u64,
    my_rank: RankId,
    my_instance: u64,
) -> [u8; PROOF_LEN] {
    proof_mac(secret, peer_challenge, my_challenge, my_rank, my_instance)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a peer's proof against the challenge this side sent (constant time).
pub fn verify(
    secret: &Secret,
    my_challenge: u64,
    peer_challenge: u64,
    peer_rank: RankId,
    peer_instance: u64,
    proof: &[u8; PROOF_LEN],
) -> bool {
    proof_mac(
        secret,
        my_challenge,
        peer_challenge,
        peer_rank,
        peer_instance,
    )
    .verify_slice(proof)
    .is_ok()
}

/// The key that maps one receiver's tokens to tags for one sender (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TagKey([u8; 16]);

impl TagKey {
    pub fn derive(secret: &Secret, receiver_instance: u64, sender_instance: u64) -> TagKey {
        let mut m = secret.mac(b"kvlink/tag/v1");
        m.update(&receiver_instance.to_le_bytes());
        m.update(&sender_instance.to_le_bytes());
        let out = m.finalize().into_bytes();
        let mut k = [0u8; 16];
        k.copy_from_slice(&out[..16]);
        TagKey(k)
    }

    /// The UCX tag of the receive with `token`.
    pub fn tag(&self, token: Token) -> u64 {
        let mut h = SipHasher24::new_with_key(&self.0);
        h.write_u64(token.0);
        h.finish()
    }
}

impl fmt::Debug for TagKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TagKey(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proof_verifies_only_with_the_same_secret_and_inputs() {
        let s = Secret::new(b"deployment".to_vec());
        let p = proof(&s, 11, 22, RankId(3), 0xabc);
        assert!(verify(&s, 11, 22, RankId(3), 0xabc, &p));
        assert!(!verify(
            &Secret::new(b"other".to_vec()),
            11,
            22,
            RankId(3),
            0xabc,
            &p
        ));
        assert!(!verify(&Secret::none(), 11, 22, RankId(3), 0xabc, &p));
        assert!(
            !verify(&s, 12, 22, RankId(3), 0xabc, &p),
            "another challenge"
        );
        assert!(!verify(&s, 11, 22, RankId(4), 0xabc, &p), "another rank");
        assert!(
            !verify(&s, 11, 22, RankId(3), 0xabd, &p),
            "another instance"
        );
        let mut bad = p;
        bad[31] ^= 1;
        assert!(!verify(&s, 11, 22, RankId(3), 0xabc, &bad));
        // Without a secret on both sides the handshake still agrees.
        let n = proof(&Secret::none(), 1, 2, RankId(0), 9);
        assert!(verify(&Secret::none(), 1, 2, RankId(0), 9, &n));
    }

    #[test]
    fn tags_depend_on_the_pair_the_direction_and_the_secret() {
        let none = Secret::none();
        let k = TagKey::derive(&none, 1, 2);
        assert_eq!(k.tag(Token(5)), TagKey::derive(&none, 1, 2).tag(Token(5)));
        assert_ne!(k.tag(Token(5)), k.tag(Token(6)));
        assert_ne!(k.tag(Token(5)), TagKey::derive(&none, 2, 1).tag(Token(5)));
        assert_ne!(k.tag(Token(5)), TagKey::derive(&none, 1, 3).tag(Token(5)));
        let s = Secret::new(b"x".to_vec());
        assert_ne!(k.tag(Token(5)), TagKey::derive(&s, 1, 2).tag(Token(5)));
        assert_ne!(k.tag(Token(5)), 5, "the token is not its own tag");
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let s = Secret::new(b"hunter2".to_vec());
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
