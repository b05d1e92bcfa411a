//! Session bookkeeping without sockets: what a sender keeps until it is
//! acknowledged, and what a receiver remembers to drop duplicates. The
//! transport drives these with frames; tests drive them directly.
//!
//! Per (sender actor, receiver actor) pair:
//! - [`SendWindow`] assigns sequences from 1, keeps every message until a
//!   cumulative `Ack` covers it or a `Reject` names it, and replays the kept
//!   ones on a new stream (resume). A peer with a new incarnation gets a fresh
//!   window: what it may have seen is given back, the rest is renumbered.
//! - [`RecvWindow`] delivers each sequence once: a replayed sequence at or
//!   below the highest handled one is a duplicate. It keeps the last
//!   [`REJECT_MEMORY`] rejections so that a replayed rejected message is
//!   rejected again rather than silently acknowledged.

use std::collections::VecDeque;

use crate::id::Seq;
use crate::wire::{RejectCause, WireError};

/// Rejections a [`RecvWindow`] remembers, to answer a replay of a rejected
/// message (after a reconnect) with the same rejection.
pub const REJECT_MEMORY: usize = 64;

/// A message the sender keeps until it is acknowledged.
pub trait Pending {
    /// Gives the message a new sequence (a fresh session after the peer
    /// restarted).
    fn renumber(&mut self, seq: Seq);
}

/// The sender's side of one pair.
#[derive(Debug)]
pub struct SendWindow<T> {
    next_seq: u64,
    /// Kept messages in sequence order (contiguous sequences).
    pending: VecDeque<(Seq, T)>,
    /// How many of `pending` were written on the current stream.
    written: usize,
    /// How many of `pending` were written on any stream (the peer may have
    /// seen them).
    ever_written: usize,
}

impl<T: Pending> Default for SendWindow<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Pending> SendWindow<T> {
    /// An empty window; the first sequence is 1.
    pub fn new() -> Self {
        Self {
            next_seq: 1,
            pending: VecDeque::new(),
            written: 0,
            ever_written: 0,
        }
    }

    /// The sequence the next message gets.
    pub fn next_seq(&self) -> Seq {
        Seq(self.next_seq)
    }

    /// Messages kept (written or not).
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Whether some kept messages are not yet written on the current stream.
    pub fn has_unwritten(&self) -> bool {
        self.written < self.pending.len()
    }

    /// Keeps a message that was built with [`Self::next_seq`].
    pub fn push(&mut self, seq: Seq, item: T) {
        assert_eq!(
            seq.0, self.next_seq,
            "messages are pushed in sequence order"
        );
        self.next_seq += 1;
        self.pending.push_back((seq, item));
    }

    /// Marks every unwritten message written and hands each to `write`.
    pub fn take_unwritten(&mut self, mut write: impl FnMut(&T)) {
        for (_, item) in self.pending.iter().skip(self.written) {
            write(item);
        }
        self.written = self.pending.len();
        self.ever_written = self.ever_written.max(self.written);
    }

    /// A new stream starts: everything kept is written again, from the
    /// returned sequence on (the `first_seq` of its `Open`).
    pub fn rewind(&mut self) -> Seq {
        self.written = 0;
        self.pending.front().map_or(Seq(self.next_seq), |(s, _)| *s)
    }

    /// Applies a cumulative acknowledgement; returns the released messages.
    pub fn ack(&mut self, up_to: Seq) -> Result<Vec<T>, WireError> {
        if up_to.0 >= self.next_seq {
            return Err(WireError::Protocol(format!(
                "ack of {} but only {} were sent",
                up_to.0,
                self.next_seq - 1
            )));
        }
        let mut released = Vec::new();
        while let Some((seq, _)) = self.pending.front() {
            if seq.0 > up_to.0 {
                break;
            }
            if self.written == 0 {
                return Err(WireError::Protocol(format!(
                    "ack of {} covers messages not written on this stream",
                    up_to.0
                )));
            }
            if let Some((_, item)) = self.pending.pop_front() {
                released.push(item);
            }
            self.written -= 1;
            self.ever_written = self.ever_written.saturating_sub(1);
        }
        Ok(released)
    }

    /// Applies a rejection; returns the rejected message.
    pub fn reject(&mut self, seq: Seq) -> Result<T, WireError> {
        let Some(at) = self.pending.iter().position(|(s, _)| *s == seq) else {
            return Err(WireError::Protocol(format!(
                "reject of {} which is not pending",
                seq.0
            )));
        };
        if at >= self.written {
            return Err(WireError::Protocol(format!(
                "reject of {} which was not written on this stream",
                seq.0
            )));
        }
        self.written -= 1;
        self.ever_written = self.ever_written.saturating_sub(1);
        // Contiguity of `pending` no longer holds after this removal; only
        // `rewind` reads the front, and a gap is declared by `first_seq`.
        Ok(self
            .pending
            .remove(at)
            .map(|(_, item)| item)
            .unwrap_or_else(|| unreachable!("position {at} was found in the deque a moment ago")))
    }

    /// The peer closed the stream: gives back every message it may have
    /// seen; the rest stays for the next stream.
    pub fn give_back_written(&mut self) -> Vec<T> {
        let n = self.ever_written.min(self.pending.len());
        self.written = 0;
        self.ever_written = 0;
        self.pending.drain(..n).map(|(_, item)| item).collect()
    }

    /// The peer restarted: gives back every message the old incarnation may
    /// have seen and renumbers the rest from 1 for the fresh session.
    pub fn restart_session(&mut self) -> Vec<T> {
        let given = self.give_back_written();
        self.next_seq = 1;
        for (seq, item) in &mut self.pending {
            *seq = Seq(self.next_seq);
            item.renumber(*seq);
            self.next_seq += 1;
        }
        given
    }

    /// The session is over: gives back everything.
    pub fn give_back_all(&mut self) -> Vec<T> {
        self.written = 0;
        self.ever_written = 0;
        self.pending.drain(..).map(|(_, item)| item).collect()
    }
}

/// What a receiver does with an arriving message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// New: deliver it, then call [`RecvWindow::handled`].
    Deliver,
    /// Seen before: drop it; if it was rejected, reject it again.
    Duplicate(Option<RejectCause>),
}

/// The receiver's side of one pair (shared by the streams that carried it).
#[derive(Debug, Clone)]
pub struct RecvWindow {
    epoch: u64,
    handled: u64,
    rejected: VecDeque<(Seq, RejectCause)>,
}

/// The receiver's position on one stream of a pair.
#[derive(Debug, Clone, Copy)]
pub struct StreamCursor {
    next: u64,
}

impl RecvWindow {
    /// A fresh window for the pair epoch `epoch`.
    pub fn new(epoch: u64) -> Self {
        Self {
            epoch,
            handled: 0,
            rejected: VecDeque::new(),
        }
    }

    /// The pair epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The highest sequence handled (delivered or rejected).
    pub fn handled_up_to(&self) -> Seq {
        Seq(self.handled)
    }

    /// A stream opens at `first_seq`. A start beyond the next expected
    /// sequence declares that the sender gave the messages between back.
    pub fn open(&mut self, first_seq: Seq) -> Result<StreamCursor, WireError> {
        if first_seq.0 == 0 {
            return Err(WireError::Protocol("stream opens at sequence 0".into()));
        }
        if first_seq.0 > self.handled + 1 {
            self.handled = first_seq.0 - 1;
        }
        Ok(StreamCursor { next: first_seq.0 })
    }

    /// Judges the next message of a stream.
    pub fn arrive(&self, cursor: &mut StreamCursor, seq: Seq) -> Result<Verdict, WireError> {
        if seq.0 != cursor.next {
            return Err(WireError::Protocol(format!(
                "sequence {} where {} was due",
                seq.0, cursor.next
            )));
        }
        cursor.next += 1;
        if seq.0 <= self.handled {
            let cause = self
                .rejected
                .iter()
                .find(|(s, _)| *s == seq)
                .map(|(_, c)| c.clone());
            return Ok(Verdict::Duplicate(cause));
        }
        debug_assert_eq!(seq.0, self.handled + 1, "contiguous streams leave no gap");
        Ok(Verdict::Deliver)
    }

    /// Records that `seq` (just judged `Deliver`) was delivered, or rejected
    /// with `cause`.
    pub fn handled(&mut self, seq: Seq, rejected: Option<RejectCause>) {
        debug_assert_eq!(seq.0, self.handled + 1, "handled in order");
        self.handled = seq.0;
        if let Some(cause) = rejected {
            if self.rejected.len() == REJECT_MEMORY {
                self.rejected.pop_front();
            }
            self.rejected.push_back((seq, cause));
        }
    }
}

#[cfg(test)]
mod tests;
