use proptest::prelude::*;
use proptest::sample::subsequence;

use super::*;
use crate::shape::tests::arb_shape;
use crate::shape::{Rank, Shape};

fn sel(text: &str) -> Selection {
    text.parse()
        .unwrap_or_else(|e| panic!("{text:?} did not parse:\n{e}"))
}

fn hosts_gpus() -> Shape {
    Shape::new([("hosts", 4), ("gpus", 8)]).unwrap()
}

/// The ranks `text` selects in `shape` with seed 0, as numbers.
fn eval(text: &str, shape: &Shape) -> Vec<u32> {
    sel(text)
        .eval(shape, 0)
        .unwrap_or_else(|e| panic!("{text:?}: {e}"))
        .into_iter()
        .map(|r| r.0)
        .collect()
}

fn parse_error(text: &str) -> ParseError {
    match text.parse::<Selection>() {
        Ok(s) => panic!("{text:?} parsed as {s:?}"),
        Err(e) => e,
    }
}

// --- operators -------------------------------------------------------------

#[test]
fn all_and_none() {
    let s = hosts_gpus();
    assert_eq!(eval("*", &s), (0..32).collect::<Vec<_>>());
    assert_eq!(eval("none", &s), Vec::<u32>::new());
    assert_eq!(eval("* | none", &s).len(), 32);
    assert_eq!(eval("* & none", &s), Vec::<u32>::new());
}

#[test]
fn constraints_on_named_dims() {
    let s = hosts_gpus();
    assert_eq!(eval("hosts=0..2,gpus=*", &s), (0..16).collect::<Vec<_>>());
    assert_eq!(eval("hosts=0..2", &s), (0..16).collect::<Vec<_>>());
    assert_eq!(eval("hosts=1,gpus=3", &s), [11]);
    assert_eq!(eval("gpus=3", &s), [3, 11, 19, 27]);
    assert_eq!(eval("gpus=0..8:3,hosts=3", &s), [24, 27, 30]);
    assert_eq!(eval("gpus=..2,hosts=2..", &s), [16, 17, 24, 25]);
    assert_eq!(eval("gpus=6..,hosts=..1", &s), [6, 7]);
    assert_eq!(
        eval("hosts=..,gpus=..:4", &s),
        [0, 4, 8, 12, 16, 20, 24, 28]
    );
    assert_eq!(eval("hosts=2..2", &s), Vec::<u32>::new());
    assert_eq!(eval("hosts=4..", &s), Vec::<u32>::new());
}

#[test]
fn union_and_intersection() {
    let s = hosts_gpus();
    assert_eq!(eval("hosts=0,gpus=0 | hosts=3,gpus=7", &s), [0, 31]);
    assert_eq!(eval("gpus=1 | gpus=1", &s), [1, 9, 17, 25]);
    assert_eq!(eval("hosts=1..3 & gpus=0..8:4", &s), [8, 12, 16, 20]);
    assert_eq!(
        eval("hosts=1..3 & hosts=2..", &s),
        (16..24).collect::<Vec<_>>()
    );
    // `&` binds tighter than `|`, `,` tighter than both.
    assert_eq!(eval("hosts=0,gpus=0 | hosts=1 & gpus=1", &s), [0, 9]);
    assert_eq!(eval("(hosts=0,gpus=0 | hosts=1) & gpus=1", &s), [9]);
    // Steps that do not line up.
    assert_eq!(
        eval("gpus=0..:2 & gpus=0..:3", &s.at("hosts", 0).unwrap()),
        [0, 6]
    );
}

#[test]
fn first_overall_and_per_group() {
    let s = hosts_gpus();
    assert_eq!(eval("first", &s), [0]);
    assert_eq!(eval("first(*)", &s), [0]);
    assert_eq!(eval("first(hosts=2..)", &s), [16]);
    assert_eq!(eval("first(gpus=5 | hosts=3)", &s), [5]);
    assert_eq!(eval("first(none)", &s), Vec::<u32>::new());
    // The first GPU of each host.
    assert_eq!(eval("first(gpus: *)", &s), [0, 8, 16, 24]);
    assert_eq!(eval("first(gpus: gpus=3.. & hosts=1..3)", &s), [11, 19]);
    // The first host for each GPU index.
    assert_eq!(
        eval("first(hosts: hosts=1..)", &s),
        (8..16).collect::<Vec<_>>()
    );
    // Scope of every dimension: one group.
    assert_eq!(eval("first(hosts,gpus: gpus=7)", &s), [7]);
    // `first` of a selection, then intersected: nothing if it lies outside.
    assert_eq!(eval("first & hosts=1", &s), Vec::<u32>::new());
    // Row-major order, not rank order, on a transposed layout.
    let slice = crate::shape::Slice::new(0, vec![2, 3], vec![1, 2]).unwrap();
    let t = Shape::from_parts(
        vec![DimName::new("a").unwrap(), DimName::new("b").unwrap()],
        slice,
    )
    .unwrap();
    assert_eq!(eval("first(a=1)", &t), [1]);
    assert_eq!(eval("first(b=1.. & a=1 | a=0,b=2)", &t), [4]);
}

#[test]
fn any_picks_one_per_group_by_seed() {
    let s = hosts_gpus();
    let any = sel("any");
    let picks: Vec<Vec<Rank>> = (0..64).map(|seed| any.eval(&s, seed).unwrap()).collect();
    assert!(picks.iter().all(|p| p.len() == 1));
    // Deterministic, and the seed matters.
    assert_eq!(any.eval(&s, 5).unwrap(), picks[5]);
    let distinct: std::collections::BTreeSet<_> = picks.iter().map(|p| p[0]).collect();
    assert!(distinct.len() > 16, "64 seeds picked only {distinct:?}");

    let per_host = sel("any(gpus: *)").eval(&s, 9).unwrap();
    assert_eq!(per_host.len(), 4);
    for (host, rank) in per_host.iter().enumerate() {
        assert_eq!(rank.index() / 8, host);
    }
    assert_eq!(sel("any(hosts=2)").eval(&s, 3).unwrap().len(), 1);
    assert!(sel("any(hosts=2)").eval(&s, 3).unwrap()[0].index() / 8 == 2);
    assert!(sel("any(none)").eval(&s, 3).unwrap().is_empty());
    assert_eq!(sel("any(gpus=4)").eval(&s, 11).unwrap().len(), 1);
    // The documented hash: splitmix64 of seed + (index + 1) * γ; seed 0,
    // index 0 is splitmix64's first output from state 0.
    assert_eq!(eval::any_key(0, 0), 0xE220_A839_7B1D_CDAF);
}

#[test]
fn dimension_errors_are_typed() {
    let s = hosts_gpus();
    let err = |text: &str| sel(text).eval(&s, 0).unwrap_err();
    assert!(matches!(
        err("racks=0"),
        SelectionError::Shape(ShapeError::UnknownDim { .. })
    ));
    assert!(matches!(
        err("first(racks: *)"),
        SelectionError::Shape(ShapeError::UnknownDim { .. })
    ));
    assert!(matches!(
        err("any(hosts=0 | racks=1)"),
        SelectionError::Shape(ShapeError::UnknownDim { .. })
    ));
    assert_eq!(
        err("hosts=4"),
        SelectionError::Shape(ShapeError::IndexOutOfRange {
            dim: "hosts".into(),
            index: 4,
            size: 4
        })
    );
    assert!(matches!(
        err("hosts=0..5"),
        SelectionError::Shape(ShapeError::RangeOutOfRange { .. })
    ));
    assert!(matches!(
        err("hosts=5.."),
        SelectionError::Shape(ShapeError::RangeOutOfRange { .. })
    ));
    assert_eq!(
        err("gpus=9").to_string(),
        "index 9 is outside dimension gpus of size 8"
    );
    assert_eq!(
        err("racks=1").to_string(),
        "no dimension \"racks\" in shape {hosts=4, gpus=8}"
    );
}

#[test]
fn malformed_asts_are_refused_not_panicked_on() {
    let s = hosts_gpus();
    let malformed = |selection: Selection| {
        assert!(
            matches!(selection.eval(&s, 0), Err(SelectionError::Malformed { .. })),
            "{selection:?}"
        );
    };
    malformed(Selection::Union(vec![Selection::All]));
    malformed(Selection::Intersection(vec![]));
    malformed(Selection::Dims(vec![]));
    malformed(Selection::dims([("hosts", DimSpec::All), ("hosts", DimSpec::Index(1))]).unwrap());
    let hosts = DimName::new("hosts").unwrap();
    malformed(Selection::First {
        dims: vec![hosts.clone(), hosts],
        of: Box::new(Selection::All),
    });
    // Far deeper than the limit: refused without recursing.
    let mut deep = Selection::All;
    for _ in 0..100_000 {
        deep = Selection::First {
            dims: vec![],
            of: Box::new(deep),
        };
    }
    assert_eq!(deep.depth(), 100_001);
    assert!(matches!(
        deep.eval(&s, 0),
        Err(SelectionError::TooDeep { .. })
    ));
    assert!(serde_json::to_string(&deep).is_err());
    // Dropping it would recurse; unwind it by hand.
    while let Selection::First { of, .. } = deep {
        deep = *of;
    }
    // The helpers never build malformed unions or intersections.
    assert_eq!(Selection::union([]), Selection::None);
    assert_eq!(Selection::intersection([]), Selection::All);
    assert_eq!(Selection::union([sel("hosts=1")]), sel("hosts=1"));
    assert_eq!(
        Selection::union([sel("hosts=1"), sel("none")]),
        sel("hosts=1 | none")
    );
    assert_eq!(
        Selection::intersection([sel("hosts=1"), sel("*")]),
        sel("hosts=1 & *")
    );
}

#[test]
fn eval_in_restricts_to_a_region() {
    let s = hosts_gpus();
    let region = s.slice("hosts", 2..4).unwrap();
    let ranks = |text: &str| -> Vec<u32> {
        sel(text)
            .eval_in(&s, &region, 0)
            .unwrap()
            .into_iter()
            .map(|r| r.0)
            .collect()
    };
    assert_eq!(ranks("gpus=0"), [16, 24]);
    assert_eq!(ranks("hosts=0..3,gpus=7"), [23]);
    // Coordinates are those of the whole shape: `first` is rank 0, outside.
    assert_eq!(ranks("first"), Vec::<u32>::new());
    assert_eq!(ranks("first(gpus: gpus=2..)"), [18, 26]);
    assert_eq!(ranks("hosts=1"), Vec::<u32>::new());
    let selected = sel("gpus=1 | gpus=2").bind(&s, 0).unwrap();
    assert_eq!(selected.len(), 8);
    assert!(selected.contains(Rank(9)) && !selected.contains(Rank(8)));
    assert!(!selected.contains(Rank(100)));
    assert_eq!(
        selected.ranks_in(&region),
        [Rank(17), Rank(18), Rank(25), Rank(26)]
    );
    // A region that is not a view of the shape: plain intersection.
    let other = Shape::new([("x", 40)]).unwrap();
    assert_eq!(selected.ranks_in(&other), selected.ranks());
}

#[test]
fn select_turns_boxes_into_views() {
    let s = hosts_gpus();
    let view = s.select(&sel("hosts=1..3,gpus=0..8:2")).unwrap();
    assert_eq!(view.to_string(), "{hosts=2, gpus=4}");
    assert_eq!(
        view.ranks().collect::<Vec<_>>(),
        sel("hosts=1..3,gpus=0..8:2").eval(&s, 0).unwrap()
    );
    let view = s.select(&sel("gpus=3")).unwrap();
    assert_eq!(view.to_string(), "{hosts=4, gpus=1}");
    assert_eq!(s.select(&sel("*")).unwrap(), s);
    assert!(matches!(
        s.select(&sel("gpus=1 | gpus=2")),
        Err(SelectionError::NotABox { .. })
    ));
    assert!(matches!(
        s.select(&sel("first")),
        Err(SelectionError::NotABox { .. })
    ));
    assert!(matches!(
        s.select(&sel("none")),
        Err(SelectionError::Empty { .. })
    ));
    assert!(matches!(
        s.select(&sel("gpus=2..2")),
        Err(SelectionError::Empty { .. })
    ));
    assert!(matches!(
        s.select(&sel("racks=1")),
        Err(SelectionError::Shape(_))
    ));
}

#[test]
fn shapes_without_dims_have_one_member() {
    let scalar = hosts_gpus().at("hosts", 1).unwrap().at("gpus", 2).unwrap();
    assert_eq!(scalar.ndim(), 0);
    assert_eq!(eval("*", &scalar), [10]);
    assert_eq!(eval("first", &scalar), [10]);
    assert_eq!(eval("any", &scalar), [10]);
    assert_eq!(eval("none", &scalar), Vec::<u32>::new());
    assert_eq!(eval("* & first | none", &scalar), [10]);
    assert!(scalar.select(&sel("none")).is_err());
    assert!(sel("a=0").eval(&scalar, 0).is_err());
}

// --- syntax ------------------------------------------------------------------

#[test]
fn prints_canonically() {
    for (input, canonical) in [
        ("*", "*"),
        (" none ", "none"),
        ("hosts = 0 .. 2 , gpus = *", "hosts=0..2,gpus=*"),
        ("hosts=..2", "hosts=0..2"),
        ("hosts=..", "hosts=0.."),
        ("hosts=1..:1", "hosts=1.."),
        ("hosts=0..8:2", "hosts=0..8:2"),
        ("hosts=007", "hosts=7"),
        ("a=1|b=2&c=3", "a=1 | b=2 & c=3"),
        ("(a=1|b=2)&c=3", "(a=1 | b=2) & c=3"),
        ("a=1|(b=2|c=3)", "a=1 | (b=2 | c=3)"),
        ("(a=1|b=2)|c=3", "(a=1 | b=2) | c=3"),
        ("a=1&(b=2&c=3)", "a=1 & (b=2 & c=3)"),
        ("((a=1))", "a=1"),
        ("first(*)", "first"),
        ("first ( gpus , hosts : * )", "first(gpus,hosts: *)"),
        ("any(a=1|b=2)", "any(a=1 | b=2)"),
        ("any(x: first(y: none))", "any(x: first(y: none))"),
        ("first\n|\tany", "first | any"),
    ] {
        let parsed = sel(input);
        assert_eq!(parsed.to_string(), canonical, "{input:?}");
        assert_eq!(sel(canonical), parsed, "{canonical:?}");
    }
}

#[test]
fn builds_the_documented_asts() {
    assert_eq!(
        sel("hosts=0..2,gpus=*"),
        Selection::dims([
            (
                "hosts",
                DimSpec::Range(DimRange::new(0, Some(2), 1).unwrap())
            ),
            ("gpus", DimSpec::All),
        ])
        .unwrap()
    );
    assert_eq!(
        sel("first(gpus: hosts=1) | none & *"),
        Selection::Union(vec![
            Selection::First {
                dims: vec![DimName::new("gpus").unwrap()],
                of: Box::new(Selection::dims([("hosts", DimSpec::Index(1))]).unwrap()),
            },
            Selection::Intersection(vec![Selection::None, Selection::All]),
        ])
    );
    assert_eq!(
        sel("any"),
        Selection::Any {
            dims: vec![],
            of: Box::new(Selection::All)
        }
    );
}

#[test]
fn parse_errors_point_at_the_problem() {
    let expect_unexpected = |input: &str, position: usize, found: Found| {
        let e = parse_error(input);
        assert_eq!(e.position(), position, "{input:?}: {e}");
        match e.kind() {
            ParseErrorKind::Unexpected { found: f, .. } => assert_eq!(*f, found, "{input:?}"),
            other => panic!("{input:?}: {other:?}"),
        }
    };
    expect_unexpected("", 0, Found::End);
    expect_unexpected("   ", 3, Found::End);
    expect_unexpected("hosts=", 6, Found::End);
    expect_unexpected("hosts=0..2,gpus", 15, Found::End);
    expect_unexpected("hosts=0..2,", 11, Found::End);
    expect_unexpected("hosts=0..4:x", 11, Found::Char('x'));
    expect_unexpected("hosts=1.5", 7, Found::Char('.'));
    expect_unexpected("(* | none", 9, Found::End);
    expect_unexpected("* *", 2, Found::Char('*'));
    expect_unexpected("first(gpus *)", 11, Found::Char('*'));
    expect_unexpected("first(gpus, : *)", 12, Found::Char(':'));
    expect_unexpected("a=1 | é", 6, Found::Char('é'));
    expect_unexpected("a=1 |", 5, Found::End);
    expect_unexpected("hosts=-1", 6, Found::Char('-'));
    expect_unexpected("!", 0, Found::Char('!'));
    expect_unexpected(")", 0, Found::Char(')'));

    let kind_at = |input: &str| {
        let e = parse_error(input);
        (e.position(), e.kind().clone())
    };
    assert_eq!(
        kind_at("hosts=3..1"),
        (6, ParseErrorKind::ReversedRange { start: 3, end: 1 })
    );
    assert_eq!(kind_at("hosts=0..4:0"), (11, ParseErrorKind::ZeroStep));
    assert_eq!(
        kind_at("hosts=0,gpus=1,hosts=1"),
        (
            15,
            ParseErrorKind::DuplicateDim {
                dim: DimName::new("hosts").unwrap()
            }
        )
    );
    assert_eq!(
        kind_at("first(a, b, a: *)"),
        (
            12,
            ParseErrorKind::DuplicateDim {
                dim: DimName::new("a").unwrap()
            }
        )
    );
    assert_eq!(
        kind_at("x=99999999999999999999999"),
        (2, ParseErrorKind::NumberTooLarge)
    );
    assert!(matches!(
        kind_at("none=1"),
        (0, ParseErrorKind::InvalidName { .. })
    ));
    assert!(matches!(
        kind_at("a=1,all=2"),
        (4, ParseErrorKind::InvalidName { .. })
    ));
    assert!(matches!(
        kind_at("first(any: *)"),
        (6, ParseErrorKind::InvalidName { .. })
    ));
    assert!(matches!(
        kind_at(&format!("{}=1", "n".repeat(65))),
        (0, ParseErrorKind::InvalidName { .. })
    ));
    let dims: Vec<String> = (0..17).map(|i| format!("d{i}=0")).collect();
    assert_eq!(
        kind_at(&dims.join(",")).1,
        ParseErrorKind::TooManyDims { max: MAX_DIMS }
    );

    // Nesting: 32 parentheses parse, 33 do not; the error is at the 33rd.
    let nested = |n: usize| format!("{}*{}", "(".repeat(n), ")".repeat(n));
    assert_eq!(sel(&nested(MAX_DEPTH)), Selection::All);
    assert_eq!(
        kind_at(&nested(MAX_DEPTH + 1)),
        (
            MAX_DEPTH,
            ParseErrorKind::TooDeep {
                max_depth: MAX_DEPTH
            }
        )
    );
    // AST depth: 31 nested `first`s over `*` is depth 32; one more is not.
    let firsts = |n: usize| format!("{}*{}", "first(".repeat(n), ")".repeat(n));
    assert_eq!(sel(&firsts(MAX_DEPTH - 1)).depth(), MAX_DEPTH);
    assert_eq!(
        kind_at(&firsts(MAX_DEPTH)),
        (
            0,
            ParseErrorKind::TooDeep {
                max_depth: MAX_DEPTH
            }
        )
    );
    let long = "*|".repeat(MAX_TEXT_BYTES);
    assert_eq!(
        kind_at(&long),
        (
            MAX_TEXT_BYTES,
            ParseErrorKind::TooLong {
                max_bytes: MAX_TEXT_BYTES
            }
        )
    );
}

#[test]
fn parse_errors_show_a_caret() {
    assert_eq!(
        parse_error("hosts=0..4:x").to_string(),
        "invalid selection at byte 11: expected a number after ':' (the step), found 'x'\n  \
         hosts=0..4:x\n             ^"
    );
    assert_eq!(
        parse_error("a=1\n| é ?").to_string(),
        "invalid selection at byte 6: expected a selection: '*', 'none', 'first', 'any', '(' \
         or a constraint like 'hosts=0..2', found 'é'\n  a=1 | é ?\n        ^"
    );
    // A long input shows a window around the position.
    let input = format!("{}x=1 ?", "a=1 | ".repeat(30));
    let shown = parse_error(&input).to_string();
    let lines: Vec<&str> = shown.lines().collect();
    assert!(
        lines[1].starts_with("  ...") && lines[1].ends_with('?'),
        "{shown}"
    );
    assert_eq!(lines[2].len(), lines[1].len(), "{shown}");
    assert!(lines[2].ends_with('^'));
    // At the end of the input, the caret sits just past it.
    let shown = parse_error("a=1 |").to_string();
    assert!(shown.ends_with("\n  a=1 |\n       ^"), "{shown}");
}

#[test]
fn serde_carries_the_text() {
    let s = sel("hosts=0..2,gpus=* | first(gpus: hosts=3)");
    let json = serde_json::to_string(&s).unwrap();
    assert_eq!(json, r#""hosts=0..2,gpus=* | first(gpus: hosts=3)""#);
    assert_eq!(serde_json::from_str::<Selection>(&json).unwrap(), s);
    let bytes = postcard::to_allocvec(&s).unwrap();
    assert_eq!(postcard::from_bytes::<Selection>(&bytes).unwrap(), s);

    assert!(serde_json::from_str::<Selection>(r#""hosts=3..1""#).is_err());
    let deep = format!("\"{}*{}\"", "(".repeat(1000), ")".repeat(1000));
    assert!(serde_json::from_str::<Selection>(&deep).is_err());
    assert!(serde_json::to_string(&Selection::Union(vec![])).is_err());
    // A valid AST that prints too long cannot be sent.
    let wide = Selection::Union(vec![sel("hosts=1,gpus=1"); 1000]);
    assert!(wide.validate().is_ok());
    assert!(
        serde_json::to_string(&wide)
            .unwrap_err()
            .to_string()
            .contains("bytes")
    );
}

// --- properties --------------------------------------------------------------

/// A random well-formed selection over the dimensions and sizes of `shape`
/// (indices and ranges inside the dimensions), at most `depth` deep.
fn arb_selection_for(shape: &Shape, depth: u32) -> BoxedStrategy<Selection> {
    let dims: Vec<(DimName, usize)> = shape.dims().map(|(n, s)| (n.clone(), s)).collect();
    let names: Vec<DimName> = shape.names().to_vec();
    let spec = |size: usize| {
        prop_oneof![
            Just(DimSpec::All),
            (0..size).prop_map(DimSpec::Index),
            (0..=size, prop::option::of(0..=size), 1usize..4).prop_map(|(a, b, step)| {
                let (start, end) = match b {
                    Some(b) => (a.min(b), Some(a.max(b))),
                    None => (a, None),
                };
                DimSpec::Range(DimRange::new(start, end, step).unwrap())
            }),
        ]
    };
    let leaf = if dims.is_empty() {
        prop_oneof![Just(Selection::All), Just(Selection::None)].boxed()
    } else {
        let n = dims.len();
        let constraints = subsequence(dims, 1..=n)
            .prop_flat_map(move |picked| {
                picked
                    .into_iter()
                    .map(|(name, size)| spec(size).prop_map(move |s| (name.clone(), s)))
                    .collect::<Vec<_>>()
            })
            .prop_shuffle()
            .prop_map(|cs| {
                Selection::Dims(
                    cs.into_iter()
                        .map(|(dim, spec)| Constraint { dim, spec })
                        .collect(),
                )
            });
        prop_oneof![
            1 => Just(Selection::All),
            1 => Just(Selection::None),
            6 => constraints,
        ]
        .boxed()
    };
    let n = names.len();
    leaf.prop_recursive(depth, 16, 3, move |inner| {
        let scope = subsequence(names.clone(), 0..=n).prop_shuffle();
        prop_oneof![
            prop::collection::vec(inner.clone(), 2..=3).prop_map(Selection::Union),
            prop::collection::vec(inner.clone(), 2..=3).prop_map(Selection::Intersection),
            (scope.clone(), inner.clone()).prop_map(|(dims, of)| Selection::First {
                dims,
                of: Box::new(of)
            }),
            (scope, inner).prop_map(|(dims, of)| Selection::Any {
                dims,
                of: Box::new(of)
            }),
        ]
    })
    .boxed()
}

/// A random well-formed selection with any names and numbers, for syntax
/// properties.
fn arb_selection_text() -> impl Strategy<Value = Selection> {
    let name = prop_oneof![
        Just("a"),
        Just("hosts"),
        Just("gpus"),
        Just("_9"),
        Just("None"),
        Just("firsts"),
    ]
    .prop_map(|n| DimName::new(n).unwrap());
    let number = prop_oneof![0usize..10, any::<usize>()];
    let spec = prop_oneof![
        Just(DimSpec::All),
        number.clone().prop_map(DimSpec::Index),
        (
            number.clone(),
            prop::option::of(number),
            prop_oneof![1usize..4, any::<usize>()]
        )
            .prop_filter_map("step zero", |(a, b, step)| {
                let (start, end) = match b {
                    Some(b) => (a.min(b), Some(a.max(b))),
                    None => (a, None),
                };
                DimRange::new(start, end, step).ok().map(DimSpec::Range)
            }),
    ];
    let dims =
        || prop::collection::btree_map(name.clone(), spec.clone(), 1..4).prop_shuffle_entries();
    let leaf = prop_oneof![
        Just(Selection::All),
        Just(Selection::None),
        dims().prop_map(|cs| Selection::Dims(
            cs.into_iter()
                .map(|(dim, spec)| Constraint { dim, spec })
                .collect()
        )),
    ];
    let scope = prop::collection::btree_set(name.clone(), 0..3)
        .prop_map(|s| s.into_iter().collect::<Vec<_>>())
        .prop_shuffle();
    leaf.prop_recursive(6, 32, 3, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 2..=3).prop_map(Selection::Union),
            prop::collection::vec(inner.clone(), 2..=3).prop_map(Selection::Intersection),
            (scope.clone(), inner.clone()).prop_map(|(dims, of)| Selection::First {
                dims,
                of: Box::new(of)
            }),
            (scope.clone(), inner).prop_map(|(dims, of)| Selection::Any {
                dims,
                of: Box::new(of)
            }),
        ]
    })
}

trait ShuffleEntries: Strategy + Sized {
    fn prop_shuffle_entries(self) -> BoxedStrategy<Vec<(DimName, DimSpec)>>;
}

impl<S> ShuffleEntries for S
where
    S: Strategy<Value = std::collections::BTreeMap<DimName, DimSpec>> + 'static,
{
    fn prop_shuffle_entries(self) -> BoxedStrategy<Vec<(DimName, DimSpec)>> {
        self.prop_map(|m| m.into_iter().collect::<Vec<_>>())
            .prop_shuffle()
            .boxed()
    }
}

/// Brute force: the set of points (by row-major index) a selection picks,
/// straight from the definitions in `docs/semantics.md` §3, comparing every pair
/// of points where a definition speaks of "the first" or "the smallest".
fn brute(selection: &Selection, shape: &Shape, points: &[Vec<usize>], seed: u64) -> Vec<bool> {
    let position = |dim: &DimName| shape.names().iter().position(|n| n == dim).unwrap();
    match selection {
        Selection::All => vec![true; points.len()],
        Selection::None => vec![false; points.len()],
        Selection::Dims(constraints) => points
            .iter()
            .map(|p| {
                constraints.iter().all(|c| {
                    let i = position(&c.dim);
                    let x = p[i];
                    match c.spec {
                        DimSpec::All => true,
                        DimSpec::Index(k) => x == k,
                        DimSpec::Range(r) => {
                            let end = r.end().unwrap_or(shape.sizes()[i]);
                            x >= r.start() && x < end && (x - r.start()) % r.step() == 0
                        }
                    }
                })
            })
            .collect(),
        Selection::Union(operands) => {
            let sets: Vec<Vec<bool>> = operands
                .iter()
                .map(|o| brute(o, shape, points, seed))
                .collect();
            (0..points.len())
                .map(|i| sets.iter().any(|s| s[i]))
                .collect()
        }
        Selection::Intersection(operands) => {
            let sets: Vec<Vec<bool>> = operands
                .iter()
                .map(|o| brute(o, shape, points, seed))
                .collect();
            (0..points.len())
                .map(|i| sets.iter().all(|s| s[i]))
                .collect()
        }
        Selection::First { dims, of } | Selection::Any { dims, of } => {
            let of = brute(of, shape, points, seed);
            let in_scope: Vec<bool> = (0..shape.ndim())
                .map(|i| dims.is_empty() || dims.iter().any(|d| position(d) == i))
                .collect();
            let same_group =
                |p: &[usize], q: &[usize]| (0..p.len()).all(|i| in_scope[i] || p[i] == q[i]);
            let first = matches!(selection, Selection::First { .. });
            (0..points.len())
                .map(|i| {
                    of[i]
                        && (0..points.len()).all(|j| {
                            j == i
                                || !of[j]
                                || !same_group(&points[i], &points[j])
                                || if first {
                                    // Row-major: lexicographic on coordinates.
                                    points[j] > points[i]
                                } else {
                                    splitmix(seed, j) > splitmix(seed, i)
                                }
                        })
                })
                .collect()
        }
    }
}

/// The hash of `docs/semantics.md` §3, written out again.
fn splitmix(seed: u64, index: usize) -> u64 {
    let mut z = seed.wrapping_add((index as u64 + 1).wrapping_mul(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

/// The sorted ranks of the brute-force set.
fn brute_ranks(selection: &Selection, shape: &Shape, seed: u64) -> Vec<Rank> {
    let points: Vec<Vec<usize>> = shape.points().map(|p| p.coords().to_vec()).collect();
    let set = brute(selection, shape, &points, seed);
    let mut ranks: Vec<Rank> = points
        .iter()
        .zip(set)
        .filter(|(_, picked)| *picked)
        .map(|(p, _)| shape.rank_at(p).unwrap())
        .collect();
    ranks.sort();
    ranks
}

fn shape_and_selection() -> impl Strategy<Value = (Shape, Selection)> {
    arb_shape(4, 3).prop_flat_map(|shape| {
        let selection = arb_selection_for(&shape, 4);
        (Just(shape), selection)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn eval_equals_brute_force((shape, selection) in shape_and_selection(), seed in any::<u64>()) {
        prop_assert!(selection.validate().is_ok());
        let ranks = selection.eval(&shape, seed).unwrap();
        prop_assert_eq!(&ranks, &brute_ranks(&selection, &shape, seed), "{}", selection);
        let selected = selection.bind(&shape, seed).unwrap();
        prop_assert_eq!(selected.len(), ranks.len());
        for rank in shape.ranks() {
            prop_assert_eq!(selected.contains(rank), ranks.binary_search(&rank).is_ok());
        }
    }

    #[test]
    fn eval_in_a_region_equals_filtering(
        (shape, selection) in shape_and_selection(),
        seed in any::<u64>(),
        cut in (0usize..4, 0usize..3, 1usize..4, 1usize..3),
    ) {
        let (dim, start, len, step) = cut;
        let region = if shape.ndim() == 0 {
            shape.clone()
        } else {
            let name = shape.names()[dim % shape.ndim()].to_string();
            shape.slice_step(&name, start..start + len, step).unwrap_or_else(|_| shape.clone())
        };
        let all = selection.eval(&shape, seed).unwrap();
        let expected: Vec<Rank> = all.into_iter().filter(|&r| region.contains(r)).collect();
        prop_assert_eq!(selection.eval_in(&shape, &region, seed).unwrap(), expected);
    }

    #[test]
    fn selecting_a_box_is_evaluating_it((shape, selection) in shape_and_selection()) {
        let ranks = selection.eval(&shape, 0).unwrap();
        match shape.select(&selection) {
            Ok(view) => {
                let mut viewed: Vec<Rank> = view.ranks().collect();
                viewed.sort();
                prop_assert_eq!(viewed, ranks);
                prop_assert_eq!(view.names(), shape.names());
            }
            Err(SelectionError::Empty { .. }) => prop_assert!(ranks.is_empty()),
            Err(SelectionError::NotABox { .. }) => prop_assert!(!matches!(
                selection,
                Selection::All | Selection::None | Selection::Dims(_)
            )),
            Err(e) => prop_assert!(false, "{e}"),
        }
    }

    #[test]
    fn parse_print_round_trips(selection in arb_selection_text()) {
        prop_assert!(selection.validate().is_ok());
        let text = selection.to_string();
        let parsed: Selection = text.parse().map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(&parsed, &selection, "{}", text);
        prop_assert_eq!(parsed.to_string(), text);
        let json = serde_json::to_string(&selection).unwrap();
        prop_assert_eq!(serde_json::from_str::<Selection>(&json).unwrap(), selection);
    }

    #[test]
    fn shape_selections_round_trip_too((_, selection) in shape_and_selection()) {
        prop_assert_eq!(selection.to_string().parse::<Selection>().unwrap(), selection);
    }

    /// The decoder keeps the selections it parsed last on its thread
    /// (`regent_net::memo`): a stream of texts that repeat, and refused
    /// ones among them, decodes each to what parsing that text gives.
    #[test]
    fn decoding_a_stream_of_selections_returns_each_text_parsed(
        good in prop::collection::vec(arb_selection_text(), 1..10),
        bad in prop::collection::vec("[a-c*()|&,=.:0-9 _!firstanyone]{0,12}", 0..6),
        picks in prop::collection::vec(any::<prop::sample::Index>(), 1..40),
    ) {
        let texts: Vec<String> = good.iter().map(ToString::to_string).chain(bad).collect();
        for pick in &picks {
            let text = pick.get(&texts);
            let bytes = postcard::to_allocvec(text.as_str()).unwrap();
            let decoded = postcard::from_bytes::<Selection>(&bytes).ok();
            prop_assert_eq!(decoded, text.parse::<Selection>().ok(), "{}", text);
        }
    }

    /// The encoder keeps the texts of the selections it printed last on
    /// its thread: a stream of selections that repeat, and invalid ones
    /// among them, encodes each to its own text, and refuses each invalid
    /// one every time.
    #[test]
    fn encoding_a_stream_of_selections_carries_each_ones_text(
        good in prop::collection::vec(arb_selection_text(), 1..10),
        picks in prop::collection::vec(any::<prop::sample::Index>(), 1..40),
    ) {
        let invalid = [Selection::Union(vec![]), Selection::Dims(vec![])];
        let pool: Vec<&Selection> = good.iter().chain(&invalid).collect();
        for pick in &picks {
            let s = *pick.get(&pool);
            let encoded = postcard::to_allocvec(s).ok();
            let expected = s.validate().ok().map(|()| postcard::to_allocvec(&s.to_string()).unwrap());
            prop_assert_eq!(encoded, expected, "{:?}", s);
        }
    }

    #[test]
    fn arbitrary_text_never_panics(input in any::<String>()) {
        check_parse(&input)?;
    }

    #[test]
    fn near_miss_text_never_panics(input in "[a-c*()|&,=.:0-9 _!firstanyone]{0,40}") {
        check_parse(&input)?;
    }
}

/// Parses `input`: a selection that parses is well formed and round-trips;
/// an error points inside the input and displays.
fn check_parse(input: &str) -> Result<(), TestCaseError> {
    match input.parse::<Selection>() {
        Ok(selection) => {
            prop_assert!(selection.validate().is_ok());
            let text = selection.to_string();
            prop_assert_eq!(text.parse::<Selection>().unwrap(), selection);
        }
        Err(e) => {
            prop_assert!(e.position() <= input.len());
            prop_assert!(input.is_char_boundary(e.position()));
            prop_assert!(e.to_string().contains('^'));
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn bit_ranges_hold_what_was_set(
        len in 0usize..300,
        ranges in prop::collection::vec((0usize..300, 0usize..70), 0..4),
        query in (0usize..300, 0usize..300),
    ) {
        let mut bits = eval::Bits::empty(len);
        let mut model = vec![false; len];
        for (start, count) in ranges {
            let start = start.min(len);
            let end = (start + count).min(len);
            bits.set_range(start, end);
            model[start..end].iter_mut().for_each(|b| *b = true);
        }
        let (a, b) = (query.0.min(query.1), query.0.max(query.1));
        let expected: Vec<usize> = (a..b.min(len)).filter(|&i| model[i]).collect();
        prop_assert_eq!(bits.ones_in(a, b).collect::<Vec<_>>(), expected);
        prop_assert_eq!(bits.count(), model.iter().filter(|&&b| b).count());
        prop_assert_eq!(bits.ones().count(), bits.count());
        let full = eval::Bits::full(len);
        prop_assert_eq!(full.ones().collect::<Vec<_>>(), (0..len).collect::<Vec<_>>());
    }
}

proptest! {
    /// A selection that says it does not use the seed picks the same
    /// members for every seed (casts batched into one frame share the
    /// first one's seed), and one with an `any` says it does.
    #[test]
    fn a_selection_without_any_picks_the_same_for_every_seed(
        (shape, selection) in shape_and_selection(),
        seeds in (any::<u64>(), any::<u64>()),
    ) {
        prop_assert_eq!(selection.uses_seed(), selection.to_string().contains("any"));
        if !selection.uses_seed() {
            prop_assert_eq!(
                selection.eval(&shape, seeds.0).ok(),
                selection.eval(&shape, seeds.1).ok()
            );
        }
    }
}

#[test]
fn any_anywhere_uses_the_seed() {
    for text in ["any", "procs=1 | any(gpus: *)", "first(any(hosts=0..2))"] {
        assert!(sel(text).uses_seed(), "{text}");
    }
    for text in ["*", "none", "hosts=1", "first(gpus: *) & hosts=0"] {
        assert!(!sel(text).uses_seed(), "{text}");
    }
}
