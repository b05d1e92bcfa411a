//! The registries of mesh actor types and reducers, filled at link time
//! (`inventory`), so that every proc of the same binary can spawn an actor or
//! apply a reducer by name.

use std::collections::HashMap;
use std::sync::OnceLock;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use ractor::{Actor, ActorCell, ActorRef, SpawnErr};
use regent_supervisor::{Guarded, Panic};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::actor::{MemberActor, MemberMsg, MemberStart, MeshActor, decode, encode};

/// Registers a [`MeshActor`] type so that procs can spawn it by name.
///
/// ```
/// use regent_mesh::{ActorError, Member, MeshActor};
///
/// struct Counter(u64);
///
/// impl MeshActor for Counter {
///     const NAME: &'static str = "docs/counter";
///     type Args = u64;
///     type Msg = u64;
///     type Reply = u64;
///
///     async fn new(_: &Member, start: u64) -> Result<Self, ActorError> {
///         Ok(Self(start))
///     }
///
///     async fn handle(&mut self, _: &Member, add: u64) -> Result<u64, ActorError> {
///         self.0 += add;
///         Ok(self.0)
///     }
/// }
///
/// regent_mesh::register_actor!(Counter);
/// assert!(regent_mesh::registry::actor_type("docs/counter").is_some());
/// ```
#[macro_export]
macro_rules! register_actor {
    ($actor:ty) => {
        $crate::inventory::submit! {
            $crate::registry::ActorType::of::<$actor>()
        }
    };
}

/// Registers a [`Reducer`] so that the procs of a cast tree can apply it.
#[macro_export]
macro_rules! register_reducer {
    ($reducer:ty) => {
        $crate::inventory::submit! {
            $crate::registry::ReducerType::of::<$reducer>()
        }
    };
}

/// The future that spawns one member.
pub type SpawnFuture = BoxFuture<'static, Result<ActorRef<MemberMsg>, String>>;

/// A registered mesh actor type.
#[derive(Debug)]
pub struct ActorType {
    /// Its [`MeshActor::NAME`].
    pub name: &'static str,
    spawn: fn(MemberStart, ActorCell) -> SpawnFuture,
}

impl ActorType {
    /// The registration of `A`.
    pub const fn of<A: MeshActor>() -> Self {
        Self {
            name: A::NAME,
            spawn: spawn_member::<A>,
        }
    }

    /// Spawns a member linked to `supervisor`.
    pub(crate) fn spawn(&self, start: MemberStart, supervisor: ActorCell) -> SpawnFuture {
        (self.spawn)(start, supervisor)
    }
}

fn spawn_member<A: MeshActor>(start: MemberStart, supervisor: ActorCell) -> SpawnFuture {
    async move {
        match Actor::spawn_linked(None, Guarded(MemberActor::<A>::new()), start, supervisor).await {
            Ok((actor, _)) => Ok(actor),
            Err(SpawnErr::StartupFailed(e)) => Err(match e.downcast_ref::<Panic>() {
                Some(p) => format!("{} panicked while starting: {}", A::NAME, p.0),
                None => format!("{} failed to start: {e}", A::NAME),
            }),
            Err(e) => Err(e.to_string()),
        }
    }
    .boxed()
}

inventory::collect!(ActorType);

/// A commutative, associative way to combine two replies, applied inside the
/// cast tree so that the caller receives one value per subtree.
pub trait Reducer: Send + Sync + 'static {
    /// The name procs know it by (e.g. `"sum/u64"`).
    const NAME: &'static str;
    /// The values it combines (the actor's reply type).
    type Value: Serialize + DeserializeOwned + Send + 'static;
    /// Combines two values. Must be commutative and associative: the tree
    /// combines in no particular order.
    fn reduce(a: Self::Value, b: Self::Value) -> Self::Value;
}

/// A registered reducer, working on encoded values.
#[derive(Debug)]
pub struct ReducerType {
    /// Its [`Reducer::NAME`].
    pub name: &'static str,
    reduce: fn(&[u8], &[u8]) -> Result<Bytes, String>,
}

impl ReducerType {
    /// The registration of `R`.
    pub const fn of<R: Reducer>() -> Self {
        Self {
            name: R::NAME,
            reduce: reduce_encoded::<R>,
        }
    }

    /// Combines two encoded values.
    pub(crate) fn reduce(&self, a: &[u8], b: &[u8]) -> Result<Bytes, String> {
        (self.reduce)(a, b)
    }
}

fn reduce_encoded<R: Reducer>(a: &[u8], b: &[u8]) -> Result<Bytes, String> {
    let a: R::Value = decode(a)?;
    let b: R::Value = decode(b)?;
    encode(&R::reduce(a, b))
}

inventory::collect!(ReducerType);

struct Tables {
    actors: HashMap<&'static str, &'static ActorType>,
    reducers: HashMap<&'static str, &'static ReducerType>,
    duplicates: Vec<&'static str>,
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| {
        let mut t = Tables {
            actors: HashMap::new(),
            reducers: HashMap::new(),
            duplicates: Vec::new(),
        };
        for a in inventory::iter::<ActorType> {
            if t.actors.insert(a.name, a).is_some() {
                t.duplicates.push(a.name);
            }
        }
        for r in inventory::iter::<ReducerType> {
            if t.reducers.insert(r.name, r).is_some() {
                t.duplicates.push(r.name);
            }
        }
        if !t.duplicates.is_empty() {
            tracing::error!(names = ?t.duplicates, "names registered twice; the last one wins");
        }
        t
    })
}

/// The actor type registered under `name`.
pub fn actor_type(name: &str) -> Option<&'static ActorType> {
    tables().actors.get(name).copied()
}

/// The reducer registered under `name`.
pub fn reducer(name: &str) -> Option<&'static ReducerType> {
    tables().reducers.get(name).copied()
}

/// The names of every registered actor type, sorted.
pub fn actor_types() -> Vec<&'static str> {
    let mut v: Vec<_> = tables().actors.keys().copied().collect();
    v.sort_unstable();
    v
}

/// Adds replies (integers wrap around on overflow).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sum<T>(std::marker::PhantomData<fn() -> T>);

/// The least reply.
#[derive(Debug, Clone, Copy, Default)]
pub struct Min<T>(std::marker::PhantomData<fn() -> T>);

/// The greatest reply.
#[derive(Debug, Clone, Copy, Default)]
pub struct Max<T>(std::marker::PhantomData<fn() -> T>);

macro_rules! builtin {
    ($name:ident, $f:expr; $($t:ty => $n:literal),* $(,)?) => {
        $(
            impl Reducer for $name<$t> {
                const NAME: &'static str = $n;
                type Value = $t;
                fn reduce(a: $t, b: $t) -> $t {
                    let f: fn($t, $t) -> $t = $f;
                    f(a, b)
                }
            }
            register_reducer!($name<$t>);
        )*
    };
}

builtin!(Sum, |a, b| a + b; f32 => "sum/f32", f64 => "sum/f64");
builtin!(Sum, |a, b| a.wrapping_add(b);
    i32 => "sum/i32", i64 => "sum/i64", u32 => "sum/u32", u64 => "sum/u64", usize => "sum/usize");
builtin!(Min, |a, b| if b < a { b } else { a };
    i32 => "min/i32", i64 => "min/i64", u32 => "min/u32", u64 => "min/u64", usize => "min/usize",
    f32 => "min/f32", f64 => "min/f64");
builtin!(Max, |a, b| if b > a { b } else { a };
    i32 => "max/i32", i64 => "max/i64", u32 => "max/u32", u64 => "max/u64", usize => "max/usize",
    f32 => "max/f32", f64 => "max/f64");
