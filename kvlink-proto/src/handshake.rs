//! The handshake of one connection, sans IO: who the peer is, whether it proved it belongs, and
//! the session key the pair shares afterwards.
//!
//! ```text
//! dialler                                   answerer (accepted the connection)
//!   Hello {rank, instance, challenge c_d} ->
//!                                         <- Hello {rank, instance, challenge c_a,
//!                                                   proof for c_d}
//!   verify; Proof {proof for c_a,         ->
//!                  [resume proof]}           verify; bind the dialler's rank
//!                                         <- Welcome          (or Refuse {reason})
//!   bind the answerer's rank
//! ```
//! Each side verifies the other's proof (see [`super::auth`]) before it binds the peer's rank, and
//! refuses with [`Refusal::AuthFailed`] when it does not verify. Binding itself (is the rank free,
//! or is this the same session coming back?) is the engine's decision: [`Step::Verified`],
//! [`Step::Proven`] and [`Step::Welcomed`] hand it the peer, and the engine answers with
//! [`Handshake::accept`] or [`Handshake::refuse`]. A dialler that held a session with the rank
//! before adds a resume proof to its `Proof`; the answerer checks it with
//! [`Handshake::resumes`] when the rank is still bound to an older connection. Nothing but these
//! four messages is taken from a peer before its handshake is done.
use super::auth::{self, Party, Secret, SessionKey, Side, PROOF_LEN};
use super::id::RankId;
use super::wire::{Message, Refusal};

/// This rank, as it introduces itself.
#[derive(Clone, Debug)]
pub struct Identity {
    pub rank: RankId,
    pub name: String,
    /// Drawn at start: which process this is (part of every session key).
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
        session: SessionKey,
    },
    /// The engine is deciding whether to bind `peer` (after the step `phase` names).
    Deciding {
        peer: PeerInfo,
        session: SessionKey,
        phase: Phase,
        /// The answerer's and the dialler's challenges.
        challenges: (u64, u64),
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
    /// Dialler: the answerer proved itself. If its rank may be bound here, [`Handshake::accept`]
    /// (with the session held with that rank before, if any) and send the `Proof` it returns;
    /// else refuse.
    Verified { peer: PeerInfo, session: SessionKey },
    /// Answerer: the dialler proved itself, with a resume proof if it says it held a session
    /// with this rank before. Bind it and send `Welcome`, or refuse.
    Proven {
        peer: PeerInfo,
        session: SessionKey,
        resume: Option<[u8; PROOF_LEN]>,
    },
    /// Dialler: the answerer bound us. Bind it, or refuse.
    Welcomed { peer: PeerInfo, session: SessionKey },
    /// The peer's proof failed, or it claims our own rank: send `Refuse { reason }` and close.
    Refuse(Refusal),
    /// The peer refused us.
    RefusedByPeer(Refusal),
    /// Both sides dialled on one connection and this side lost the tie: wait for the answer.
    Ignore,
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

    /// This side dialled: the peer that answered, once our proof is out and its `Welcome` (or
    /// refusal) is awaited.
    pub fn dialled_peer(&self) -> Option<&PeerInfo> {
        match &self.state {
            State::AwaitWelcome { peer, .. } => Some(peer),
            _ => None,
        }
    }

    /// This side dialled and its proof is out: the session the answerer binds with it.
    pub fn dial_session(&self) -> Option<SessionKey> {
        match &self.state {
            State::AwaitWelcome { session, .. } => Some(*session),
            _ => None,
        }
    }

    /// The peer dialled this side: who it said it is, once its `Hello` came and while its
    /// proof is awaited.
    pub fn answered_peer(&self) -> Option<&PeerInfo> {
        match &self.state {
            State::AwaitProof { peer, .. } => Some(peer),
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

    /// The answer to a dialler's `Hello`: ours, with our proof for its challenge.
    fn answer_hello(me: &Identity, challenge: u64, peer_challenge: u64) -> Message {
        Message::Hello {
            agent_name: me.name.clone(),
            rank: me.rank,
            instance: me.instance,
            challenge,
            proof: Some(auth::proof(
                &me.secret,
                Side::Answerer,
                peer_challenge,
                challenge,
                me.rank,
                me.instance,
            )),
        }
    }

    fn next(me: &Identity, state: State, msg: Message) -> (State, Step) {
        let dialled_too = matches!(state, State::Dialled { .. })
            && matches!(msg, Message::Hello { proof: None, .. });
        match (state, msg) {
            (_, Message::Refuse { reason }) => {
                (State::Refused(reason), Step::RefusedByPeer(reason))
            }
            // Only where a `Hello` is awaited: on a handshake already past it (bound, refused,
            // or further on) any `Hello` is out of order, and refusing there would unbind a
            // live rank or refuse a refused endpoint again.
            (State::Dialled { .. } | State::Answering { .. }, Message::Hello { rank, .. })
                if rank == me.rank =>
            {
                refuse(Refusal::RankInUse)
            }
            // A dialler's Hello. On a connection this side dialled too, UCX made one connection
            // of the two: the higher rank answers, the lower waits for that answer.
            (State::Dialled { challenge }, Message::Hello { rank, .. })
                if dialled_too && me.rank < rank =>
            {
                (State::Dialled { challenge }, Step::Ignore)
            }
            (
                State::Answering { challenge } | State::Dialled { challenge },
                Message::Hello {
                    agent_name,
                    rank,
                    instance,
                    challenge: peer_challenge,
                    proof: None,
                },
            ) => {
                let reply = Self::answer_hello(me, challenge, peer_challenge);
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
                    Side::Answerer,
                    challenge,
                    peer_challenge,
                    rank,
                    instance,
                    &proof,
                ) {
                    return refuse(Refusal::AuthFailed);
                }
                let session = SessionKey::derive(
                    &me.secret,
                    Party {
                        rank: me.rank,
                        instance: me.instance,
                        challenge,
                    },
                    Party {
                        rank,
                        instance,
                        challenge: peer_challenge,
                    },
                );
                let peer = PeerInfo {
                    rank,
                    name: agent_name,
                    instance,
                };
                (
                    State::Deciding {
                        peer: peer.clone(),
                        session,
                        phase: Phase::Verified,
                        challenges: (peer_challenge, challenge),
                    },
                    Step::Verified { peer, session },
                )
            }
            (
                State::AwaitProof {
                    challenge,
                    peer_challenge,
                    peer,
                },
                Message::Proof { proof, resume },
            ) => {
                if !auth::verify(
                    &me.secret,
                    Side::Dialler,
                    challenge,
                    peer_challenge,
                    peer.rank,
                    peer.instance,
                    &proof,
                ) {
                    return refuse(Refusal::AuthFailed);
                }
                let session = SessionKey::derive(
                    &me.secret,
                    Party {
                        rank: peer.rank,
                        instance: peer.instance,
                        challenge: peer_challenge,
                    },
                    Party {
                        rank: me.rank,
                        instance: me.instance,
                        challenge,
                    },
                );
                (
                    State::Deciding {
                        peer: peer.clone(),
                        session,
                        phase: Phase::Proven,
                        challenges: (challenge, peer_challenge),
                    },
                    Step::Proven {
                        peer,
                        session,
                        resume,
                    },
                )
            }
            (State::AwaitWelcome { peer, session }, Message::Welcome) => (
                State::Deciding {
                    peer: peer.clone(),
                    session,
                    phase: Phase::Welcomed,
                    challenges: (0, 0),
                },
                Step::Welcomed { peer, session },
            ),
            (state, _) => (state, Step::Unexpected),
        }
    }

    /// Answerer, after [`Step::Proven`]: does `proof` show that the dialler holds `old`, the
    /// session of the connection this side still has bound to its rank?
    pub fn resumes(&self, old: &SessionKey, proof: &[u8; PROOF_LEN]) -> bool {
        match &self.state {
            State::Deciding {
                phase: Phase::Proven,
                challenges: (answerer, dialler),
                ..
            } => old.verify_resume(*answerer, *dialler, proof),
            _ => false,
        }
    }

    /// The engine's yes to the last step. After [`Step::Verified`] it returns the `Proof` to
    /// send (with a resume proof when `held` is the session this side held with that rank
    /// before) and waits for `Welcome`; after [`Step::Proven`] the peer is bound and it returns
    /// the `Welcome` to send; after [`Step::Welcomed`] the peer is bound.
    pub fn accept(&mut self, me: &Identity, held: Option<&SessionKey>) -> Option<Message> {
        let State::Deciding {
            peer,
            session,
            phase,
            challenges: (answerer, dialler),
        } = &self.state
        else {
            return None;
        };
        let (peer, session, phase, answerer, dialler) =
            (peer.clone(), *session, *phase, *answerer, *dialler);
        match phase {
            Phase::Verified => {
                let proof = auth::proof(
                    &me.secret,
                    Side::Dialler,
                    answerer,
                    dialler,
                    me.rank,
                    me.instance,
                );
                let resume = held.map(|k| k.resume_proof(answerer, dialler));
                self.state = State::AwaitWelcome { peer, session };
                Some(Message::Proof { proof, resume })
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

    /// Runs a whole handshake (`held`: the dialler's session from before, for a resume proof);
    /// returns what each side ended with, the steps, and the two session keys seen.
    fn run(
        d: &Identity,
        a: &Identity,
        held: Option<&SessionKey>,
    ) -> (Handshake, Handshake, Vec<Step>, Vec<SessionKey>) {
        let (mut hd, hello) = Handshake::dial(d, 11);
        let mut ha = Handshake::answer(22);
        let mut steps = Vec::new();
        let mut keys = Vec::new();
        let s1 = ha.handle(a, hello);
        steps.push(s1.clone());
        let Step::Reply(answer) = s1 else {
            return (hd, ha, steps, keys);
        };
        let s2 = hd.handle(d, answer);
        steps.push(s2.clone());
        let Step::Verified { session, .. } = s2 else {
            if let Step::Refuse(r) = s2 {
                ha.handle(a, Message::Refuse { reason: r });
            }
            return (hd, ha, steps, keys);
        };
        keys.push(session);
        let reply = hd.accept(d, held).expect("the dialler's proof");
        let s3 = ha.handle(a, reply);
        steps.push(s3.clone());
        match s3 {
            Step::Proven { session, .. } => {
                keys.push(session);
                let welcome = ha.accept(a, None).expect("answerer says Welcome");
                let s4 = hd.handle(d, welcome);
                steps.push(s4.clone());
                assert!(matches!(s4, Step::Welcomed { .. }));
                assert_eq!(hd.accept(d, None), None);
            }
            Step::Refuse(r) => {
                hd.handle(d, Message::Refuse { reason: r });
            }
            other => panic!("{other:?}"),
        }
        (hd, ha, steps, keys)
    }

    #[test]
    fn same_secret_or_none_binds_both_sides_with_one_session_key() {
        for secret in [&b""[..], b"s3cret"] {
            let (d, a) = (id(1, secret), id(2, secret));
            let (hd, ha, _, keys) = run(&d, &a, None);
            assert_eq!(hd.peer().map(|p| p.rank), Some(RankId(2)));
            assert_eq!(ha.peer().map(|p| p.rank), Some(RankId(1)));
            assert_eq!(ha.peer().unwrap().instance, 1001);
            assert_eq!(keys.len(), 2);
            assert_eq!(keys[0], keys[1], "both sides derive the same session key");
        }
    }

    #[test]
    fn a_missing_or_wrong_secret_is_refused_on_both_sides() {
        for (ds, as_) in [
            (&b""[..], &b"s3cret"[..]),
            (b"s3cret", b""),
            (b"s3cret", b"other"),
        ] {
            let (hd, ha, steps, _) = run(&id(1, ds), &id(2, as_), None);
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
    fn an_answer_reflected_as_a_dialler_proof_fails() {
        // The answerer's own proof sent back as the dialler's: the roles differ.
        let (d, a) = (id(1, b""), id(2, b""));
        let (_, hello) = Handshake::dial(&d, 11);
        let mut ha = Handshake::answer(22);
        let Step::Reply(Message::Hello { proof: Some(p), .. }) = ha.handle(&a, hello) else {
            panic!()
        };
        let step = ha.handle(
            &a,
            Message::Proof {
                proof: p,
                resume: None,
            },
        );
        assert_eq!(step, Step::Refuse(Refusal::AuthFailed));
    }

    #[test]
    fn a_peer_claiming_our_rank_is_refused() {
        let a = id(2, b"");
        let mut ha = Handshake::answer(22);
        let (_, hello) = Handshake::dial(&id(2, b""), 11);
        assert_eq!(ha.handle(&a, hello), Step::Refuse(Refusal::RankInUse));
    }

    #[test]
    fn a_resume_proof_shows_the_old_session_and_only_that() {
        let (d, a) = (id(1, b""), id(2, b""));
        let (_, _, _, keys) = run(&d, &a, None);
        let old = keys[0];
        // The same process redials holding `old`: the answerer can check it.
        let (mut hd, hello) = Handshake::dial(&d, 33);
        let mut ha = Handshake::answer(44);
        let Step::Reply(answer) = ha.handle(&a, hello) else {
            panic!()
        };
        assert!(matches!(hd.handle(&d, answer), Step::Verified { .. }));
        let reply = hd.accept(&d, Some(&old)).unwrap();
        let Step::Proven {
            resume: Some(r), ..
        } = ha.handle(&a, reply)
        else {
            panic!("no resume proof")
        };
        assert!(ha.resumes(&old, &r));
        // A process that knows everything public (ranks, instances) but not the challenges of
        // the first connection cannot make the proof.
        let forged = SessionKey::derive(
            &Secret::none(),
            Party {
                rank: RankId(1),
                instance: 1001,
                challenge: 0,
            },
            Party {
                rank: RankId(2),
                instance: 1002,
                challenge: 0,
            },
        );
        assert!(!ha.resumes(&forged, &r));
        assert_ne!(forged, old);
    }

    #[test]
    fn out_of_order_messages_change_nothing() {
        let a = id(2, b"");
        let mut ha = Handshake::answer(22);
        assert_eq!(ha.handle(&a, Message::Welcome), Step::Unexpected);
        let proof = Message::Proof {
            proof: [0; 32],
            resume: None,
        };
        assert_eq!(ha.handle(&a, proof), Step::Unexpected);
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
    fn both_sides_dialling_on_one_connection_meet_in_one_handshake() {
        let (lo, hi) = (id(1, b"k"), id(2, b"k"));
        let (mut h_lo, hello_lo) = Handshake::dial(&lo, 11);
        let (mut h_hi, hello_hi) = Handshake::dial(&hi, 22);
        // Each gets the other's Hello: the higher rank answers, the lower waits.
        assert_eq!(h_lo.handle(&lo, hello_hi), Step::Ignore);
        let Step::Reply(answer) = h_hi.handle(&hi, hello_lo) else {
            panic!()
        };
        assert!(matches!(h_lo.handle(&lo, answer), Step::Verified { .. }));
        let proof = h_lo.accept(&lo, None).unwrap();
        assert!(matches!(h_hi.handle(&hi, proof), Step::Proven { .. }));
        let welcome = h_hi.accept(&hi, None).unwrap();
        assert!(matches!(h_lo.handle(&lo, welcome), Step::Welcomed { .. }));
        h_lo.accept(&lo, None);
        assert_eq!(h_lo.peer().map(|p| p.rank), Some(RankId(2)));
        assert_eq!(h_hi.peer().map(|p| p.rank), Some(RankId(1)));
    }

    #[test]
    fn the_engine_can_refuse_a_proven_peer() {
        let (d, a) = (id(1, b""), id(2, b""));
        let (mut hd, hello) = Handshake::dial(&d, 11);
        let mut ha = Handshake::answer(22);
        let Step::Reply(answer) = ha.handle(&a, hello) else {
            panic!()
        };
        assert!(matches!(hd.handle(&d, answer), Step::Verified { .. }));
        let reply = hd.accept(&d, None).unwrap();
        assert!(matches!(ha.handle(&a, reply), Step::Proven { .. }));
        let no = ha.refuse(Refusal::RankInUse);
        assert_eq!(hd.handle(&d, no), Step::RefusedByPeer(Refusal::RankInUse));
        assert_eq!(hd.refused(), Some(Refusal::RankInUse));
        assert!(ha.peer().is_none());
    }
}
