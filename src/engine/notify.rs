//! Notifications: ordered messages from one rank to another, outside any request's data.

use super::glue;
use super::waiters::WaitKey;
use super::Engine;
use crate::error::{Error, ErrorKind, Result};
use crate::proto::peers::PeerState;
use crate::proto::{RankId, RequestKey};
use std::time::Instant;

impl Engine {
    /// Sends an ordered notification to `to`: `UnknownPeer` for a rank never connected here,
    /// `PeerLost` for one whose connection failed (reconnecting, or failed for good), as for
    /// an advertise.
    pub fn notify(&self, to: RankId, key: RequestKey, payload: Vec<u8>) -> Result<()> {
        let mut core = self.inner.core.lock();
        if core.peers.endpoint(to).is_none() {
            return Err(match core.peers.state(to) {
                PeerState::Unknown => {
                    Error::new(ErrorKind::UnknownPeer, format!("{to} is not connected"))
                }
                state => Error::new(
                    ErrorKind::PeerLost,
                    format!("{to}: its connection failed ({state:?})"),
                ),
            });
        }
        core.ep.send_notify(key, to, payload)?;
        self.inner.flush(&mut core);
        Ok(())
    }

    /// The next notification from `from`, in the order sent; `None` at the deadline or cancel.
    pub fn wait_for_notification(
        &self,
        from: RankId,
        deadline: Instant,
        cancel: Option<&dyn Fn() -> bool>,
    ) -> Option<(RequestKey, Vec<u8>)> {
        // As in `next_advertisement`: one sleeper woken per notification, the turn passed on.
        self.block(WaitKey::Note(from), deadline, cancel, |core| {
            let q = core.notes.get_mut(&from)?;
            let note = core.waiters.take(WaitKey::Note(from), q)?;
            if q.is_empty() {
                // Ranks come and go: their empty queues must not pile up.
                core.notes.remove(&from);
            }
            core.note_bytes -= glue::note_bytes(&note.1);
            Some(note)
        })
    }
}
