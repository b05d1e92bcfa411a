//! The selection parser: a hand-written recursive descent over bytes, with
//! the length and nesting limits checked before they can cost anything.
//!
//! Grammar (whitespace is allowed between tokens):
//!
//! ```text
//! selection    := union
//! union        := intersection ( '|' intersection )*
//! intersection := term ( '&' term )*
//! term         := '*' | 'none' | constraints | pick | '(' selection ')'
//! pick         := ( 'first' | 'any' ) [ '(' [ names ':' ] selection ')' ]
//! names        := name ( ',' name )*
//! constraints  := constraint ( ',' constraint )*
//! constraint   := name '=' spec
//! spec         := '*' | number | [ number ] '..' [ number ] [ ':' number ]
//! name         := [A-Za-z_][A-Za-z0-9_]*      (not all, any, first, none)
//! number       := [0-9]+                      (fits a usize)
//! ```

use std::fmt;

use super::{Constraint, DimSpec, MAX_DEPTH, MAX_TEXT_BYTES, Selection};
use crate::shape::{DimName, DimRange, MAX_DIMS, ShapeError};

/// What the parser found where it expected something else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// The end of the input.
    End,
    /// This character.
    Char(char),
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::End => f.write_str("end of input"),
            Found::Char(c) => write!(f, "{c:?}"),
        }
    }
}

/// What is wrong at the position of a [`ParseError`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseErrorKind {
    /// The input is longer than [`MAX_TEXT_BYTES`]; the position is the
    /// limit.
    #[error("input longer than {max_bytes} bytes")]
    TooLong {
        /// The limit.
        max_bytes: usize,
    },
    /// Parentheses or operators nest deeper than [`MAX_DEPTH`]; the position
    /// is where the limit was crossed.
    #[error("nested deeper than {max_depth}")]
    TooDeep {
        /// The limit.
        max_depth: usize,
    },
    /// Something else was expected here.
    #[error("expected {expected}, found {found}")]
    Unexpected {
        /// What would have been accepted, in words.
        expected: &'static str,
        /// What is there.
        found: Found,
    },
    /// A number does not fit a `usize`.
    #[error("number too large")]
    NumberTooLarge,
    /// A dimension name is too long or is a reserved word.
    #[error("invalid dimension name: {reason}")]
    InvalidName {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A dimension appears twice in one constraint list or scope.
    #[error("dimension {dim} appears twice")]
    DuplicateDim {
        /// The repeated dimension.
        dim: DimName,
    },
    /// A constraint list or scope names more than [`MAX_DIMS`] dimensions.
    #[error("more than {max} dimensions")]
    TooManyDims {
        /// The limit.
        max: usize,
    },
    /// A range starts after it ends (`3..1`).
    #[error("range start {start} is after its end {end}")]
    ReversedRange {
        /// The start.
        start: usize,
        /// The end.
        end: usize,
    },
    /// A range step is zero (`0..4:0`).
    #[error("a range step must be at least 1")]
    ZeroStep,
}

/// A selection that did not parse: where, and why. Its `Display` shows the
/// input with a caret under the position:
///
/// ```text
/// invalid selection at byte 11: expected a number after ':' (the step), found 'x'
///   hosts=0..4:x
///              ^
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    input: String,
    position: usize,
    kind: ParseErrorKind,
}

impl ParseError {
    fn new(input: &str, position: usize, kind: ParseErrorKind) -> ParseError {
        let kept = floor_char_boundary(input, MAX_TEXT_BYTES);
        ParseError {
            input: input[..kept].to_owned(),
            position,
            kind,
        }
    }

    /// The byte offset in the input where the problem is.
    pub fn position(&self) -> usize {
        self.position
    }

    /// What the problem is.
    pub fn kind(&self) -> &ParseErrorKind {
        &self.kind
    }

    /// The input (its first [`MAX_TEXT_BYTES`] bytes).
    pub fn input(&self) -> &str {
        &self.input
    }
}

/// The largest character boundary of `s` at or below `index`.
fn floor_char_boundary(s: &str, index: usize) -> usize {
    if index >= s.len() {
        return s.len();
    }
    let mut index = index;
    while !s.is_char_boundary(index) {
        index -= 1;
    }
    index
}

/// The most characters of input shown on either side of the caret.
const WINDOW_CHARS: usize = 40;

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "invalid selection at byte {}: {}",
            self.position, self.kind
        )?;
        // Show a window of characters around the position, control
        // characters as spaces so the caret lines up.
        let at = floor_char_boundary(&self.input, self.position);
        let column = self.input[..at].chars().count();
        let first = column.saturating_sub(WINDOW_CHARS);
        let mut line = String::from("  ");
        if first > 0 {
            line.push_str("...");
        }
        let mut caret = line.chars().count() + column - first;
        let shown = self.input.chars().skip(first).take(2 * WINDOW_CHARS);
        for c in shown {
            line.push(if c.is_control() { ' ' } else { c });
        }
        if self.input.chars().count() > first + 2 * WINDOW_CHARS {
            line.push_str("...");
        }
        if self.position > self.input.len() {
            // TooLong: the position is just past the kept input.
            caret = line.chars().count();
        }
        writeln!(f, "{line}")?;
        write!(f, "{:caret$}^", "")
    }
}

impl std::error::Error for ParseError {}

const EXPECTED_SELECTION: &str =
    "a selection: '*', 'none', 'first', 'any', '(' or a constraint like 'hosts=0..2'";
const EXPECTED_SPEC: &str = "'*', an index or a range like '0..4' after '='";

/// Parses `input` as a selection.
pub(super) fn parse(input: &str) -> Result<Selection, ParseError> {
    if input.len() > MAX_TEXT_BYTES {
        return Err(ParseError::new(
            input,
            MAX_TEXT_BYTES,
            ParseErrorKind::TooLong {
                max_bytes: MAX_TEXT_BYTES,
            },
        ));
    }
    let mut parser = Parser {
        input,
        bytes: input.as_bytes(),
        position: 0,
        nesting: 0,
    };
    let (selection, _) = parser.union()?;
    if parser.peek().is_some() {
        return Err(parser.unexpected("'|', '&' or end of input"));
    }
    Ok(selection)
}

/// A parsed selection and its AST depth.
type Parsed = (Selection, usize);

struct Parser<'a> {
    input: &'a str,
    bytes: &'a [u8],
    position: usize,
    /// Open parentheses (of groups, `first(` and `any(`).
    nesting: usize,
}

impl<'a> Parser<'a> {
    fn error(&self, position: usize, kind: ParseErrorKind) -> ParseError {
        ParseError::new(self.input, position, kind)
    }

    /// An error at the current position (after whitespace).
    fn unexpected(&mut self, expected: &'static str) -> ParseError {
        self.skip_whitespace();
        let found = self.input[self.position..]
            .chars()
            .next()
            .map_or(Found::End, Found::Char);
        self.error(
            self.position,
            ParseErrorKind::Unexpected { expected, found },
        )
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.position) {
            self.position += 1;
        }
    }

    /// The next byte after whitespace, not consumed.
    fn peek(&mut self) -> Option<u8> {
        self.skip_whitespace();
        self.bytes.get(self.position).copied()
    }

    /// Consumes `token` if it comes next (after whitespace).
    fn eat(&mut self, token: &str) -> bool {
        self.skip_whitespace();
        let found = self.input[self.position..].starts_with(token);
        if found {
            self.position += token.len();
        }
        found
    }

    fn expect(&mut self, token: &str, expected: &'static str) -> Result<(), ParseError> {
        if self.eat(token) {
            Ok(())
        } else {
            Err(self.unexpected(expected))
        }
    }

    /// Checks that a node built from `start` is within the depth limit.
    fn check_depth(&self, start: usize, depth: usize) -> Result<(), ParseError> {
        if depth > MAX_DEPTH {
            return Err(self.error(
                start,
                ParseErrorKind::TooDeep {
                    max_depth: MAX_DEPTH,
                },
            ));
        }
        Ok(())
    }

    /// Consumes an opening parenthesis at the current position, counting
    /// the nesting.
    fn open(&mut self) -> Result<(), ParseError> {
        self.skip_whitespace();
        let at = self.position;
        self.expect("(", "'('")?;
        self.nesting += 1;
        if self.nesting > MAX_DEPTH {
            return Err(self.error(
                at,
                ParseErrorKind::TooDeep {
                    max_depth: MAX_DEPTH,
                },
            ));
        }
        Ok(())
    }

    fn close(&mut self) -> Result<(), ParseError> {
        self.expect(")", "'|', '&' or ')'")?;
        self.nesting -= 1;
        Ok(())
    }

    fn union(&mut self) -> Result<Parsed, ParseError> {
        self.skip_whitespace();
        let start = self.position;
        let first = self.intersection()?;
        if self.peek() != Some(b'|') {
            return Ok(first);
        }
        let mut depth = first.1;
        let mut operands = vec![first.0];
        while self.eat("|") {
            let (operand, operand_depth) = self.intersection()?;
            depth = depth.max(operand_depth);
            operands.push(operand);
        }
        self.check_depth(start, depth + 1)?;
        Ok((Selection::Union(operands), depth + 1))
    }

    fn intersection(&mut self) -> Result<Parsed, ParseError> {
        self.skip_whitespace();
        let start = self.position;
        let first = self.term()?;
        if self.peek() != Some(b'&') {
            return Ok(first);
        }
        let mut depth = first.1;
        let mut operands = vec![first.0];
        while self.eat("&") {
            let (operand, operand_depth) = self.term()?;
            depth = depth.max(operand_depth);
            operands.push(operand);
        }
        self.check_depth(start, depth + 1)?;
        Ok((Selection::Intersection(operands), depth + 1))
    }

    fn term(&mut self) -> Result<Parsed, ParseError> {
        match self.peek() {
            Some(b'*') => {
                self.position += 1;
                Ok((Selection::All, 1))
            }
            Some(b'(') => {
                self.open()?;
                let inner = self.union()?;
                self.close()?;
                Ok(inner)
            }
            Some(b) if is_name_start(b) => {
                let start = self.position;
                let word = self.word();
                match word {
                    "none" | "first" | "any" | "all" if self.peek() == Some(b'=') => Err(self
                        .error(
                            start,
                            ParseErrorKind::InvalidName {
                                reason: "reserved by the selection syntax",
                            },
                        )),
                    "none" => Ok((Selection::None, 1)),
                    "first" | "any" => self.pick(start, word == "first"),
                    _ => {
                        self.position = start;
                        Ok((self.constraints()?, 1))
                    }
                }
            }
            _ => Err(self.unexpected(EXPECTED_SELECTION)),
        }
    }

    /// Consumes a maximal `[A-Za-z0-9_]*` run at the current position.
    fn word(&mut self) -> &'a str {
        let start = self.position;
        while self
            .bytes
            .get(self.position)
            .is_some_and(|&b| b.is_ascii_alphanumeric() || b == b'_')
        {
            self.position += 1;
        }
        &self.input[start..self.position]
    }

    /// Consumes a dimension name (after whitespace), checked.
    fn name(&mut self, expected: &'static str) -> Result<(DimName, usize), ParseError> {
        if !self.peek().is_some_and(is_name_start) {
            return Err(self.unexpected(expected));
        }
        let start = self.position;
        let word = self.word();
        match DimName::new(word) {
            Ok(name) => Ok((name, start)),
            Err(ShapeError::InvalidName { reason, .. }) => {
                Err(self.error(start, ParseErrorKind::InvalidName { reason }))
            }
            // `DimName::new` only refuses names with `InvalidName`.
            Err(_) => Err(self.error(
                start,
                ParseErrorKind::InvalidName {
                    reason: "not a name",
                },
            )),
        }
    }

    /// `first` or `any`, after the word at `start`.
    fn pick(&mut self, start: usize, first: bool) -> Result<Parsed, ParseError> {
        let (dims, of, depth) = if self.peek() == Some(b'(') {
            self.open()?;
            let dims = if self.scope_follows() {
                self.scope()?
            } else {
                Vec::new()
            };
            let (of, depth) = self.union()?;
            self.close()?;
            (dims, of, depth)
        } else {
            (Vec::new(), Selection::All, 1)
        };
        self.check_depth(start, depth + 1)?;
        let of = Box::new(of);
        let selection = if first {
            Selection::First { dims, of }
        } else {
            Selection::Any { dims, of }
        };
        Ok((selection, depth + 1))
    }

    /// Whether a scope (`names ':'`) comes next: a word followed by ',' or
    /// ':' (a constraint's word is followed by '=').
    fn scope_follows(&mut self) -> bool {
        let saved = self.position;
        let follows = self.peek().is_some_and(is_name_start) && {
            self.word();
            matches!(self.peek(), Some(b',' | b':'))
        };
        self.position = saved;
        follows
    }

    /// `name (',' name)* ':'`.
    fn scope(&mut self) -> Result<Vec<DimName>, ParseError> {
        let mut dims: Vec<DimName> = Vec::new();
        loop {
            let (dim, at) = self.name("a dimension name")?;
            check_new_dim(self, &dims, &dim, at)?;
            dims.push(dim);
            if self.eat(":") {
                return Ok(dims);
            }
            self.expect(",", "',' or ':' after a dimension name")?;
        }
    }

    /// `constraint (',' constraint)*`.
    fn constraints(&mut self) -> Result<Selection, ParseError> {
        let mut constraints: Vec<Constraint> = Vec::new();
        let mut dims: Vec<DimName> = Vec::new();
        loop {
            let (dim, at) = self.name("a constraint like 'gpus=0'")?;
            check_new_dim(self, &dims, &dim, at)?;
            dims.push(dim.clone());
            self.expect("=", "'=' after a dimension name")?;
            let spec = self.spec()?;
            constraints.push(Constraint { dim, spec });
            if !self.eat(",") {
                return Ok(Selection::Dims(constraints));
            }
        }
    }

    fn spec(&mut self) -> Result<DimSpec, ParseError> {
        match self.peek() {
            Some(b'*') => {
                self.position += 1;
                Ok(DimSpec::All)
            }
            Some(b'0'..=b'9') => {
                let start_at = self.position;
                let start = self.number()?;
                if self.peek() == Some(b'.') {
                    self.range(start, start_at)
                } else {
                    Ok(DimSpec::Index(start))
                }
            }
            Some(b'.') => {
                let at = self.position;
                self.range(0, at)
            }
            _ => Err(self.unexpected(EXPECTED_SPEC)),
        }
    }

    /// The rest of a range from `..`, whose start (at `start_at`) is read.
    fn range(&mut self, start: usize, start_at: usize) -> Result<DimSpec, ParseError> {
        self.expect("..", "'..'")?;
        let end = match self.peek() {
            Some(b'0'..=b'9') => Some(self.number()?),
            _ => None,
        };
        let step = if self.eat(":") {
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.unexpected("a number after ':' (the step)"));
            }
            let at = self.position;
            let step = self.number()?;
            if step == 0 {
                return Err(self.error(at, ParseErrorKind::ZeroStep));
            }
            step
        } else {
            1
        };
        match DimRange::new(start, end, step) {
            Ok(range) => Ok(DimSpec::Range(range)),
            Err(ShapeError::ReversedRange { start, end }) => {
                Err(self.error(start_at, ParseErrorKind::ReversedRange { start, end }))
            }
            // The step is positive (checked above), so only a reversed
            // range is refused.
            Err(_) => Err(self.error(start_at, ParseErrorKind::ZeroStep)),
        }
    }

    /// A decimal number at the current position (a digit is next).
    fn number(&mut self) -> Result<usize, ParseError> {
        let start = self.position;
        let mut value: usize = 0;
        while let Some(&b @ b'0'..=b'9') = self.bytes.get(self.position) {
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(usize::from(b - b'0')))
                .ok_or_else(|| self.error(start, ParseErrorKind::NumberTooLarge))?;
            self.position += 1;
        }
        Ok(value)
    }
}

/// Refuses `dim` (at `at`) if it is already in `seen` or `seen` is full.
fn check_new_dim(
    parser: &Parser<'_>,
    seen: &[DimName],
    dim: &DimName,
    at: usize,
) -> Result<(), ParseError> {
    if seen.contains(dim) {
        return Err(parser.error(at, ParseErrorKind::DuplicateDim { dim: dim.clone() }));
    }
    if seen.len() == MAX_DIMS {
        return Err(parser.error(at, ParseErrorKind::TooManyDims { max: MAX_DIMS }));
    }
    Ok(())
}

fn is_name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}
