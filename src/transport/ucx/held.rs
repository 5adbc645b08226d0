//! Commands held back by their caller and started together, control messages first.
//!
//! A receiver that posts its receives and then sends the advertisement naming them makes the
//! advertisement wait for every post. Held, the advertisement goes first and the receives right
//! after it, in one go: they reach the command queue under one lock and run in their order
//! before any progress pass, and unmatched data is only discarded as a stray in a pass (with
//! `discard_unexpected`), so the data they await, a round trip later at the earliest, cannot
//! be discarded for want of its receive.
use super::agent::{Agent, DIRECT_POST_MAX};
use super::callbacks;
use super::op::{Op, OpSlot, SlotKind, STOP_CANCEL, STOP_NONE};
use super::shared::Cmd;
use super::{sys, PeerId};
use crate::error::Result;
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What a caller posted through [`Agent::hold`], not yet started: [`Held::release`] starts it;
/// dropping it unreleased cancels it.
pub struct Held<'a> {
    agent: &'a Agent,
    /// Inline for a request's usual one message and one or two receives: holding them
    /// allocates nothing.
    posts: SmallVec<[Cmd; 1]>,
    transfers: SmallVec<[Cmd; 2]>,
    /// The held receives reported as events: one that ends at once needs a pass to say so.
    slots: SmallVec<[Arc<OpSlot>; 2]>,
    /// A transfer too large to start on the caller's thread (see `Agent::post_tag`).
    large: bool,
}

impl<'a> Held<'a> {
    pub(super) fn new(agent: &'a Agent) -> Self {
        Held {
            agent,
            posts: SmallVec::new(),
            transfers: SmallVec::new(),
            slots: SmallVec::new(),
            large: false,
        }
    }

    /// [`Agent::post_recv_with`], started at the release, after the held control messages.
    ///
    /// # Safety
    /// As for [`Agent::post_recv_with`].
    pub unsafe fn post_recv_with(
        &mut self,
        peer: PeerId,
        tag: u64,
        addr: *mut u8,
        len: usize,
        notify: bool,
    ) -> Result<Op> {
        let (op, cmd, slot) =
            self.agent
                .prepare_tag(SlotKind::Recv, peer, tag, addr as usize, len, notify)?;
        self.large |= len > DIRECT_POST_MAX;
        slot.held.store(true, Ordering::Release);
        self.transfers.push(cmd);
        if notify {
            self.slots.push(slot);
        }
        Ok(op)
    }

    /// [`Agent::post_control`], started at the release, before the held transfers.
    pub fn post_control(&mut self, peer: PeerId, bytes: Vec<u8>) -> Result<()> {
        self.posts.push(self.agent.prepare_post(peer, bytes)?);
        Ok(())
    }

    /// Starts what is held: on this thread when nothing else is queued and no other thread
    /// drives, otherwise by the progress thread, which is then woken. Errors only when the
    /// agent is shut down (every held op is then ended as such).
    pub fn release(mut self) -> Result<()> {
        self.start()
    }

    fn start(&mut self) -> Result<()> {
        if self.posts.is_empty() && self.transfers.is_empty() {
            return Ok(());
        }
        let shared = &self.agent.shared;
        // Queued from here on: a stop cancels them as it does any op.
        for cmd in &self.transfers {
            if let Cmd::Tag { slot, .. } = cmd {
                slot.held.store(false, Ordering::Release);
            }
        }
        let cmds = self.posts.drain(..).chain(self.transfers.drain(..));
        if self.large {
            return shared.submit_all(cmds);
        }
        let slots = &self.slots;
        shared.submit_unwaited_all(cmds, || {
            slots.iter().any(|s| s.state.lock().is_some()) || shared.internal_queued_any()
        })
    }
}

impl Drop for Held<'_> {
    /// Dropped without [`Held::release`] (its owner's code returned early, or unwound): nothing
    /// held starts, so no receive is left posted into memory that nobody will cancel; each
    /// held op ends `Cancelled` at once and its payloads go.
    fn drop(&mut self) {
        let shared = &self.agent.shared;
        let mut reported = false;
        for cmd in self.posts.drain(..).chain(self.transfers.drain(..)) {
            if let Cmd::Tag { slot, .. } = &cmd {
                let _ = slot.stop_reason.compare_exchange(
                    STOP_NONE,
                    STOP_CANCEL,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                callbacks::finish_slot(shared, slot, sys::UCS_ERR_CANCELED, 0);
                reported |= slot.notify;
            }
        }
        if reported {
            // Their `OpDone` events were queued here, outside any pass: an owner's sink hears
            // of them in the next pass, which a sleeping progress thread must be woken for.
            shared.owe_pass();
        }
    }
}
