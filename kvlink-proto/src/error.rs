//! The one error type of kvlink and the outcomes of a bounded wait.
//!
//! Faults are `Error`s with a stable [`ErrorKind`] (numbered: C++ switches on the number, never on
//! the text). Results of a wait that are not faults — timed out, cancelled, peer lost, rejected —
//! are [`Outcome`] values.
use std::fmt;

/// Stable error kinds. The numbers are part of the C++ ABI: never renumber, only append.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A caller passed a value that can never be valid (null pointer, zero length, bad address).
    InvalidArgument = 1,
    /// A peer name, agent or connection is not known here.
    UnknownPeer = 2,
    /// The peer's endpoint has failed; every later operation on it fails the same way.
    PeerLost = 3,
    /// UCX reported an error that is not one of the above.
    Transport = 4,
    /// A CUDA region was used where no CUDA driver exists, or a CUDA call failed.
    Cuda = 5,
    /// The agent or connection has been shut down.
    Shutdown = 6,
    /// A wire message failed validation (bad magic, version, length, field).
    Protocol = 7,
    /// A descriptor or transfer falls outside a registered region.
    OutOfBounds = 8,
    /// A buffer lease was returned twice or never returned.
    Accounting = 9,
    /// A message or transfer from an older generation of a request.
    StaleGeneration = 10,
    /// A Rust panic was caught at the C++ boundary; the operation did not complete.
    Panic = 11,
    /// An internal invariant failed.
    Internal = 12,
    /// A request (key and role) this rank does not know: never advertised here, or already
    /// waited for and forgotten.
    UnknownRequest = 13,
    /// The receive pool is full: `advertise` asked for more receive buffers than are free
    /// (`EngineConfig::pool_slots`). The bounded queues fed by peers (advertisements,
    /// notifications) do not return it: past their caps a new entry is refused or dropped and
    /// counted (`adverts_refused`, `notes_dropped`).
    QueueFull = 14,
    /// The handshake failed: one side holds the deployment secret and the other does not (or
    /// holds another). Reported on both sides; the connection is closed.
    AuthFailed = 15,
    /// The peer's rank is bound to another live process: a second process with the same rank
    /// is refused until the first is gone. Also a dial to an engine that has the dialler's
    /// rank itself (rank ids must be unique in a deployment).
    RankInUse = 16,
    /// The memory overlaps a fenced range of a region: a transfer of a request that has ended
    /// is still held by UCX there (its sender may yet write). Use other memory, or retry
    /// once the region's `fenced_bytes` is 0.
    Fenced = 17,
}

impl ErrorKind {
    pub fn code(self) -> u8 {
        self as u8
    }
    pub fn from_code(code: u8) -> Option<ErrorKind> {
        use ErrorKind::*;
        [
            InvalidArgument,
            UnknownPeer,
            PeerLost,
            Transport,
            Cuda,
            Shutdown,
            Protocol,
            OutOfBounds,
            Accounting,
            StaleGeneration,
            Panic,
            Internal,
            UnknownRequest,
            QueueFull,
            AuthFailed,
            RankInUse,
            Fenced,
        ]
        .into_iter()
        .find(|k| k.code() == code)
    }
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "InvalidArgument",
            ErrorKind::UnknownPeer => "UnknownPeer",
            ErrorKind::PeerLost => "PeerLost",
            ErrorKind::Transport => "Transport",
            ErrorKind::Cuda => "Cuda",
            ErrorKind::Shutdown => "Shutdown",
            ErrorKind::Protocol => "Protocol",
            ErrorKind::OutOfBounds => "OutOfBounds",
            ErrorKind::Accounting => "Accounting",
            ErrorKind::StaleGeneration => "StaleGeneration",
            ErrorKind::Panic => "Panic",
            ErrorKind::Internal => "Internal",
            ErrorKind::UnknownRequest => "UnknownRequest",
            ErrorKind::QueueFull => "QueueFull",
            ErrorKind::AuthFailed => "AuthFailed",
            ErrorKind::RankInUse => "RankInUse",
            ErrorKind::Fenced => "Fenced",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kvlink {}: {}", self.kind.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How a bounded wait ended. `Completed` is the only success.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Completed = 0,
    TimedOut = 1,
    Cancelled = 2,
    PeerLost = 3,
    Rejected = 4,
}

impl Outcome {
    pub fn is_completed(self) -> bool {
        self == Outcome::Completed
    }
}
