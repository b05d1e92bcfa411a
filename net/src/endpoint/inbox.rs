//! Inboxes: where delivered messages wait for their actor.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tokio::sync::mpsc;

use super::Inner;
use crate::id::{ActorId, Generation, Message, PortId, Seq, TypeTag};
use crate::tls::Role;
use crate::wire::{self, WireError};

/// A message's body as it reached the inbox.
pub enum Payload {
    /// From this proc: the value itself, never serialized.
    Local(Box<dyn Any + Send>),
    /// From another proc: the encoded value.
    Wire(Bytes),
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(_) => f.write_str("Local(..)"),
            Self::Wire(b) => write!(f, "Wire({} bytes)", b.len()),
        }
    }
}

/// A delivered message.
#[derive(Debug)]
pub struct Delivery {
    /// The sending actor (authenticated: its proc is the one named by the
    /// certificate of the connection it came on).
    pub sender: ActorId,
    /// The role of the sender's proc, from the certificate of the
    /// connection it came on (this endpoint's own role when local). Check it
    /// before obeying a request: any proc of the cluster can send anything.
    pub sender_role: Role,
    /// The port it was sent to.
    pub receiver: PortId,
    /// Its sequence on the (sender, receiver actor) pair; 0 when local.
    pub seq: Seq,
    /// The sender's mesh generation.
    pub generation: Generation,
    /// Its message type.
    pub type_tag: TypeTag,
    /// The body.
    pub payload: Payload,
}

impl Delivery {
    /// Whether it came from this proc (and so was never serialized).
    pub fn is_local(&self) -> bool {
        matches!(self.payload, Payload::Local(_))
    }

    /// The message as `M`: the value itself when local, decoded otherwise.
    pub fn decode<M: Message>(self) -> Result<M, WireError> {
        let expected = TypeTag::of::<M>();
        if self.type_tag != expected {
            return Err(WireError::TypeMismatch {
                expected,
                found: self.type_tag,
            });
        }
        match self.payload {
            Payload::Local(any) => any.downcast::<M>().map(|b| *b).map_err(|_| {
                WireError::Decode(format!(
                    "local value is not a {} despite its tag",
                    M::TYPE_NAME
                ))
            }),
            Payload::Wire(bytes) => wire::decode_body(&bytes),
        }
    }
}

/// The receiving end of a port. Dropping it closes the port: later messages
/// to it are rejected back to their senders.
pub struct Inbox {
    pub(crate) port: PortId,
    pub(crate) rx: mpsc::Receiver<Delivery>,
    pub(crate) fence: Arc<AtomicU64>,
    pub(crate) endpoint: Arc<Inner>,
}

impl fmt::Debug for Inbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox").field("port", &self.port).finish()
    }
}

impl Inbox {
    /// The port.
    pub fn port(&self) -> &PortId {
        &self.port
    }

    /// The next delivery; `None` once the endpoint is closed.
    pub async fn recv(&mut self) -> Option<Delivery> {
        self.rx.recv().await
    }

    /// The next delivery if one is waiting.
    pub fn try_recv(&mut self) -> Option<Delivery> {
        self.rx.try_recv().ok()
    }

    /// Fences the port: messages of an older generation are rejected back to
    /// their senders (`RejectCause::Fenced`). The fence only grows.
    pub fn set_fence(&self, generation: Generation) {
        self.fence.fetch_max(generation.0, Ordering::AcqRel);
    }

    /// The current fence.
    pub fn fence(&self) -> Generation {
        Generation(self.fence.load(Ordering::Acquire))
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.endpoint.close_port(&self.port, &self.fence);
    }
}
