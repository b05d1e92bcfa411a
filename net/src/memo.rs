//! A few values per thread that decoding made and checked, so that the
//! same text on the wire again is not checked and allocated again.
//!
//! Every call and cast carries the same names (its origin's proc and
//! actor, the mesh's shape, the selection's text), and a control thread
//! decodes tens of thousands a second: checking and allocating them again
//! each time was a tenth of a proc's CPU under pipelined calls. A
//! [`Memo`] keeps the last [`MEMO_SLOTS`] values a decoder (or an encoder)
//! made; a decoder
//! looks its input up first and, on a hit, clones what it made for the same
//! input before (an `Arc` clone for names). A value is kept only when
//! making it succeeded, and it is made from the input alone, so a hit
//! returns exactly what decoding the input would (the tests of each decoder
//! that uses one check it against a fresh decode); refused input is never
//! kept, and a stream of distinct inputs costs one comparison per slot and
//! evicts the oldest.
//!
//! Use one in a `thread_local!` per decoded type:
//!
//! ```
//! use regent_net::memo::Memo;
//!
//! thread_local! {
//!     static WORDS: Memo<std::sync::Arc<str>> = const { Memo::new() };
//! }
//!
//! fn word(text: &str) -> Result<std::sync::Arc<str>, String> {
//!     WORDS.with(|m| {
//!         m.get_or_try(
//!             |w| **w == *text,
//!             || if text.is_empty() { Err("empty".to_owned()) } else { Ok(text.into()) },
//!         )
//!     })
//! }
//!
//! let a = word("hosts").unwrap();
//! let b = word("hosts").unwrap();
//! assert!(std::sync::Arc::ptr_eq(&a, &b));
//! assert!(word("").is_err());
//! ```

use std::cell::{Cell, RefCell};

/// How many values a [`Memo`] keeps.
pub const MEMO_SLOTS: usize = 8;

/// The last [`MEMO_SLOTS`] values made by one decoder on one thread.
#[derive(Debug, Default)]
pub struct Memo<T> {
    slots: RefCell<Vec<T>>,
    /// The slot the next value replaces once all are full.
    next: Cell<usize>,
}

impl<T: Clone> Memo<T> {
    /// An empty memo.
    pub const fn new() -> Self {
        Self {
            slots: RefCell::new(Vec::new()),
            next: Cell::new(0),
        }
    }

    /// A clone of the kept value that `hit` accepts, if any.
    pub fn find(&self, hit: impl Fn(&T) -> bool) -> Option<T> {
        self.find_map(|v| hit(v).then(|| v.clone()))
    }

    /// What `f` takes from the first kept value it takes anything from
    /// (a part of it, without cloning the rest).
    pub fn find_map<R>(&self, f: impl Fn(&T) -> Option<R>) -> Option<R> {
        self.slots.borrow().iter().find_map(f)
    }

    /// Keeps `value`, replacing the oldest kept value when full.
    pub fn keep(&self, value: T) {
        let mut slots = self.slots.borrow_mut();
        if slots.len() < MEMO_SLOTS {
            slots.push(value);
        } else {
            let at = self.next.get() % MEMO_SLOTS;
            slots[at] = value;
            self.next.set(at + 1);
        }
    }

    /// A clone of the kept value that `hit` accepts, else the value `make`
    /// makes, kept when it is one. `make` may use other memos, even this
    /// one: no borrow is held while it runs.
    pub fn get_or_try<E>(
        &self,
        hit: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        if let Some(kept) = self.find(hit) {
            return Ok(kept);
        }
        let made = make()?;
        self.keep(made.clone());
        Ok(made)
    }
}

/// Decodes a string-valued `T` through `memo` (a thread's [`Memo`] of
/// them, each with its text as `text` gives it): kept text is not made
/// again, and other text is made by `make` and kept when it is valid.
///
/// From a binary format (postcard writes a string as its length and its
/// bytes, as it writes bytes) the text is taken as bytes and looked up
/// before it is checked as UTF-8: on a hit the check is skipped, since
/// the bytes equal a kept text's, which is UTF-8. Those checks were ~1,200
/// instructions of each pipelined call at a proc. Human-readable formats
/// hand over a string (lent where they can, a transient one for a JSON
/// string with escapes).
pub fn decode_str<'de, D, T, M>(
    deserializer: D,
    memo: &'static std::thread::LocalKey<Memo<T>>,
    text: impl Fn(&T) -> &str,
    make: impl FnOnce(&str) -> Result<T, M>,
) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Clone,
    M: std::fmt::Display,
{
    struct Visit<'a, T: 'static, K, F> {
        memo: &'static std::thread::LocalKey<Memo<T>>,
        text: &'a K,
        make: F,
    }
    impl<T, K, F, M> Visit<'_, T, K, F>
    where
        T: Clone,
        K: Fn(&T) -> &str,
        F: FnOnce(&str) -> Result<T, M>,
    {
        fn made(self, s: &str) -> Result<T, M> {
            let text = self.text;
            self.memo
                .with(|m| m.get_or_try(|kept| text(kept) == s, || (self.make)(s)))
        }
    }
    impl<T, K, F, M> serde::de::Visitor<'_> for Visit<'_, T, K, F>
    where
        T: Clone,
        K: Fn(&T) -> &str,
        F: FnOnce(&str) -> Result<T, M>,
        M: std::fmt::Display,
    {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
            self.made(v).map_err(E::custom)
        }
        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<T, E> {
            let text = self.text;
            if let Some(kept) = self
                .memo
                .with(|m| m.find(|kept| text(kept).as_bytes() == v))
            {
                return Ok(kept);
            }
            let s = std::str::from_utf8(v)
                .map_err(|_| E::invalid_value(serde::de::Unexpected::Bytes(v), &self))?;
            self.made(s).map_err(E::custom)
        }
    }
    let visit = Visit {
        memo,
        text: &text,
        make,
    };
    if deserializer.is_human_readable() {
        deserializer.deserialize_str(visit)
    } else {
        deserializer.deserialize_bytes(visit)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn get(m: &Memo<Arc<str>>, text: &str, made: &mut u32) -> Result<Arc<str>, ()> {
        m.get_or_try(
            |w| **w == *text,
            || {
                *made += 1;
                if text == "bad" {
                    Err(())
                } else {
                    Ok(text.into())
                }
            },
        )
    }

    #[test]
    fn a_hit_returns_the_kept_value_and_makes_nothing() {
        let m = Memo::new();
        let mut made = 0;
        let a = get(&m, "hosts", &mut made).unwrap();
        let b = get(&m, "hosts", &mut made).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(made, 1);
        let c = get(&m, "gpus", &mut made).unwrap();
        assert_eq!(&*c, "gpus");
        assert_eq!(made, 2);
    }

    #[test]
    fn refused_input_is_never_kept() {
        let m = Memo::new();
        let mut made = 0;
        assert!(get(&m, "bad", &mut made).is_err());
        assert!(get(&m, "bad", &mut made).is_err());
        assert_eq!(made, 2, "a refusal is made again, not remembered");
        assert!(m.slots.borrow().is_empty());
    }

    #[test]
    fn past_its_slots_the_oldest_value_goes_first() {
        let m = Memo::new();
        let mut made = 0;
        let names: Vec<String> = (0..=MEMO_SLOTS).map(|i| format!("n{i}")).collect();
        for n in &names {
            get(&m, n, &mut made).unwrap();
        }
        assert_eq!(m.slots.borrow().len(), MEMO_SLOTS);
        assert_eq!(made as usize, MEMO_SLOTS + 1);
        // The newest and the others after the first are still kept...
        for n in &names[1..] {
            get(&m, n, &mut made).unwrap();
        }
        assert_eq!(made as usize, MEMO_SLOTS + 1);
        // ...and the first was replaced.
        get(&m, &names[0], &mut made).unwrap();
        assert_eq!(made as usize, MEMO_SLOTS + 2);
    }

    #[test]
    fn make_may_use_the_same_memo() {
        let m: Memo<Arc<str>> = Memo::new();
        let outer = m
            .get_or_try(
                |w| &**w == "outer",
                || -> Result<Arc<str>, ()> {
                    let inner = m.get_or_try(|w| &**w == "inner", || Ok("inner".into()))?;
                    Ok(format!("outer-of-{inner}").into())
                },
            )
            .unwrap();
        assert_eq!(&*outer, "outer-of-inner");
    }

    thread_local! {
        static WORDS: Memo<Arc<str>> = const { Memo::new() };
    }

    /// A word decoded through `WORDS`; empty text is refused.
    #[derive(Debug)]
    struct Word(Arc<str>);

    impl<'de> serde::Deserialize<'de> for Word {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            decode_str(
                d,
                &WORDS,
                |w: &Arc<str>| w,
                |s| {
                    if s.is_empty() {
                        Err("empty")
                    } else {
                        Ok(Arc::from(s))
                    }
                },
            )
            .map(Word)
        }
    }

    /// From postcard a kept word is found by its bytes, and from JSON by
    /// its text, the same value either way; bytes that are not UTF-8 and
    /// refused text are errors, and neither is kept.
    #[test]
    fn decode_str_finds_kept_text_by_its_bytes_and_checks_new_text() {
        let bytes = postcard::to_allocvec("hosts").unwrap();
        let first: Word = postcard::from_bytes(&bytes).unwrap();
        let again: Word = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(&*first.0, "hosts");
        assert!(
            Arc::ptr_eq(&first.0, &again.0),
            "the kept word, not a new one"
        );
        let json: Word = serde_json::from_str("\"hosts\"").unwrap();
        assert!(Arc::ptr_eq(&first.0, &json.0));
        let mut not_utf8 = bytes.clone();
        not_utf8[1] = 0xff;
        assert!(postcard::from_bytes::<Word>(&not_utf8).is_err());
        assert!(postcard::from_bytes::<Word>(&postcard::to_allocvec("").unwrap()).is_err());
        assert!(serde_json::from_str::<Word>("\"\"").is_err());
        let kept = WORDS.with(|m| {
            m.slots
                .borrow()
                .iter()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
        });
        assert_eq!(kept, ["hosts"]);
    }
}
