//! Identity and addressing: who a message is from and to, and where a proc
//! listens.
//!
//! A [`ProcId`] names an OS process that holds actors. It is also the DNS name
//! in the proc's certificate, so its syntax is that of a DNS label. An
//! [`ActorId`] is a proc, an actor name and an index (the member of a mesh); a
//! [`PortId`] is one inbox of an actor. A [`ProcAddr`] says where a proc's QUIC
//! endpoint listens and prints as `quic://127.0.0.1:4433/proc-name`.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::memo::{self, Memo};

/// The longest [`ProcId`], in bytes (one DNS label).
pub const MAX_PROC_ID_BYTES: usize = 63;
/// The longest actor name, in bytes.
pub const MAX_ACTOR_NAME_BYTES: usize = 64;

/// Why a name or an address did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The name is empty.
    #[error("empty name")]
    Empty,
    /// The name is longer than allowed.
    #[error("name of {len} bytes is longer than the {max} allowed")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The name holds a character outside the allowed set.
    #[error("character {ch:?} at byte {at} is not allowed (allowed: {allowed})")]
    InvalidChar {
        /// The character.
        ch: char,
        /// Its byte offset.
        at: usize,
        /// The allowed set, in words.
        allowed: &'static str,
    },
    /// A proc id starts or ends with `-`, which a DNS label may not.
    #[error("a proc id may not start or end with '-'")]
    EdgeHyphen,
    /// An actor or port id lacks a part (`proc/name[index]#port`).
    #[error("missing {0}")]
    Missing(&'static str),
    /// A numeric part (index, port) is not a number.
    #[error("invalid number {0:?}")]
    InvalidNumber(String),
    /// An address does not start with `quic://`.
    #[error("address {0:?} does not start with quic://")]
    Scheme(String),
    /// The socket address part of an address does not parse.
    #[error("invalid socket address {0:?}")]
    SocketAddr(String),
}

/// The name of a proc: 1 to 63 bytes of `a-z`, `0-9` and `-`, not starting or
/// ending with `-` (a DNS label, so it can be a certificate's subject name).
/// Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcId(Arc<str>);

impl ProcId {
    /// Checks and wraps a proc name.
    pub fn new(name: &str) -> Result<Self, IdError> {
        if name.is_empty() {
            return Err(IdError::Empty);
        }
        if name.len() > MAX_PROC_ID_BYTES {
            return Err(IdError::TooLong {
                len: name.len(),
                max: MAX_PROC_ID_BYTES,
            });
        }
        if let Some((at, ch)) = name
            .char_indices()
            .find(|&(_, c)| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
        {
            return Err(IdError::InvalidChar {
                ch,
                at,
                allowed: "a-z, 0-9 and '-'",
            });
        }
        if name.starts_with('-') || name.ends_with('-') {
            return Err(IdError::EdgeHyphen);
        }
        Ok(Self(name.into()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The actor `name[index]` in this proc.
    pub fn actor(&self, name: &str, index: u32) -> Result<ActorId, IdError> {
        Ok(ActorId {
            proc: self.clone(),
            name: ActorName::new(name)?,
            index,
        })
    }
}

impl fmt::Display for ProcId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ProcId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProcId({})", self.0)
    }
}

impl FromStr for ProcId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl Serialize for ProcId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ProcId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        thread_local! {
            static DECODED: Memo<ProcId> = const { Memo::new() };
        }
        memo::decode_str(d, &DECODED, |p: &ProcId| &p.0, Self::new)
    }
}

/// The name of an actor within its proc: 1 to 64 bytes of ASCII letters,
/// digits, `-` and `_`. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActorName(Arc<str>);

impl ActorName {
    /// Checks and wraps an actor name.
    pub fn new(name: &str) -> Result<Self, IdError> {
        if name.is_empty() {
            return Err(IdError::Empty);
        }
        if name.len() > MAX_ACTOR_NAME_BYTES {
            return Err(IdError::TooLong {
                len: name.len(),
                max: MAX_ACTOR_NAME_BYTES,
            });
        }
        if let Some((at, ch)) = name
            .char_indices()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        {
            return Err(IdError::InvalidChar {
                ch,
                at,
                allowed: "A-Z, a-z, 0-9, '-' and '_'",
            });
        }
        Ok(Self(name.into()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ActorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ActorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ActorName({})", self.0)
    }
}

impl Serialize for ActorName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ActorName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        thread_local! {
            static DECODED: Memo<ActorName> = const { Memo::new() };
        }
        memo::decode_str(d, &DECODED, |n: &ActorName| &n.0, Self::new)
    }
}

/// An actor: its proc, its name and its index (the member of a mesh, 0 for a
/// lone actor). Prints as `proc/name[index]`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ActorId {
    /// The proc that holds the actor.
    pub proc: ProcId,
    /// The actor's name.
    pub name: ActorName,
    /// The actor's index.
    pub index: u32,
}

impl ActorId {
    /// The actor's port `port`.
    pub fn port(&self, port: u32) -> PortId {
        PortId {
            actor: self.clone(),
            port,
        }
    }
}

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}[{}]", self.proc, self.name, self.index)
    }
}

impl fmt::Debug for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ActorId({self})")
    }
}

impl FromStr for ActorId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (proc, rest) = s
            .split_once('/')
            .ok_or(IdError::Missing("'/' after the proc"))?;
        let rest = rest
            .strip_suffix(']')
            .ok_or(IdError::Missing("']' after the index"))?;
        let (name, index) = rest
            .split_once('[')
            .ok_or(IdError::Missing("'[' before the index"))?;
        let index = index
            .parse::<u32>()
            .map_err(|_| IdError::InvalidNumber(index.to_owned()))?;
        ProcId::new(proc)?.actor(name, index)
    }
}

/// One inbox of an actor. Prints as `proc/name[index]#port`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PortId {
    /// The actor that owns the port.
    pub actor: ActorId,
    /// The port number within the actor.
    pub port: u32,
}

impl PortId {
    /// The proc that holds the port.
    pub fn proc(&self) -> &ProcId {
        &self.actor.proc
    }
}

impl fmt::Display for PortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.actor, self.port)
    }
}

impl fmt::Debug for PortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PortId({self})")
    }
}

impl FromStr for PortId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (actor, port) = s
            .rsplit_once('#')
            .ok_or(IdError::Missing("'#' before the port"))?;
        let port = port
            .parse::<u32>()
            .map_err(|_| IdError::InvalidNumber(port.to_owned()))?;
        Ok(actor.parse::<ActorId>()?.port(port))
    }
}

/// Where a proc's QUIC endpoint listens. Prints as
/// `quic://127.0.0.1:4433/proc-name` (`quic://[::1]:4433/proc-name` for IPv6).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProcAddr {
    /// The UDP socket address.
    pub socket: SocketAddr,
    /// The proc listening there.
    pub proc: ProcId,
}

impl fmt::Display for ProcAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quic://{}/{}", self.socket, self.proc)
    }
}

impl FromStr for ProcAddr {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s
            .strip_prefix("quic://")
            .ok_or_else(|| IdError::Scheme(s.to_owned()))?;
        let (socket, proc) = rest
            .rsplit_once('/')
            .ok_or(IdError::Missing("'/' before the proc"))?;
        let socket = socket
            .parse::<SocketAddr>()
            .map_err(|_| IdError::SocketAddr(socket.to_owned()))?;
        Ok(Self {
            socket,
            proc: ProcId::new(proc)?,
        })
    }
}

/// One run of a proc's endpoint: drawn at random when the endpoint starts, so
/// a restarted proc (same [`ProcId`]) is told apart from the one before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Incarnation(pub u64);

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Debug for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Incarnation({self})")
    }
}

/// A mesh generation: grows at every restart of a mesh. The transport carries
/// it and fences ports by it (see [`crate::Inbox::set_fence`]); `mesh/` gives
/// it meaning.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct Generation(pub u64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gen{}", self.0)
    }
}

/// The sequence number of a message on one (sender actor, receiver actor)
/// pair, from 1. Local deliveries carry 0.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct Seq(pub u64);

/// Names a message type on the wire: the 64-bit FNV-1a hash of
/// [`Message::TYPE_NAME`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TypeTag(pub u64);

impl TypeTag {
    /// The tag of a type name.
    pub const fn from_name(name: &str) -> Self {
        let bytes = name.as_bytes();
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut i = 0;
        while i < bytes.len() {
            hash ^= bytes[i] as u64;
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            i += 1;
        }
        Self(hash)
    }

    /// The tag of a message type.
    pub const fn of<M: Message>() -> Self {
        Self::from_name(M::TYPE_NAME)
    }
}

impl fmt::Debug for TypeTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TypeTag({:016x})", self.0)
    }
}

/// A type that travels between actors. Local sends hand the value over as it
/// is; remote sends encode it with the wire codec.
pub trait Message: Serialize + serde::de::DeserializeOwned + Send + 'static {
    /// The type's name on the wire, the same in every proc of a cluster and
    /// unique within it (e.g. `"trainer/Step"`). Renaming it is a wire change.
    const TYPE_NAME: &'static str;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_and_parse_back() {
        let actor = ProcId::new("trainer-0")
            .unwrap()
            .actor("worker", 3)
            .unwrap();
        assert_eq!(actor.to_string(), "trainer-0/worker[3]");
        assert_eq!(actor.to_string().parse::<ActorId>().unwrap(), actor);
        let port = actor.port(7);
        assert_eq!(port.to_string(), "trainer-0/worker[3]#7");
        assert_eq!(port.to_string().parse::<PortId>().unwrap(), port);
        for text in ["quic://127.0.0.1:4433/proc-name", "quic://[::1]:9/p"] {
            let addr: ProcAddr = text.parse().unwrap();
            assert_eq!(addr.to_string(), text);
        }
    }

    #[test]
    fn bad_ids_get_typed_errors() {
        assert_eq!(ProcId::new(""), Err(IdError::Empty));
        assert_eq!(ProcId::new("-a"), Err(IdError::EdgeHyphen));
        assert!(matches!(
            ProcId::new("Abc"),
            Err(IdError::InvalidChar { ch: 'A', at: 0, .. })
        ));
        assert!(matches!(
            ProcId::new(&"a".repeat(64)),
            Err(IdError::TooLong { len: 64, max: 63 })
        ));
        assert!(matches!(
            "http://1.2.3.4:5/p".parse::<ProcAddr>(),
            Err(IdError::Scheme(_))
        ));
        assert!(matches!(
            "quic://1.2.3:5/p".parse::<ProcAddr>(),
            Err(IdError::SocketAddr(_))
        ));
        assert!(matches!(
            "quic://1.2.3.4:5/P".parse::<ProcAddr>(),
            Err(IdError::InvalidChar { .. })
        ));
        assert!(matches!(
            "p/a[x]".parse::<ActorId>(),
            Err(IdError::InvalidNumber(_))
        ));
        assert!(matches!("p/a".parse::<ActorId>(), Err(IdError::Missing(_))));
        assert!(matches!(
            "p/a[1]".parse::<PortId>(),
            Err(IdError::Missing(_))
        ));
    }

    proptest::proptest! {
        /// The decoders keep the names they decoded last on their thread
        /// (`crate::memo`): a stream of names that repeat, refused ones
        /// among them, decodes each to what checking that name gives, from
        /// postcard (lent strings) and JSON (escaped ones) alike.
        #[test]
        fn decoding_a_stream_of_names_checks_each_one(
            names in proptest::collection::vec("[a-cA_-]{0,4}|[a-z0-9-]{62,65}", 1..12),
            picks in proptest::collection::vec(proptest::arbitrary::any::<proptest::sample::Index>(), 1..40),
        ) {
            for (i, pick) in picks.iter().enumerate() {
                let name = pick.get(&names);
                let wire = postcard::to_allocvec(name.as_str()).unwrap();
                let json = serde_json::to_string(name).unwrap().replace('a', "\\u0061");
                let (proc, actor) = if i % 2 == 0 {
                    (postcard::from_bytes::<ProcId>(&wire).ok(), postcard::from_bytes::<ActorName>(&wire).ok())
                } else {
                    (serde_json::from_str::<ProcId>(&json).ok(), serde_json::from_str::<ActorName>(&json).ok())
                };
                proptest::prop_assert_eq!(proc, ProcId::new(name).ok(), "{}", name);
                proptest::prop_assert_eq!(actor, ActorName::new(name).ok(), "{}", name);
            }
        }
    }

    #[test]
    fn type_tags_are_fnv1a() {
        // FNV-1a 64 of "a", a published test vector.
        assert_eq!(TypeTag::from_name("a").0, 0xaf63_dc4c_8601_ec8c);
    }
}
