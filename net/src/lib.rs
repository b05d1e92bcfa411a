//! The control plane of regent: identity and addressing, the wire envelope
//! and its codec, and the QUIC transport with mutual TLS.
//!
//! # Shape
//!
//! - [`id`]: [`ProcId`] (a DNS label, named by the proc's certificate),
//!   [`ActorId`] (proc + name + index), [`PortId`], [`ProcAddr`]
//!   (`quic://127.0.0.1:4433/proc-name`), [`Incarnation`], [`Generation`],
//!   [`Seq`], and the [`Message`] trait with its [`TypeTag`].
//! - [`tls`]: a [`ClusterCa`] made with rcgen (or loaded from PEM) issues
//!   [`ProcCredentials`] with a [`Role`] and a [`Validity`], which build the
//!   rustls and quinn configurations for mutual TLS 1.3 (ring provider).
//!   Reusable by other planes (`rdma/`).
//! - [`wire`]: length-prefixed frames ([`FrameDecoder`], [`encode_frame`]),
//!   the [`Envelope`] and the protocol frames, encoded with postcard. Every
//!   decode failure is a typed [`WireError`].
//! - [`session`]: the socket-free bookkeeping of sequences, acknowledgements,
//!   resume and duplicate detection ([`SendWindow`], [`RecvWindow`]).
//! - [`Endpoint`]: one quinn endpoint per proc. `send` to a port of this
//!   proc hands the value over without serializing; to another proc it goes
//!   on that pair's own QUIC stream of a connection reused for the peer.
//!   [`Inbox`] receives (each [`Delivery`] carries its sender's verified
//!   [`Role`]), [`TransportEvent`]s report links and failures. Incoming
//!   handshakes are bounded (`max_handshakes`, Retry under load).
//!
//! # Guarantees (see `docs/semantics.md` §2 for the contract)
//!
//! - FIFO per (sender actor, receiver actor); a blocked receiver delays only
//!   the pairs that send to it.
//! - An accepted message is delivered once, or comes back as
//!   [`TransportEvent::Undeliverable`] with the message.
//! - A link silent for `failure_timeout` (default 1 s) is reported failed.
//! - Bytes from the network never panic: bad input closes its stream or
//!   connection with a typed error.
//!
//! # Example
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use regent_net::{ClusterCa, Endpoint, EndpointConfig, Generation, Message, ProcId, Role, Validity};
//!
//! #[derive(Debug, serde::Serialize, serde::Deserialize)]
//! struct Ping(u64);
//! impl Message for Ping {
//!     const TYPE_NAME: &'static str = "example/Ping";
//! }
//!
//! let ca = ClusterCa::generate("example cluster")?;
//! let a = ProcId::new("a")?;
//! let b = ProcId::new("b")?;
//! let local = "127.0.0.1:0".parse()?;
//! let ea = Endpoint::bind(ca.issue(&a, Role::Proc, Validity::job())?, local, EndpointConfig::default())?;
//! let eb = Endpoint::bind(ca.issue(&b, Role::Proc, Validity::job())?, local, EndpointConfig::default())?;
//! ea.add_route(eb.addr());
//! let mut inbox = eb.open_port(b.actor("pong", 0)?.port(0))?;
//! ea.send(&a.actor("ping", 0)?, inbox.port(), Generation(0), Ping(1)).await?;
//! let delivery = inbox.recv().await.ok_or("closed")?;
//! assert_eq!(delivery.sender_role, Role::Proc);
//! let Ping(n) = delivery.decode::<Ping>()?;
//! assert_eq!(n, 1);
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

pub mod config;
mod detector;
mod endpoint;
pub mod error;
pub mod event;
pub mod fxhash;
pub mod id;
mod link;
pub mod memo;
pub mod session;
#[cfg(feature = "sim")]
pub mod sim;
pub mod spin;
pub mod tls;
pub mod wire;

pub use config::EndpointConfig;
pub use endpoint::inbox::{Delivery, Inbox, Payload};
pub use endpoint::{ControlTraffic, Endpoint, HandshakeStats};
pub use error::{Error, LinkFailure, SendError, SendFailure, Undeliverable, UndeliveredCause};
pub use event::{Direction, TransportEvent};
pub use id::{
    ActorId, ActorName, Generation, IdError, Incarnation, Message, PortId, ProcAddr, ProcId, Seq,
    TypeTag,
};
pub use session::{RecvWindow, SendWindow};
pub use tls::{ClusterCa, KeyAlgorithm, ProcCredentials, Role, Validity};
pub use wire::{Envelope, FrameDecoder, RejectCause, WireError, encode_frame};

#[cfg(test)]
mod tests;
