//! The handshake of one connection, sans IO: who the peer is, and whether it proved it belongs.
//!
//! ```text
//! dialler                                   answerer (accepted the connection)
//!   Hello {rank, instance, challenge c_d} ->
//!                                         <- Hello {rank, instance, challenge c_a,
//!                                                   proof for c_d}
//!   verify; Proof {proof for c_a}         ->
//!                                            verify; bind the dialler's rank
//!                                         <- Welcome          (or Refuse {reason})
//!   bind the answerer's rank
//! ```
//! Each side verifies the other's proof (see [`super::auth`]) before it binds the peer's rank, and
//! refuses with [`Refusal::AuthFailed`] when it does not verify. Binding itself (is the rank free?)
//! is the engine's decision: [`Step::Verified`], [`Step::Proven`] and [`Step::Welcomed`] hand it
//! the peer, and the engine answers with [`Handshake::accept`] or [`Handshake::refuse`]. Nothing
//! but these four messages is taken from a peer before its handshake is done.
use super::auth::{self, Secret};
use super::id::RankId;
use super::wire::{Message, Refusal};

/// This rank, as it introduces itself.
#[derive(Clone, Debug)]
pub struct Identity {
    pub rank: RankId,
    pub name: String,
    /// Drawn at start; keys this rank's tags (see [`auth::TagKey`]).
    pub instance: u64,
    pub secret: Secret,
}

/// The peer, as its `Hello` named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    pub rank: RankId,
    pub name: String,
    pub instance: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Dialled: our `Hello` is out, the answer is awaited.
    Dialled {
        challenge: u64,
    },
    /// Accepted: nothing sent yet, the dialler's `Hello` is awaited.
    Answering {
        challenge: u64,
    },
    /// Answered with our `Hello`; the dialler's `Proof` is awaited.
    AwaitProof {
        challenge: u64,
        peer_challenge: u64,
        peer: PeerInfo,
    },
    /// Our proof is out; the answerer's `Welcome` is awaited.
    AwaitWelcome {
        peer: PeerInfo,
    },
    /// The engine is deciding whether to bind `peer` (after the step `phase` names).
    Deciding {
        peer: PeerInfo,
        phase: Phase,
    },
    Bound(PeerInfo),
    Refused(Refusal),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Verified,
    Proven,
    Welcomed,
}

/// What the engine does after [`Handshake::handle`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send this message; nothing is decided yet.
    Reply(Message),
    /// Dialler: the answerer proved itself. If its rank may be bound here, send `reply` (our
    /// proof) and wait for `Welcome`; else refuse.
    Verified { peer: PeerInfo, reply: Message },
    /// Answerer: the dialler proved itself. Bind it and send `Welcome`, or refuse.
    Proven(PeerInfo),
    /// Dialler: the answerer bound us. Bind it, or refuse.
    Welcomed(PeerInfo),
    /// The peer's proof failed: send `Refuse { reason }` and close the connection.
    Refuse(Refusal),
    /// The peer refused us.
    RefusedByPeer(Refusal),
    /// A message out of order (or a second handshake): ignore it and count it.
    Unexpected,
}

#[derive(Clone, Debug)]
pub struct Handshake {
    state: State,
}

impl Handshake {
    /// This side dialled: start with its `Hello`.
    pub fn dial(me: &Identity, challenge: u64) -> (Handshake, Message) {
        let hello = Message::Hello {
            agent_name: me.name.clone(),
            rank: me.rank,
            instance: me.instance,
            challenge,
            proof: None,
        };
        (
            Handshake {
                state: State::Dialled { challenge },
            },
            hello,
        )
    }

    /// A peer dialled this side: wait for its `Hello`.
    pub fn answer(challenge: u64) -> Handshake {
        Handshake {
            state: State::Answering { challenge },
        }
    }

    /// The bound peer, once the handshake is done.
    pub fn peer(&self) -> Option<&PeerInfo> {
        match &self.state {
            State::Bound(p) => Some(p),
            _ => None,
        }
    }

    /// Why the handshake was refused (by either side), if it was.
    pub fn refused(&self) -> Option<Refusal> {
        match self.state {
            State::Refused(r) => Some(r),
            _ => None,
        }
    }

    /// Takes one handshake message from the peer. Other messages are not for this.
    pub fn handle(&mut self, me: &Identity, msg: Message) -> Step {
        let state = std::mem::replace(&mut self.state, State::Refused(Refusal::AuthFailed));
        let (next, step) = Self::next(me, state, msg);
        self.state = next;
        step
    }

    fn next(me: &Identity, state: State, msg: Message) -> (State, Step) {
        match (state, msg) {
            (_, Message::Refuse { reason }) => {
                (State::Refused(reason), Step::RefusedByPeer(reason))
            }
            (
                State::Answering { challenge },
                Message::Hello {
                    agent_name,
                    rank,
                    instance,
                    challenge: peer_challenge,
                    proof: None,
                },
            ) => {
                let reply = Message::Hello {
                    agent_name: me.name.clone(),
                    rank: me.rank,
                    instance: me.instance,
                    challenge,
                    proof: Some(auth::proof(
                        &me.secret,
                        peer_challenge,
                        challenge,
                        me.rank,
                        me.instance,
                    )),
                };
                let peer = PeerInfo {
                    rank,
                    name: agent_name,
                    instance,
                };
                (
                    State::AwaitProof {
                        challenge,
                        peer_challenge,
                        peer,
                    },
                    Step::Reply(reply),
                )
            }
            (
                State::Dialled { challenge },
                Message::Hello {
                    agent_name,
                    rank,
                    instance,
                    challenge: peer_challenge,
                    proof: Some(proof),
                },
            ) => {
                if !auth::verify(
                    &me.secret,
                    challenge,
                    peer_challenge,
                    rank,
                    instance,
                    &proof,
                ) {
                    return refuse(Refusal::AuthFailed);
                }
                let reply = Message::Proof {
                    proof: auth::proof(&me.secret, peer_challenge, challenge, me.rank, me.instance),
                };
                let peer = PeerInfo {
                    rank,
                    name: agent_name,
                    instance,
                };
                (
                    State::Deciding {
                        peer: peer.clone(),
                        phase: Phase::Verified,
                    },
                    Step::Verified { peer, reply },
                )
            }
            (
                State::AwaitProof {
                    challenge,
                    peer_challenge,
                    peer,
                },
                Message::Proof { proof },
            ) => {
                if !auth::verify(
                    &me.secret,
                    challenge,
                    peer_challenge,
                    peer.rank,
                    peer.instance,
                    &proof,
                ) {
                    return refuse(Refusal::AuthFailed);
                }
                (
                    State::Deciding {
                        peer: peer.clone(),
                        phase: Phase::Proven,
                    },
                    Step::Proven(peer),
                )
            }
            (State::AwaitWelcome { peer }, Message::Welcome) => (
                State::Deciding {
                    peer: peer.clone(),
                    phase: Phase::Welcomed,
                },
                Step::Welcomed(peer),
            ),
            (state, _) => (state, Step::Unexpected),
        }
    }

    /// The engine's yes to the last step: after [`Step::Verified`] wait for `Welcome`; after
    /// [`Step::Proven`] or [`Step::Welcomed`] the peer is bound. Returns the `Welcome` the
    /// answerer sends.
    pub fn accept(&mut self) -> Option<Message> {
        let State::Deciding { peer, phase } = &self.state else {
            return None;
        };
        let peer = peer.clone();
        match phase {
            Phase::Verified => {
                self.state = State::AwaitWelcome { peer };
                None
            }
            Phase::Proven => {
                self.state = State::Bound(peer);
                Some(Message::Welcome)
            }
            Phase::Welcomed => {
                self.state = State::Bound(peer);
                None
            }
        }
    }

    /// The engine will not bind the peer: returns the `Refuse` to send.
    pub fn refuse(&mut self, reason: Refusal) -> Message {
        self.state = State::Refused(reason);
        Message::Refuse { reason }
    }
}

fn refuse(reason: Refusal) -> (State, Step) {
    (State::Refused(reason), Step::Refuse(reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(rank: u32, secret: &[u8]) -> Identity {
        Identity {
            rank: RankId(rank),
            name: format!("r{rank}"),
            instance: 1000 + rank as u64,
            secret: Secret::new(secret.to_vec()),
        }
    }

    /// Runs a whole handshake; returns what each side ended with.
    fn run(d: &Identity, a: &Identity) -> (Handshake, Handshake, Vec<Step>) {
        let (mut hd, hello) = Handshake::dial(d, 11);
        let mut ha = Handshake::answer(22);
        let mut steps = Vec::new();
        let s1 = ha.handle(a, hello);
        steps.push(s1.clone());
        let Step::Reply(answer) = s1 else {
            return (hd, ha, steps);
        };
        let s2 = hd.handle(d, answer);
        steps.push(s2.clone());
        let Step::Verified { reply, .. } = s2 else {
            if let Step::Refuse(r) = s2 {
                ha.handle(a, Message::Refuse { reason: r });
            }
            return (hd, ha, steps);
        };
        assert_eq!(hd.accept(), None);
        let s3 = ha.handle(a, reply);
        steps.push(s3.clone());
        match s3 {
            Step::Proven(_) => {
                let welcome = ha.accept().expect("answerer says Welcome");
                let s4 = hd.handle(d, welcome);
                steps.push(s4.clone());
                assert!(matches!(s4, Step::Welcomed(_)));
                assert_eq!(hd.accept(), None);
            }
            Step::Refuse(r) => {
                hd.handle(d, Message::Refuse { reason: r });
            }
            other => panic!("{other:?}"),
        }
        (hd, ha, steps)
    }

    #[test]
    fn same_secret_or_none_binds_both_sides() {
        for secret in [&b""[..], b"s3cret"] {
            let (d, a) = (id(1, secret), id(2, secret));
            let (hd, ha, _) = run(&d, &a);
            assert_eq!(hd.peer().map(|p| p.rank), Some(RankId(2)));
            assert_eq!(ha.peer().map(|p| p.rank), Some(RankId(1)));
            assert_eq!(ha.peer().unwrap().instance, 1001);
        }
    }

    #[test]
    fn a_missing_or_wrong_secret_is_refused_on_both_sides() {
        for (ds, as_) in [
            (&b""[..], &b"s3cret"[..]),
            (b"s3cret", b""),
            (b"s3cret", b"other"),
        ] {
            let (hd, ha, steps) = run(&id(1, ds), &id(2, as_));
            assert_eq!(hd.refused(), Some(Refusal::AuthFailed), "{steps:?}");
            assert_eq!(ha.refused(), Some(Refusal::AuthFailed), "{steps:?}");
            assert!(hd.peer().is_none() && ha.peer().is_none());
            // The dialler checks first: it refuses the answerer's proof.
            assert_eq!(steps[1], Step::Refuse(Refusal::AuthFailed));
        }
    }

    #[test]
    fn a_replayed_proof_fails_a_fresh_challenge() {
        let (d, a) = (id(1, b"k"), id(2, b"k"));
        let (_, hello) = Handshake::dial(&d, 11);
        let mut ha = Handshake::answer(22);
        let Step::Reply(answer) = ha.handle(&a, hello) else {
            panic!()
        };
        // A dialler with another challenge (a new connection) gets the old answer replayed.
        let (mut other, _) = Handshake::dial(&d, 12);
        assert_eq!(other.handle(&d, answer), Step::Refuse(Refusal::AuthFailed));
    }

    #[test]
    fn out_of_order_messages_change_nothing() {
        let a = id(2, b"");
        let mut ha = Handshake::answer(22);
        assert_eq!(ha.handle(&a, Message::Welcome), Step::Unexpected);
        assert_eq!(
            ha.handle(&a, Message::Proof { proof: [0; 32] }),
            Step::Unexpected
        );
        // A Hello that already carries a proof is not how a dialler starts.
        let bogus = Message::Hello {
            agent_name: "x".into(),
            rank: RankId(9),
            instance: 1,
            challenge: 1,
            proof: Some([0; 32]),
        };
        assert_eq!(ha.handle(&a, bogus), Step::Unexpected);
        assert!(ha.peer().is_none() && ha.refused().is_none());
        assert_eq!(
            ha.handle(
                &a,
                Message::Refuse {
                    reason: Refusal::RankInUse
                }
            ),
            Step::RefusedByPeer(Refusal::RankInUse)
        );
        assert_eq!(ha.refused(), Some(Refusal::RankInUse));
    }

    #[test]
    fn the_engine_can_refuse_a_proven_peer() {
        let (d, a) = (id(1, b""), id(2, b""));
        let (mut hd, hello) = Handshake::dial(&d, 11);
        let mut ha = Handshake::answer(22);
        let Step::Reply(answer) = ha.handle(&a, hello) else {
            panic!()
        };
        let Step::Verified { reply, .. } = hd.handle(&d, answer) else {
            panic!()
        };
        hd.accept();
        assert!(matches!(ha.handle(&a, reply), Step::Proven(_)));
        let no = ha.refuse(Refusal::RankInUse);
        assert_eq!(hd.handle(&d, no), Step::RefusedByPeer(Refusal::RankInUse));
        assert_eq!(hd.refused(), Some(Refusal::RankInUse));
        assert!(ha.peer().is_none());
    }
}
