//! Selections: which members of a shape a message goes to.
//!
//! A [`Selection`] is a small algebra over the points of a [`Shape`](crate::shape::Shape), with a
//! text syntax that parses ([`FromStr`]) and prints ([`Display`], canonical):
//!
//! | text | meaning |
//! |---|---|
//! | `*` | every member |
//! | `none` | no member |
//! | `hosts=0..2,gpus=*` | constraints on named dimensions, all of which hold; unmentioned dimensions are unconstrained |
//! | `gpus=3`, `gpus=0..8:2`, `gpus=..4`, `gpus=4..` | an index, a range with a step, open ends |
//! | `a \| b`, `a & b`, `(a)` | union, intersection (binds tighter), grouping |
//! | `first`, `first(S)` | the first member of `S` in row-major order (`first` is `first(*)`) |
//! | `first(gpus: S)` | in each group of members that differ only along `gpus`, the first of `S` |
//! | `any`, `any(S)`, `any(gpus: S)` | like `first`, but one member chosen by the caller's seed |
//!
//! Evaluating a selection against a shape ([`Selection::eval`],
//! [`Selection::bind`]) gives the sorted ranks of the selected members;
//! [`Selection::eval_in`] and [`Selected::ranks_in`] restrict that to a
//! sub-view, the way a cast tree splits a selection among forwarders. Naming
//! a dimension the shape lacks, or an index or range bound outside its
//! dimension, is an error at evaluation, never a panic and never silently
//! nothing. The full grammar and rules are in `docs/semantics.md` §3.
//!
//! ```
//! use regent_mesh::selection::Selection;
//! use regent_mesh::shape::{Rank, Shape};
//!
//! let shape = Shape::new([("hosts", 4), ("gpus", 8)])?;
//! let sel: Selection = "hosts=0..2,gpus=*".parse()?;
//! assert_eq!(sel.eval(&shape, 0)?.len(), 16);
//!
//! let sel: Selection = "hosts=1 & gpus=0..8:4 | first".parse()?;
//! assert_eq!(sel.to_string(), "hosts=1 & gpus=0..8:4 | first");
//! let ranks: Vec<u32> = sel.eval(&shape, 0)?.into_iter().map(|r| r.0).collect();
//! assert_eq!(ranks, [0, 8, 12]);
//!
//! // One GPU per host, chosen by the seed.
//! let sel: Selection = "any(gpus: *)".parse()?;
//! assert_eq!(sel.eval(&shape, 7)?.len(), 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Display`]: std::fmt::Display

use std::fmt;
use std::str::FromStr;

use regent_net::memo::{self, Memo};
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::shape::{DimName, DimRange, MAX_DIMS, ShapeError};

mod eval;
mod parse;

pub use eval::Selected;
pub use parse::{Found, ParseError, ParseErrorKind};

/// The longest selection text accepted, in bytes (also the most a selection
/// may print to when it is serialized).
pub const MAX_TEXT_BYTES: usize = 8192;
/// The deepest selection accepted: its AST depth (a leaf is 1, each
/// operator adds 1) and its nesting of parentheses.
pub const MAX_DEPTH: usize = 32;

/// Why a selection could not be evaluated or serialized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectionError {
    /// The selection does not fit the shape: it names a dimension the shape
    /// lacks ([`ShapeError::UnknownDim`]), or an index or range bound lies
    /// outside its dimension ([`ShapeError::IndexOutOfRange`],
    /// [`ShapeError::RangeOutOfRange`]).
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The selection is deeper than [`MAX_DEPTH`].
    #[error("selection of depth {depth} is deeper than the {max} allowed")]
    TooDeep {
        /// Its depth (or the depth at which checking stopped).
        depth: usize,
        /// The limit.
        max: usize,
    },
    /// A selection built in code breaks a structural rule that the parser
    /// enforces: a union or intersection with fewer than two operands, an
    /// empty constraint list, or a dimension named twice in one constraint
    /// list or one `first`/`any` scope.
    #[error("malformed selection: {reason}")]
    Malformed {
        /// The rule broken.
        reason: &'static str,
    },
    /// The selection prints longer than [`MAX_TEXT_BYTES`], so it cannot be
    /// sent.
    #[error("selection prints to {bytes} bytes, more than the {max} allowed")]
    TooLong {
        /// Its printed length.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// [`Shape::select`](crate::shape::Shape::select) was given a selection
    /// that is not a box (`*` or a constraint list), so no view has exactly
    /// its members.
    #[error("selection {selection} is not a box ('*' or constraints like 'hosts=0..2,gpus=*')")]
    NotABox {
        /// The selection, as it prints.
        selection: String,
    },
    /// [`Shape::select`](crate::shape::Shape::select) was given a selection
    /// that selects nothing, and a shape is never empty.
    #[error("selection {selection} selects no member")]
    Empty {
        /// The selection, as it prints.
        selection: String,
    },
}

/// A selection: an AST over the points of a shape. See the module docs for
/// the syntax and `docs/semantics.md` §3 for the rules.
///
/// Parsing and printing round-trip: `s.to_string().parse() == Ok(s)` for
/// every `s` that [`Selection::validate`] accepts and that prints within
/// [`MAX_TEXT_BYTES`]; everything the parser returns is such an `s`. The
/// parser normalizes only range syntax (`..4` is `0..4`, `:1` is dropped)
/// and `first(*)`/`any(*)` (printed `first`/`any`).
///
/// Serde carries a selection as its text, so a decoded selection went
/// through the parser and its limits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Selection {
    /// Every member: `*`.
    All,
    /// No member: `none`.
    None,
    /// Members that meet every constraint (non-empty, each dimension at most
    /// once); unmentioned dimensions are unconstrained: `hosts=0..2,gpus=*`.
    Dims(Vec<Constraint>),
    /// In each group of members of `of` that agree on every dimension
    /// outside `dims`, the first in row-major order. An empty `dims` means
    /// all dimensions (one group): `first`, `first(S)`, `first(gpus: S)`.
    First {
        /// The dimensions along which to pick (empty: all of them).
        dims: Vec<DimName>,
        /// The members to pick from.
        of: Box<Selection>,
    },
    /// Like [`Selection::First`], but in each group the member whose point
    /// index has the smallest hash under the evaluation seed (see
    /// `docs/semantics.md` §3): `any`, `any(S)`, `any(gpus: S)`.
    Any {
        /// The dimensions along which to pick (empty: all of them).
        dims: Vec<DimName>,
        /// The members to pick from.
        of: Box<Selection>,
    },
    /// Members of any operand (at least two): `a | b`.
    Union(Vec<Selection>),
    /// Members of every operand (at least two): `a & b`.
    Intersection(Vec<Selection>),
}

/// One constraint of a [`Selection::Dims`] list: `dim=spec`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Constraint {
    /// The dimension constrained.
    pub dim: DimName,
    /// The coordinates allowed along it.
    pub spec: DimSpec,
}

/// The coordinates a [`Constraint`] allows along its dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DimSpec {
    /// Any coordinate: `*`.
    All,
    /// One coordinate, which must be inside the dimension: `3`.
    Index(usize),
    /// A range, whose bounds must be inside the dimension: `0..4`, `2..`,
    /// `0..8:2`.
    Range(DimRange),
}

impl Selection {
    /// The union of `operands`: [`Selection::None`] for none, the operand
    /// itself for one.
    pub fn union(operands: impl IntoIterator<Item = Selection>) -> Selection {
        let mut operands: Vec<Selection> = operands.into_iter().collect();
        match operands.len() {
            0 => Selection::None,
            1 => operands.remove(0),
            _ => Selection::Union(operands),
        }
    }

    /// The intersection of `operands`: [`Selection::All`] for none, the
    /// operand itself for one.
    pub fn intersection(operands: impl IntoIterator<Item = Selection>) -> Selection {
        let mut operands: Vec<Selection> = operands.into_iter().collect();
        match operands.len() {
            0 => Selection::All,
            1 => operands.remove(0),
            _ => Selection::Intersection(operands),
        }
    }

    /// The constraint list `dim=spec,...`.
    pub fn dims<N: AsRef<str>>(
        constraints: impl IntoIterator<Item = (N, DimSpec)>,
    ) -> Result<Selection, ShapeError> {
        let constraints = constraints
            .into_iter()
            .map(|(dim, spec)| {
                Ok(Constraint {
                    dim: DimName::new(dim.as_ref())?,
                    spec,
                })
            })
            .collect::<Result<_, ShapeError>>()?;
        Ok(Selection::Dims(constraints))
    }

    /// The AST depth: 1 for a leaf, plus 1 per operator above it.
    ///
    /// Computed without recursion, so any selection can be measured.
    pub fn depth(&self) -> usize {
        let mut deepest = 0;
        let mut stack = vec![(self, 1)];
        while let Some((node, depth)) = stack.pop() {
            deepest = deepest.max(depth);
            node.for_each_operand(|child| stack.push((child, depth + 1)));
        }
        deepest
    }

    /// Whether the members it picks depend on the evaluation seed (it has
    /// an `any`). Without recursion, like [`Selection::depth`].
    pub fn uses_seed(&self) -> bool {
        let mut stack = vec![self];
        while let Some(node) = stack.pop() {
            if matches!(node, Selection::Any { .. }) {
                return true;
            }
            node.for_each_operand(|child| stack.push(child));
        }
        false
    }

    /// Calls `f` on each direct operand.
    fn for_each_operand<'a>(&'a self, mut f: impl FnMut(&'a Selection)) {
        match self {
            Selection::All | Selection::None | Selection::Dims(_) => {}
            Selection::First { of, .. } | Selection::Any { of, .. } => f(of),
            Selection::Union(operands) | Selection::Intersection(operands) => {
                operands.iter().for_each(f)
            }
        }
    }

    /// Checks the structural rules the parser enforces: depth at most
    /// [`MAX_DEPTH`], at least two operands per union and intersection, a
    /// non-empty constraint list, no dimension twice in one constraint list
    /// or scope, at most [`MAX_DIMS`] dimensions in either. Evaluation and
    /// serialization call it first.
    ///
    /// Walks the AST without recursion, so even a selection built far
    /// deeper than the limit is refused rather than overflowing the stack.
    pub fn validate(&self) -> Result<(), SelectionError> {
        let mut stack = vec![(self, 1)];
        while let Some((node, depth)) = stack.pop() {
            if depth > MAX_DEPTH {
                return Err(SelectionError::TooDeep {
                    depth,
                    max: MAX_DEPTH,
                });
            }
            let malformed = |reason| Err(SelectionError::Malformed { reason });
            match node {
                Selection::All | Selection::None => {}
                Selection::Dims(constraints) => {
                    if constraints.is_empty() {
                        return malformed("empty constraint list");
                    }
                    if constraints.len() > MAX_DIMS {
                        return malformed("more constraints than MAX_DIMS");
                    }
                    if has_duplicate(constraints.iter().map(|c| &c.dim)) {
                        return malformed("a dimension constrained twice in one list");
                    }
                }
                Selection::First { dims, .. } | Selection::Any { dims, .. } => {
                    if dims.len() > MAX_DIMS {
                        return malformed("more scope dimensions than MAX_DIMS");
                    }
                    if has_duplicate(dims.iter()) {
                        return malformed("a dimension twice in one first/any scope");
                    }
                }
                Selection::Union(operands) | Selection::Intersection(operands) => {
                    if operands.len() < 2 {
                        return malformed("a union or intersection of fewer than two operands");
                    }
                }
            }
            node.for_each_operand(|child| stack.push((child, depth + 1)));
        }
        Ok(())
    }

    /// Writes `self` as an operand of an operator of precedence `context`,
    /// adding parentheses where the operand binds looser or equally (so
    /// that nested unions and intersections keep their structure).
    fn fmt_in(&self, f: &mut fmt::Formatter<'_>, context: Precedence) -> fmt::Result {
        let own = match self {
            Selection::Union(operands) if operands.len() >= 2 => Precedence::Union,
            Selection::Intersection(operands) if operands.len() >= 2 => Precedence::Intersection,
            _ => Precedence::Atom,
        };
        if own <= context {
            write!(f, "({self})")
        } else {
            write!(f, "{self}")
        }
    }
}

/// How tightly a printed form binds (higher binds tighter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Precedence {
    /// Top level: never parenthesize.
    Top,
    /// An operand of `|`.
    Union,
    /// An operand of `&`.
    Intersection,
    /// Atoms: constraint lists, `*`, `none`, `first(...)`, `any(...)`.
    Atom,
}

fn has_duplicate<'a>(names: impl Iterator<Item = &'a DimName>) -> bool {
    let names: Vec<&DimName> = names.collect();
    names
        .iter()
        .enumerate()
        .any(|(i, name)| names[..i].contains(name))
}

impl fmt::Display for Selection {
    /// The canonical text: constraint lists without spaces (`hosts=0..2,gpus=*`),
    /// ` | ` and ` & ` with spaces, parentheses only where needed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selection::All => f.write_str("*"),
            Selection::None => f.write_str("none"),
            Selection::Dims(constraints) if constraints.is_empty() => f.write_str("*"),
            Selection::Dims(constraints) => {
                for (i, constraint) in constraints.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{constraint}")?;
                }
                Ok(())
            }
            Selection::First { dims, of } => fmt_pick(f, "first", dims, of),
            Selection::Any { dims, of } => fmt_pick(f, "any", dims, of),
            Selection::Union(operands) => {
                fmt_operator(f, operands, " | ", "none", Precedence::Union)
            }
            Selection::Intersection(operands) => {
                fmt_operator(f, operands, " & ", "*", Precedence::Intersection)
            }
        }
    }
}

fn fmt_pick(
    f: &mut fmt::Formatter<'_>,
    word: &str,
    dims: &[DimName],
    of: &Selection,
) -> fmt::Result {
    if dims.is_empty() && *of == Selection::All {
        return f.write_str(word);
    }
    write!(f, "{word}(")?;
    if !dims.is_empty() {
        for (i, dim) in dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{dim}")?;
        }
        f.write_str(": ")?;
    }
    of.fmt_in(f, Precedence::Top)?;
    f.write_str(")")
}

fn fmt_operator(
    f: &mut fmt::Formatter<'_>,
    operands: &[Selection],
    separator: &str,
    empty: &str,
    precedence: Precedence,
) -> fmt::Result {
    match operands {
        [] => f.write_str(empty),
        [only] => only.fmt_in(f, Precedence::Top),
        _ => {
            for (i, operand) in operands.iter().enumerate() {
                if i > 0 {
                    f.write_str(separator)?;
                }
                operand.fmt_in(f, precedence)?;
            }
            Ok(())
        }
    }
}

impl fmt::Display for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.dim, self.spec)
    }
}

impl fmt::Display for DimSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DimSpec::All => f.write_str("*"),
            DimSpec::Index(index) => write!(f, "{index}"),
            DimSpec::Range(range) => write!(f, "{range}"),
        }
    }
}

impl FromStr for Selection {
    type Err = ParseError;

    /// Parses the text syntax (see `docs/semantics.md` §3). Never panics; input
    /// longer than [`MAX_TEXT_BYTES`] or deeper than [`MAX_DEPTH`] is an
    /// error.
    fn from_str(input: &str) -> Result<Self, ParseError> {
        parse::parse(input)
    }
}

impl TryFrom<&str> for Selection {
    type Error = ParseError;
    fn try_from(input: &str) -> Result<Self, ParseError> {
        parse::parse(input)
    }
}

impl Serialize for Selection {
    /// Serializes the canonical text; fails for a selection that does not
    /// [`validate`](Selection::validate) or prints longer than
    /// [`MAX_TEXT_BYTES`], since the receiver would refuse it.
    ///
    /// Every cast carries its selection: the texts of the selections
    /// printed last on this thread are kept, and the same selection again
    /// is not checked and printed again.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        thread_local! {
            static PRINTED: Memo<(Selection, std::sync::Arc<str>)> = const { Memo::new() };
        }
        // Only the text is taken from a hit: cloning the kept selection
        // would allocate on every encode.
        let kept =
            PRINTED.with(|m| m.find_map(|(kept, text)| (kept == self).then(|| text.clone())));
        if let Some(text) = kept {
            return serializer.serialize_str(&text);
        }
        self.validate().map_err(S::Error::custom)?;
        let text = self.to_string();
        if text.len() > MAX_TEXT_BYTES {
            return Err(S::Error::custom(SelectionError::TooLong {
                bytes: text.len(),
                max: MAX_TEXT_BYTES,
            }));
        }
        PRINTED.with(|m| m.keep((self.clone(), text.as_str().into())));
        serializer.serialize_str(&text)
    }
}

impl<'de> Deserialize<'de> for Selection {
    /// Every cast carries its selection's text: the selections parsed last
    /// on this thread are kept with their text, and the same text again is
    /// not parsed again.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        thread_local! {
            static DECODED: Memo<(std::sync::Arc<str>, Selection)> = const { Memo::new() };
        }
        let (_, selection) = memo::decode_str(
            deserializer,
            &DECODED,
            |(kept, _): &(std::sync::Arc<str>, Selection)| kept,
            |text| parse::parse(text).map(|s| (text.into(), s)),
        )?;
        Ok(selection)
    }
}

#[cfg(test)]
mod tests;
