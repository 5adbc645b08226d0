//! Who may speak and who may fill a buffer: the deployment secret, handshake proofs, the
//! session key of a bound pair, and the keys that turn a receive's token into its UCX tag.
//!
//! Pure functions of their inputs (no clock, no randomness): the engine supplies the random
//! challenges and instance nonces, so everything here is tested deterministically.
//!
//! # Proofs
//! With a deployment [`Secret`] `S`, a rank proves it holds `S` by answering the peer's fresh
//! 64-bit challenge with `HMAC-SHA256(S, "kvlink/proof/<role>/v1" | verifier's challenge |
//! prover's challenge | prover's rank | prover's instance)`, where `<role>` is `dialler` or
//! `answerer`: a proof cannot be reflected back to the side that made it. Without a secret the
//! key is empty: the handshake runs the same way, so one side with a secret and one without
//! never agree.
//!
//! # Sessions and tags
//! A bound pair shares a [`SessionKey`]: `HMAC-SHA256(S, "kvlink/session/v1" | both challenges |
//! both instances | both ranks)`. The challenges are fresh per connection and cross only that
//! connection, so a process that is not on it cannot compute the key even without a secret (and
//! with a secret, not even a process that sees the traffic, unless it holds the secret too). A receive's [`Token`] goes to its
//! sender in the `Advertise`, but the receive is posted under `tag = SipHash-2-4(K, token)`
//! with `K` derived from the session key and the direction ([`SessionKey::tag_key`]): a process
//! that learns a token (by guessing, or from a log) cannot name its tag.
//!
//! A process that reconnects while the other side still holds its old connection proves it is
//! the same session with a resume proof ([`SessionKey::resume_proof`]) over the new challenges.
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

/// Which side of a handshake made a proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Dialler,
    Answerer,
}

fn proof_mac(
    secret: &Secret,
    side: Side,
    challenge_of_verifier: u64,
    challenge_of_prover: u64,
    rank: RankId,
    instance: u64,
) -> HmacSha256 {
    let mut m = secret.mac(match side {
        Side::Dialler => b"kvlink/proof/dialler/v1",
        Side::Answerer => b"kvlink/proof/answerer/v1",
    });
    m.update(&challenge_of_verifier.to_le_bytes());
    m.update(&challenge_of_prover.to_le_bytes());
    m.update(&rank.0.to_le_bytes());
    m.update(&instance.to_le_bytes());
    m
}

/// The proof a rank (`my_rank`, `my_instance`, on `side`) sends in answer to `peer_challenge`.
pub fn proof(
    secret: &Secret,
    side: Side,
    peer_challenge: u64,
    my_challenge: u64,
    my_rank: RankId,
    my_instance: u64,
) -> [u8; PROOF_LEN] {
    proof_mac(
        secret,
        side,
        peer_challenge,
        my_challenge,
        my_rank,
        my_instance,
    )
    .finalize()
    .into_bytes()
    .into()
}

/// Checks a proof made by the peer on `peer_side` against the challenge this side sent
/// (constant time).
pub fn verify(
    secret: &Secret,
    peer_side: Side,
    my_challenge: u64,
    peer_challenge: u64,
    peer_rank: RankId,
    peer_instance: u64,
    proof: &[u8; PROOF_LEN],
) -> bool {
    proof_mac(
        secret,
        peer_side,
        my_challenge,
        peer_challenge,
        peer_rank,
        peer_instance,
    )
    .verify_slice(proof)
    .is_ok()
}

/// One side of a handshake as the session key sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Party {
    pub rank: RankId,
    pub instance: u64,
    pub challenge: u64,
}

/// The key a bound pair shares (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SessionKey([u8; 32]);

impl SessionKey {
    pub fn derive(secret: &Secret, dialler: Party, answerer: Party) -> SessionKey {
        let mut m = secret.mac(b"kvlink/session/v1");
        for p in [dialler, answerer] {
            m.update(&p.challenge.to_le_bytes());
            m.update(&p.instance.to_le_bytes());
            m.update(&p.rank.0.to_le_bytes());
        }
        SessionKey(m.finalize().into_bytes().into())
    }

    fn mac(&self, label: &[u8]) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        m.update(label);
        m
    }

    /// The key of the tags of data `from` -> `to` in this session.
    pub fn tag_key(&self, from: RankId, to: RankId) -> TagKey {
        let mut m = self.mac(b"kvlink/tag/v1");
        m.update(&from.0.to_le_bytes());
        m.update(&to.0.to_le_bytes());
        let out = m.finalize().into_bytes();
        let mut k = [0u8; 16];
        k.copy_from_slice(&out[..16]);
        TagKey(k)
    }

    /// The dialler's proof, on a new connection with fresh challenges, that it holds this
    /// session: it is the process the other side still has bound.
    pub fn resume_proof(&self, answerer_challenge: u64, dialler_challenge: u64) -> [u8; PROOF_LEN] {
        self.resume_mac(answerer_challenge, dialler_challenge)
            .finalize()
            .into_bytes()
            .into()
    }

    pub fn verify_resume(
        &self,
        answerer_challenge: u64,
        dialler_challenge: u64,
        proof: &[u8; PROOF_LEN],
    ) -> bool {
        self.resume_mac(answerer_challenge, dialler_challenge)
            .verify_slice(proof)
            .is_ok()
    }

    fn resume_mac(&self, answerer_challenge: u64, dialler_challenge: u64) -> HmacSha256 {
        let mut m = self.mac(b"kvlink/resume/v1");
        m.update(&answerer_challenge.to_le_bytes());
        m.update(&dialler_challenge.to_le_bytes());
        m
    }
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

/// The key that maps one receiver's tokens to tags for one sender (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TagKey([u8; 16]);

impl TagKey {
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
    fn proof_verifies_only_with_the_same_secret_side_and_inputs() {
        let s = Secret::new(b"deployment".to_vec());
        let d = Side::Dialler;
        let p = proof(&s, d, 11, 22, RankId(3), 0xabc);
        assert!(verify(&s, d, 11, 22, RankId(3), 0xabc, &p));
        assert!(!verify(
            &Secret::new(b"other".to_vec()),
            d,
            11,
            22,
            RankId(3),
            0xabc,
            &p
        ));
        assert!(!verify(&Secret::none(), d, 11, 22, RankId(3), 0xabc, &p));
        assert!(
            !verify(&s, d, 12, 22, RankId(3), 0xabc, &p),
            "another challenge"
        );
        assert!(!verify(&s, d, 11, 22, RankId(4), 0xabc, &p), "another rank");
        assert!(
            !verify(&s, d, 11, 22, RankId(3), 0xabd, &p),
            "another instance"
        );
        assert!(
            !verify(&s, Side::Answerer, 11, 22, RankId(3), 0xabc, &p),
            "reflected"
        );
        let mut bad = p;
        bad[31] ^= 1;
        assert!(!verify(&s, d, 11, 22, RankId(3), 0xabc, &bad));
        // Without a secret on both sides the handshake still agrees.
        let n = proof(&Secret::none(), d, 1, 2, RankId(0), 9);
        assert!(verify(&Secret::none(), d, 1, 2, RankId(0), 9, &n));
    }

    fn parties(c: u64) -> (Party, Party) {
        (
            Party {
                rank: RankId(1),
                instance: 10,
                challenge: c,
            },
            Party {
                rank: RankId(0),
                instance: 20,
                challenge: 7,
            },
        )
    }

    #[test]
    fn tags_depend_on_the_session_the_direction_and_the_secret() {
        let none = Secret::none();
        let (d, a) = parties(5);
        let k = SessionKey::derive(&none, d, a);
        assert_eq!(k, SessionKey::derive(&none, d, a));
        let t = |k: &SessionKey, from: u32, to: u32, tok: u64| {
            k.tag_key(RankId(from), RankId(to)).tag(Token(tok))
        };
        assert_ne!(t(&k, 1, 0, 5), t(&k, 1, 0, 6));
        assert_ne!(t(&k, 1, 0, 5), t(&k, 0, 1, 5), "direction");
        let (d2, a2) = parties(6);
        assert_ne!(
            t(&k, 1, 0, 5),
            t(&SessionKey::derive(&none, d2, a2), 1, 0, 5),
            "session"
        );
        let s = Secret::new(b"x".to_vec());
        assert_ne!(
            t(&k, 1, 0, 5),
            t(&SessionKey::derive(&s, d, a), 1, 0, 5),
            "secret"
        );
        assert_ne!(t(&k, 1, 0, 5), 5, "the token is not its own tag");
    }

    #[test]
    fn a_resume_proof_binds_the_session_and_the_new_challenges() {
        let (d, a) = parties(5);
        let k = SessionKey::derive(&Secret::none(), d, a);
        let p = k.resume_proof(100, 200);
        assert!(k.verify_resume(100, 200, &p));
        assert!(
            !k.verify_resume(101, 200, &p),
            "a replay on a new connection"
        );
        let (d2, a2) = parties(6);
        let other = SessionKey::derive(&Secret::none(), d2, a2);
        assert!(!other.verify_resume(100, 200, &p), "another session");
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let s = Secret::new(b"hunter2".to_vec());
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
