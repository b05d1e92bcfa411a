use std::collections::BTreeSet;

use proptest::prelude::*;
use proptest::sample::subsequence;

use super::*;

fn shape(dims: &[(&str, usize)]) -> Shape {
    Shape::new(dims.iter().copied()).unwrap()
}

fn ranks(shape: &Shape) -> Vec<u32> {
    shape.ranks().map(|r| r.0).collect()
}

/// A random valid shape: up to `max_dims` dimensions of sizes `1..=max_size`
/// named from `a`, `b`, `c`, `d`, laid out row-major in a random dimension
/// order (so some layouts are transposed) at a random offset, then sliced a
/// few times (strided views, fixed coordinates).
pub(crate) fn arb_shape(max_dims: usize, max_size: usize) -> impl Strategy<Value = Shape> {
    (
        prop::collection::vec(1..=max_size, 0..=max_dims),
        any::<u64>(),
        0usize..6,
        prop::collection::vec((0usize..4, 0usize..4, 1usize..5, 1usize..3, 0u8..4), 0..3),
    )
        .prop_map(|(sizes, order_seed, offset, ops)| {
            let names: Vec<DimName> = ["a", "b", "c", "d"][..sizes.len()]
                .iter()
                .map(|n| DimName::new(n).unwrap())
                .collect();
            // Lay the dimensions out in a shuffled order.
            let mut order: Vec<usize> = (0..sizes.len()).collect();
            order.sort_by_key(|&i| (order_seed.rotate_left(8 * i as u32) & 0xff, i));
            let mut strides = vec![0; sizes.len()];
            let mut stride = 1;
            for &i in order.iter().rev() {
                strides[i] = stride;
                stride *= sizes[i];
            }
            let slice = Slice::new(offset, sizes, strides).unwrap();
            let mut shape = Shape::from_parts(names, slice).unwrap();
            for (dim, start, len, step, kind) in ops {
                if shape.ndim() == 0 {
                    break;
                }
                let dim = shape.names()[dim % shape.ndim()].to_string();
                let sliced = if kind == 0 && shape.ndim() > 1 {
                    shape.at(&dim, start)
                } else {
                    shape.slice_step(&dim, start..start + len, step)
                };
                if let Ok(sliced) = sliced {
                    shape = sliced;
                }
            }
            shape
        })
}

/// The rank of `coords` by the definition, independently of the code.
fn rank_by_definition(shape: &Shape, coords: &[usize]) -> u64 {
    let slice = shape.layout();
    slice.offset() as u64
        + coords
            .iter()
            .zip(slice.strides())
            .map(|(&c, &s)| c as u64 * s as u64)
            .sum::<u64>()
}

/// All points of `shape` in row-major order, by decoding 0..len.
fn all_coords(shape: &Shape) -> Vec<Vec<usize>> {
    let sizes = shape.sizes();
    (0..shape.len())
        .map(|mut index| {
            let mut coords = vec![0; sizes.len()];
            for i in (0..sizes.len()).rev() {
                coords[i] = index % sizes[i];
                index /= sizes[i];
            }
            coords
        })
        .collect()
}

/// The ranks of a box through `for_each_run`.
fn run_ranks(s: &Shape, axes: &[Axis]) -> Vec<u64> {
    let mut ranks = Vec::new();
    for_each_run(
        s.layout().offset(),
        s.layout().strides(),
        axes,
        |first, delta, count| {
            ranks.extend((0..count as u64).map(|k| first + k * delta));
        },
    );
    ranks
}

#[test]
fn displays_dims_and_counts_members() {
    let s = shape(&[("hosts", 4), ("gpus", 8)]);
    assert_eq!(s.to_string(), "{hosts=4, gpus=8}");
    assert_eq!(s.len(), 32);
    assert_eq!(s.ndim(), 2);
    assert_eq!(s.size("gpus"), Ok(8));
    assert_eq!(
        s.dims()
            .map(|(n, size)| (n.as_str(), size))
            .collect::<Vec<_>>(),
        [("hosts", 4), ("gpus", 8)]
    );
    assert_eq!(ranks(&s), (0..32).collect::<Vec<_>>());
    assert_eq!(s.ranks().len(), 32);

    let scalar = Shape::new(Vec::<(&str, usize)>::new()).unwrap();
    assert_eq!(scalar.to_string(), "{}");
    assert_eq!(scalar.len(), 1);
    assert_eq!(ranks(&scalar), [0]);
    assert_eq!(scalar.point_of(Rank(0)).unwrap().to_string(), "{}");
}

#[test]
fn points_and_ranks_map_both_ways() {
    let s = shape(&[("hosts", 4), ("gpus", 8)]);
    let p = s.point(&[1, 3]).unwrap();
    assert_eq!(p.to_string(), "{hosts=1, gpus=3}");
    assert_eq!(p.coord("gpus"), Some(3));
    assert_eq!(p.coord("racks"), None);
    assert_eq!(s.rank_of(&p), Ok(Rank(11)));
    assert_eq!(s.rank_at(&[3, 7]), Ok(Rank(31)));
    assert_eq!(s.point_of(Rank(11)), Some(p));
    assert_eq!(s.point_of(Rank(32)), None);
    assert!(s.contains(Rank(31)) && !s.contains(Rank(32)));
    let points: Vec<String> = s.points().take(3).map(|p| p.to_string()).collect();
    assert_eq!(
        points,
        [
            "{hosts=0, gpus=0}",
            "{hosts=0, gpus=1}",
            "{hosts=0, gpus=2}"
        ]
    );
    assert_eq!(s.points().len(), 32);

    assert_eq!(
        s.point(&[4, 0]),
        Err(ShapeError::IndexOutOfRange {
            dim: "hosts".into(),
            index: 4,
            size: 4
        })
    );
    assert!(matches!(
        s.rank_at(&[1]),
        Err(ShapeError::Arity {
            expected: 2,
            found: 1,
            ..
        })
    ));
    let other = shape(&[("racks", 4), ("gpus", 8)]);
    assert!(matches!(
        other.rank_of(&s.point(&[0, 0]).unwrap()),
        Err(ShapeError::PointMismatch { .. })
    ));
    // Same names: the coordinates are read in the other shape.
    let view = s.slice("hosts", 2..).unwrap();
    assert_eq!(view.rank_of(&s.point(&[1, 0]).unwrap()), Ok(Rank(24)));
}

#[test]
fn slicing_makes_views_over_the_same_ranks() {
    let s = shape(&[("hosts", 4), ("gpus", 8)]);
    let v = s.slice("hosts", 1..3).unwrap();
    assert_eq!(v.to_string(), "{hosts=2, gpus=8}");
    assert_eq!(ranks(&v), (8..24).collect::<Vec<_>>());

    let v = s.slice_step("gpus", 1.., 3).unwrap();
    assert_eq!(v.to_string(), "{hosts=4, gpus=3}");
    assert_eq!(ranks(&v)[..6], [1, 4, 7, 9, 12, 15]);
    assert_eq!(v.point_of(Rank(12)).unwrap().coords(), [1, 1]);
    assert_eq!(v.point_of(Rank(13)), None);

    let v = s.slice("gpus", 2..=2).unwrap().slice("hosts", ..2).unwrap();
    assert_eq!(ranks(&v), [2, 10]);

    let v = s.at("hosts", 2).unwrap();
    assert_eq!(v.to_string(), "{gpus=8}");
    assert_eq!(ranks(&v), (16..24).collect::<Vec<_>>());
    let v = v.at("gpus", 5).unwrap();
    assert_eq!(v.to_string(), "{}");
    assert_eq!(ranks(&v), [21]);

    // A sliced dimension of size one keeps working.
    let v = s
        .slice("hosts", 3..4)
        .unwrap()
        .slice_step("gpus", .., 4)
        .unwrap();
    assert_eq!(ranks(&v), [24, 28]);
    assert_eq!(v.point_of(Rank(28)).unwrap().coords(), [0, 1]);
}

#[test]
fn slicing_refuses_what_is_not_there() {
    let s = shape(&[("hosts", 4), ("gpus", 8)]);
    assert!(matches!(
        s.slice("racks", ..),
        Err(ShapeError::UnknownDim { .. })
    ));
    assert!(matches!(
        s.slice("hosts", 0..5),
        Err(ShapeError::RangeOutOfRange { size: 4, .. })
    ));
    assert!(matches!(
        s.slice("hosts", 5..),
        Err(ShapeError::RangeOutOfRange { .. })
    ));
    assert!(matches!(
        s.slice("hosts", 2..2),
        Err(ShapeError::EmptySlice { .. })
    ));
    assert!(matches!(
        s.slice("hosts", 4..),
        Err(ShapeError::EmptySlice { .. })
    ));
    assert_eq!(s.slice_step("hosts", .., 0), Err(ShapeError::ZeroStep));
    #[expect(clippy::reversed_empty_ranges, reason = "the case under test")]
    let reversed = s.slice("hosts", 3..1);
    assert_eq!(
        reversed,
        Err(ShapeError::ReversedRange { start: 3, end: 1 })
    );
    assert!(matches!(
        s.at("gpus", 8),
        Err(ShapeError::IndexOutOfRange { .. })
    ));
    assert_eq!(
        s.slice("hosts", 0..usize::MAX).unwrap_err().to_string(),
        format!("range 0..{} exceeds dimension hosts of size 4", usize::MAX)
    );
}

#[test]
fn names_are_checked() {
    for good in ["hosts", "_x", "g9", "A_b", &"n".repeat(64)] {
        assert!(DimName::new(good).is_ok(), "{good}");
    }
    for bad in [
        "",
        "9a",
        "a-b",
        "a b",
        "é",
        "none",
        "first",
        "any",
        "all",
        &"n".repeat(65),
    ] {
        assert!(
            matches!(DimName::new(bad), Err(ShapeError::InvalidName { .. })),
            "{bad}"
        );
    }
    assert!(matches!(
        Shape::new([("a", 2), ("a", 3)]),
        Err(ShapeError::DuplicateDim { .. })
    ));
}

#[test]
fn construction_is_bounded_and_checked() {
    assert_eq!(
        Shape::new([("a", 2), ("b", 0)]),
        Err(ShapeError::ZeroSize { position: 1 })
    );
    let many: Vec<(String, usize)> = (0..17).map(|i| (format!("d{i}"), 1)).collect();
    assert!(matches!(
        Shape::new(many),
        Err(ShapeError::TooManyDims { .. })
    ));
    assert!(matches!(
        Shape::new([("a", 1 << 16), ("b", 1 << 16)]),
        Err(ShapeError::TooLarge { .. })
    ));
    assert!(Shape::new([("a", 1 << 16), ("b", (1 << 16) - 1)]).is_ok());
    assert!(matches!(
        Shape::new([("a", usize::MAX), ("b", usize::MAX)]),
        Err(ShapeError::TooLarge { .. })
    ));
    // Ranks must fit a u32.
    assert!(matches!(
        Slice::new(u32::MAX as usize, vec![2], vec![1]),
        Err(ShapeError::TooLarge {
            what: "largest rank",
            ..
        })
    ));
    assert!(Slice::new(u32::MAX as usize - 1, vec![2], vec![1]).is_ok());
    assert!(matches!(
        Slice::new(0, vec![2, 2], vec![1 << 31, 1 << 31]),
        Err(ShapeError::Overlap { .. })
    ));
    assert!(matches!(
        Slice::new(0, vec![3], vec![usize::MAX]),
        Err(ShapeError::TooLarge { .. })
    ));
    // Overlapping strides would give two points one rank.
    assert_eq!(
        Slice::new(0, vec![2, 2], vec![1, 1]),
        Err(ShapeError::Overlap { position: 0 })
    );
    assert_eq!(
        Slice::new(0, vec![3, 2], vec![2, 3]),
        Err(ShapeError::Overlap { position: 1 })
    );
    assert_eq!(
        Slice::new(0, vec![2], vec![0]),
        Err(ShapeError::Overlap { position: 0 })
    );
    // A size-one dimension's stride does not matter.
    assert!(Slice::new(0, vec![1, 4], vec![usize::MAX, 1]).is_ok());
    assert!(matches!(
        Slice::new(0, vec![2], vec![]),
        Err(ShapeError::Arity { .. })
    ));
    assert!(matches!(
        Shape::from_parts(
            vec![DimName::new("a").unwrap()],
            Slice::row_major(vec![]).unwrap()
        ),
        Err(ShapeError::Arity { .. })
    ));
}

#[test]
fn transposed_layouts_map_back_exactly() {
    // Column-major 2x3: rank = a + 2b.
    let slice = Slice::new(10, vec![2, 3], vec![1, 2]).unwrap();
    let s = Shape::from_parts(
        vec![DimName::new("a").unwrap(), DimName::new("b").unwrap()],
        slice,
    )
    .unwrap();
    assert_eq!(ranks(&s), [10, 12, 14, 11, 13, 15]);
    for p in s.points() {
        let r = s.rank_of(&p).unwrap();
        assert_eq!(s.point_of(r), Some(p));
    }
    assert_eq!(s.point_of(Rank(9)), None);
    assert_eq!(s.point_of(Rank(16)), None);
    assert!(!s.layout().is_rank_ordered());
    assert!(
        Shape::new([("a", 2), ("b", 3)])
            .unwrap()
            .layout()
            .is_rank_ordered()
    );
}

#[test]
fn dim_ranges_print_and_check() {
    assert_eq!(DimRange::new(0, Some(4), 1).unwrap().to_string(), "0..4");
    assert_eq!(DimRange::new(2, None, 1).unwrap().to_string(), "2..");
    assert_eq!(DimRange::new(0, Some(8), 2).unwrap().to_string(), "0..8:2");
    assert_eq!(DimRange::FULL.to_string(), "0..");
    assert_eq!(DimRange::from_bounds(..=3, 1).unwrap().to_string(), "0..4");
    assert_eq!(
        DimRange::new(1, Some(0), 1),
        Err(ShapeError::ReversedRange { start: 1, end: 0 })
    );
    assert_eq!(DimRange::new(0, None, 0), Err(ShapeError::ZeroStep));
    assert!(DimRange::from_bounds(..=usize::MAX, 1).is_err());
    let r = DimRange::new(1, Some(7), 3).unwrap();
    let picked: Vec<usize> = (0..10).filter(|&c| r.contains(c, 10)).collect();
    assert_eq!(picked, [1, 4]);
    assert!(!r.contains(4, 4));
}

#[test]
fn serde_round_trips_and_validates() {
    let s = shape(&[("hosts", 4), ("gpus", 8)])
        .slice_step("gpus", 1.., 2)
        .unwrap();
    let json = serde_json::to_string(&s).unwrap();
    assert_eq!(
        json,
        r#"{"names":["hosts","gpus"],"slice":{"offset":1,"sizes":[4,4],"strides":[8,2]}}"#
    );
    assert_eq!(serde_json::from_str::<Shape>(&json).unwrap(), s);
    let bytes = postcard::to_allocvec(&s).unwrap();
    assert_eq!(postcard::from_bytes::<Shape>(&bytes).unwrap(), s);
    assert_eq!(serde_json::to_string(&Rank(7)).unwrap(), "7");

    for bad in [
        r#"{"names":["a","a"],"slice":{"offset":0,"sizes":[2,2],"strides":[2,1]}}"#,
        r#"{"names":["a"],"slice":{"offset":0,"sizes":[2,2],"strides":[2,1]}}"#,
        r#"{"names":["none"],"slice":{"offset":0,"sizes":[2],"strides":[1]}}"#,
        r#"{"names":["a"],"slice":{"offset":0,"sizes":[0],"strides":[1]}}"#,
        r#"{"names":["a","b"],"slice":{"offset":0,"sizes":[2,2],"strides":[1,1]}}"#,
        r#"{"names":["a"],"slice":{"offset":4294967295,"sizes":[2],"strides":[1]}}"#,
        r#"{"names":["a"],"slice":{"offset":0,"sizes":[2],"strides":[1,1]}}"#,
    ] {
        assert!(serde_json::from_str::<Shape>(bad).is_err(), "{bad}");
    }
}

proptest! {
    #[test]
    fn layout_matches_its_definition(s in arb_shape(4, 4)) {
        let coords = all_coords(&s);
        let ranks: Vec<u64> = s.ranks().map(|r| u64::from(r.0)).collect();
        let expected: Vec<u64> = coords.iter().map(|c| rank_by_definition(&s, c)).collect();
        prop_assert_eq!(&ranks, &expected);
        prop_assert_eq!(s.ranks().len(), s.len());
        let full: Vec<Axis> = s.sizes().iter().map(|&n| Axis::full(n)).collect();
        prop_assert_eq!(&run_ranks(&s, &full), &ranks);
        let points: Vec<Vec<usize>> = s.points().map(|p| p.coords().to_vec()).collect();
        prop_assert_eq!(&points, &coords);
        // Distinct points, distinct ranks; each maps back.
        let set: BTreeSet<u64> = ranks.iter().copied().collect();
        prop_assert_eq!(set.len(), ranks.len());
        for p in s.points() {
            let r = s.rank_of(&p).unwrap();
            prop_assert_eq!(s.point_of(r), Some(p));
        }
        // Ranks outside the view map to nothing.
        let max = ranks.iter().copied().max().unwrap_or(0);
        for r in 0..=max + 3 {
            prop_assert_eq!(s.contains(Rank(r as u32)), set.contains(&r));
        }
        prop_assert_eq!(s.layout().is_rank_ordered(), ranks.windows(2).all(|w| w[0] < w[1]));
        let decoded: Shape = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        prop_assert_eq!(decoded, s);
    }

    #[test]
    fn runs_are_the_ranks_of_a_box(
        s in arb_shape(4, 4),
        cuts in prop::collection::vec((0usize..4, 1usize..4, 0usize..5), 4),
    ) {
        let axes: Vec<Axis> = s
            .sizes()
            .iter()
            .zip(&cuts)
            .map(|(&size, &(start, step, count))| {
                let start = start.min(size - 1);
                let count = count.min((size - start).div_ceil(step));
                Axis { start, step, count }
            })
            .collect();
        let expected: Vec<u64> = Ranks::new(s.layout(), axes.clone()).map(|r| u64::from(r.0)).collect();
        prop_assert_eq!(run_ranks(&s, &axes), expected);
    }

    #[test]
    fn slicing_is_filtering(
        s in arb_shape(4, 4),
        dim in 0usize..4,
        start in 0usize..5,
        len in 0usize..5,
        step in 1usize..4,
    ) {
        prop_assume!(s.ndim() > 0);
        let position = dim % s.ndim();
        let name = s.names()[position].to_string();
        let size = s.sizes()[position];
        let keep = |c: usize| c >= start && c < start + len && (c - start).is_multiple_of(step);
        let expected: Vec<Rank> = s
            .points()
            .filter(|p| keep(p.coords()[position]))
            .map(|p| s.rank_of(&p).unwrap())
            .collect();
        match s.slice_step(&name, start..start + len, step) {
            Ok(view) => {
                prop_assert_eq!(view.ranks().collect::<Vec<_>>(), expected);
                prop_assert_eq!(view.names(), s.names());
            }
            Err(ShapeError::RangeOutOfRange { .. }) => prop_assert!(start + len > size),
            Err(ShapeError::EmptySlice { .. }) => prop_assert!(expected.is_empty()),
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
        match s.at(&name, start) {
            Ok(view) => {
                let expected: Vec<Rank> = s
                    .points()
                    .filter(|p| p.coords()[position] == start)
                    .map(|p| s.rank_of(&p).unwrap())
                    .collect();
                prop_assert_eq!(view.ranks().collect::<Vec<_>>(), expected);
                prop_assert_eq!(view.ndim(), s.ndim() - 1);
            }
            Err(_) => prop_assert!(start >= size),
        }
    }

    /// The decoder keeps the shapes it decoded last on its thread
    /// (`regent_net::memo`): a stream of shapes that repeat, differ only in
    /// their layout, or come between refused ones, decodes each to exactly
    /// the shape encoded, and a refused one is refused every time.
    #[test]
    fn decoding_a_stream_of_shapes_returns_each_shape_encoded(
        pool in prop::collection::vec(arb_shape(3, 3), 1..12),
        picks in prop::collection::vec(any::<prop::sample::Index>(), 1..40),
    ) {
        for (i, pick) in picks.iter().enumerate() {
            let s = pick.get(&pool);
            let bytes = postcard::to_allocvec(s).unwrap();
            let decoded: Shape = postcard::from_bytes(&bytes).unwrap();
            prop_assert_eq!(&decoded, s);
            if i % 3 == 0 && s.ndim() > 0 {
                // The same layout under a reserved name: refused.
                let mut json = serde_json::to_value(s).unwrap();
                json["names"][0] = serde_json::json!("none");
                prop_assert!(serde_json::from_value::<Shape>(json).is_err());
            }
        }
    }

    #[test]
    fn decoding_arbitrary_slices_never_panics(
        offset in prop_oneof![0usize..10, Just(u32::MAX as usize), any::<usize>()],
        sizes in prop::collection::vec(prop_oneof![0usize..5, any::<usize>()], 0..5),
        strides in prop::collection::vec(prop_oneof![0usize..20, any::<usize>()], 0..5),
        names in subsequence(vec!["a", "b", "c", "d", "none"], 0..5),
    ) {
        let json = serde_json::json!({
            "names": names,
            "slice": { "offset": offset, "sizes": sizes, "strides": strides },
        });
        if let Ok(s) = serde_json::from_value::<Shape>(json) {
            // Whatever is accepted keeps the invariants.
            let ranks: BTreeSet<Rank> = s.ranks().collect();
            prop_assert_eq!(ranks.len(), s.len());
            for p in s.points() {
                prop_assert_eq!(s.point_of(s.rank_of(&p).unwrap()), Some(p));
            }
        }
    }
}

/// A clone shares its original's names and slice (every cast carries its
/// view, and a tree node clones it for each child): no copy is made.
#[test]
fn a_shape_clone_shares_its_parts() {
    let s = shape(&[("hosts", 4), ("gpus", 8)]);
    let view = s.at("hosts", 1).unwrap();
    for original in [s, view] {
        let copy = original.clone();
        assert!(std::ptr::eq(original.layout(), copy.layout()));
        assert!(std::ptr::eq(original.names(), copy.names()));
        assert_eq!(original, copy);
    }
}
