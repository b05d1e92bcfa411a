//! The registry of mesh actor types, filled at link time (`inventory`), so
//! that every proc of the same binary can spawn an actor by name.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::actor::MeshActor;
use crate::life::{self, LifeStart, Running, SpawnFn};

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

/// A registered mesh actor type.
#[derive(Debug)]
pub struct ActorType {
    /// Its [`MeshActor::NAME`].
    pub name: &'static str,
    spawn: SpawnFn,
}

impl ActorType {
    /// The registration of `A`.
    pub const fn of<A: MeshActor>() -> Self {
        Self {
            name: A::NAME,
            spawn: life::spawn::<A>,
        }
    }

    /// Starts a life of this type on a thread of its own.
    pub(crate) fn spawn(
        &self,
        start: LifeStart,
    ) -> futures::future::BoxFuture<'static, Result<Running, String>> {
        (self.spawn)(start)
    }
}

inventory::collect!(ActorType);

struct Tables {
    actors: HashMap<&'static str, &'static ActorType>,
    duplicates: Vec<&'static str>,
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| {
        let mut t = Tables {
            actors: HashMap::new(),
            duplicates: Vec::new(),
        };
        for a in inventory::iter::<ActorType> {
            if t.actors.insert(a.name, a).is_some() {
                t.duplicates.push(a.name);
            }
        }
        if !t.duplicates.is_empty() {
            tracing::error!(names = ?t.duplicates, "names registered twice; the last one wins");
        }
        t
    })
}

/// Finds an actor type by name (the registry's, or the simulation's own).
pub(crate) type ActorTypes = fn(&str) -> Option<&'static ActorType>;

/// The actor type registered under `name`.
pub fn actor_type(name: &str) -> Option<&'static ActorType> {
    tables().actors.get(name).copied()
}

/// The names of every registered actor type, sorted.
pub fn actor_types() -> Vec<&'static str> {
    let mut v: Vec<_> = tables().actors.keys().copied().collect();
    v.sort_unstable();
    v
}
