//! Reducers, registered by name at link time (`inventory`), so that every
//! proc of a cast tree can combine replies inside the tree.

use std::collections::HashMap;
use std::sync::OnceLock;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::protocol::{decode, encode};

/// Registers a [`Reducer`] so that the procs of a cast tree can apply it.
#[macro_export]
macro_rules! register_reducer {
    ($reducer:ty) => {
        $crate::inventory::submit! {
            $crate::reducer::ReducerType::of::<$reducer>()
        }
    };
}

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

/// The reducer registered under `name`.
pub fn reducer(name: &str) -> Option<&'static ReducerType> {
    static TABLE: OnceLock<HashMap<&'static str, &'static ReducerType>> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            let mut table = HashMap::new();
            for r in inventory::iter::<ReducerType> {
                if table.insert(r.name, r).is_some() {
                    tracing::error!(
                        name = r.name,
                        "a reducer name registered twice; the last one wins"
                    );
                }
            }
            table
        })
        .get(name)
        .copied()
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
