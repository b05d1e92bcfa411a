use super::*;
use proptest::prelude::*;

fn line(proc: &str, text: &str) -> LogLine {
    LogLine {
        proc: ProcId::new(proc).unwrap(),
        stream: LogStream::Stdout,
        text: text.into(),
    }
}

#[test]
fn splitter_cuts_lines_and_keeps_the_partial_last_one() {
    let mut s = LineSplitter::default();
    assert_eq!(s.push(b"a\nb"), vec!["a"]);
    assert_eq!(s.push(b"c\r\n\nd"), vec!["bc", ""]);
    assert_eq!(s.finish().as_deref(), Some("d"));
    assert_eq!(s.finish(), None);
    let long = vec![b'x'; MAX_LINE_BYTES * 2 + 5];
    let lines = s.push(&long);
    assert_eq!(lines.len(), 2);
    assert!(lines.iter().all(|l| l.len() == MAX_LINE_BYTES));
    assert_eq!(s.finish().unwrap().len(), 5);
    assert_eq!(s.push(&[0xff, b'\n']), vec!["\u{fffd}"]);
}

proptest! {
    /// Any bytes in any chunks: the same lines as splitting the whole at
    /// once, none longer than the bound, and nothing but `\n`s (and the
    /// `\r`s before them) lost.
    #[test]
    fn splitter_is_chunking_independent(
        bytes in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), any::<u8>(), Just(b'a')], 0..9_000),
        cuts in proptest::collection::vec(0usize..9_000, 0..8),
    ) {
        let mut whole = LineSplitter::default();
        let mut expect = whole.push(&bytes);
        expect.extend(whole.finish());
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
        cuts.sort_unstable();
        let mut chunked = LineSplitter::default();
        let mut got = Vec::new();
        let mut at = 0;
        for c in cuts.into_iter().chain([bytes.len()]) {
            got.extend(chunked.push(&bytes[at..c]));
            at = c;
        }
        got.extend(chunked.finish());
        prop_assert_eq!(&got, &expect);
        prop_assert!(got.iter().all(|l| l.len() <= MAX_LINE_BYTES && !l.contains('\n')));
        if bytes.is_ascii() {
            let kept: usize = got.iter().map(String::len).sum();
            let newlines = bytes.iter().filter(|&&b| b == b'\n').count();
            let crs = bytes.iter().filter(|&&b| b == b'\r').count();
            prop_assert!(kept + newlines + crs >= bytes.len());
        }
    }

    /// Tags round-trip; any other text either parses to a tag whose
    /// printed form starts it, or is not a tag.
    #[test]
    fn member_tags_round_trip(mesh in "[a-z0-9_.-]{1,12}", rank: u32, generation: u64, rest in ".{0,40}") {
        let tag = MemberTag { mesh, rank, generation };
        let text = format!("{TAG_MARK}{tag} {rest}");
        let (back, tail) = MemberTag::parse(&text).unwrap();
        prop_assert_eq!(back, tag);
        prop_assert_eq!(tail, rest.as_str());
    }

    #[test]
    fn member_tag_parse_never_panics(text in "\\PC{0,60}") {
        if let Some((tag, rest)) = MemberTag::parse(&text) {
            let printed = format!("{TAG_MARK}{tag}");
            prop_assert!(text.starts_with(&printed));
            prop_assert!(text.ends_with(rest));
        }
    }

    /// Bad bytes never decode into a line longer than the bound, nor a
    /// batch longer than its bound.
    #[test]
    fn wire_lines_decode_bounded(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(l) = postcard::from_bytes::<LogLine>(&bytes) {
            prop_assert!(l.text.len() <= MAX_LINE_BYTES);
        }
    }
}

#[test]
fn a_line_too_long_does_not_decode() {
    let mut l = line("p0-1", "");
    l.text = "y".repeat(MAX_LINE_BYTES + 1);
    let bytes = postcard::to_allocvec(&l).unwrap();
    let err = postcard::from_bytes::<LogLine>(&bytes).unwrap_err();
    assert!(!err.to_string().is_empty());
    l.text.pop();
    let bytes = postcard::to_allocvec(&l).unwrap();
    assert_eq!(postcard::from_bytes::<LogLine>(&bytes).unwrap(), l);
}

#[test]
fn prefixes_say_who_wrote_it() {
    let r = LogRecord::of(line("p0-2", "\u{1e}[train r2 g3] loss 1.23"));
    assert_eq!(r.render(LogMode::All).unwrap(), "[train r2 g3] loss 1.23");
    // A user's line that only looks like a tag is the proc's.
    let r = LogRecord::of(line("p0-2", "[train r2 g3] loss 1.23"));
    assert_eq!(
        r.render(LogMode::All).unwrap(),
        "[p0 r2] [train r2 g3] loss 1.23"
    );
    let r = LogRecord::of(line("p0-2", "listening"));
    assert_eq!(r.render(LogMode::Fold).unwrap(), "[p0 r2] listening");
    let r = LogRecord::of(line("host-a", "x"));
    assert_eq!(r.render(LogMode::All).unwrap(), "[host-a] x");
    assert_eq!(r.render(LogMode::Off), None);
    let json: serde_json::Value =
        serde_json::from_str(&LogRecord::of(line("p1-0", "\u{1e}[m r4 g1] hi")).to_json()).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"proc": "p1-0", "mesh": "m", "rank": 4, "gen": 1, "stream": "stdout", "line": "hi"})
    );
    assert_eq!(compress_ranks(&[0, 1, 2, 3, 5, 7, 8]), "0-3,5,7-8");
    assert_eq!(compress_ranks(&[]), "");
}

#[tokio::test(start_paused = true)]
async fn the_folder_folds_within_its_window_and_keeps_order() {
    let window = Duration::from_millis(100);
    let mut f = Folder::new(window);
    let t0 = Instant::now();
    for r in [2, 0, 3, 1] {
        let text = format!("\u{1e}[m r{r} g1] same");
        assert!(
            f.push(t0, LogRecord::of(line(&format!("p0-{r}"), &text)))
                .is_empty()
        );
    }
    // Proc lines from four procs, and one from another mesh's member.
    for r in 0..4 {
        assert!(
            f.push(t0, LogRecord::of(line(&format!("p0-{r}"), "boot")))
                .is_empty()
        );
    }
    assert!(f.next_due() == Some(t0 + window));
    let out = f.due(t0 + window);
    let rendered: Vec<String> = out
        .iter()
        .map(|r| r.render(LogMode::Fold).unwrap())
        .collect();
    assert_eq!(rendered, vec!["[m r0-3 g1] same", "[p0 r0-3] boot"]);

    // The same rank twice: the first goes out before the second opens.
    let t1 = t0 + window * 2;
    assert!(f.push(t1, LogRecord::of(line("p0-0", "a"))).is_empty());
    assert!(f.push(t1, LogRecord::of(line("p0-1", "b"))).is_empty());
    let out = f.push(t1, LogRecord::of(line("p0-0", "a")));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].render(LogMode::Fold).unwrap(), "[p0 r0] a");
    let rest: Vec<String> = f
        .drain()
        .iter()
        .map(|r| r.render(LogMode::Fold).unwrap())
        .collect();
    assert_eq!(rest, vec!["[p0 r1] b", "[p0 r0] a"]);
    // Different generations or streams do not fold.
    f.push(t1, LogRecord::of(line("p0-0", "\u{1e}[m r0 g1] x")));
    f.push(t1, LogRecord::of(line("p0-1", "\u{1e}[m r1 g2] x")));
    assert_eq!(f.drain().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn the_folder_is_bounded() {
    let mut f = Folder::new(Duration::from_secs(1));
    let t0 = Instant::now();
    let mut out = 0;
    for i in 0..(MAX_FOLDING + 10) {
        out += f
            .push(t0, LogRecord::of(line("p0-0", &format!("line {i}"))))
            .len();
    }
    assert_eq!(out, 10);
    assert_eq!(f.drain().len(), MAX_FOLDING);
}

#[test]
fn modes_parse() {
    for m in [LogMode::Fold, LogMode::All, LogMode::Json, LogMode::Off] {
        assert_eq!(m.to_string().parse::<LogMode>().unwrap(), m);
    }
    assert!("loud".parse::<LogMode>().unwrap_err().contains("fold"));
}

#[test]
fn the_tail_keeps_the_last_lines() {
    let mut t = Tail::default();
    for i in 0..(MAX_TAIL_LINES + 3) {
        t.push(line("p0-0", &i.to_string()));
    }
    let lines = t.take();
    assert_eq!(lines.len(), MAX_TAIL_LINES);
    assert_eq!(lines[0].text, "3");
    assert_eq!(lines.last().unwrap().text, (MAX_TAIL_LINES + 2).to_string());
    // Long lines: the bytes bound, and the last line always stays.
    for i in 0..5 {
        t.push(line(
            "p0-0",
            &format!("{i}{}", "x".repeat(MAX_LINE_BYTES - 1)),
        ));
    }
    let lines = t.take();
    assert_eq!(lines.len(), MAX_TAIL_BYTES / MAX_LINE_BYTES);
    assert!(lines.last().unwrap().text.starts_with('4'));
    let sum: usize = lines.iter().map(|l| l.text.len()).sum();
    assert!(sum <= MAX_TAIL_BYTES);
}

#[test]
fn a_dropped_count_keeps_its_weight() {
    let p = ProcId::new("p0-0").unwrap();
    assert_eq!(
        LogLine::dropped(p.clone(), LogStream::Stdout, 57).weight(),
        57
    );
    assert_eq!(line("p0-0", "regent: 5 lines").weight(), 1);
    assert_eq!(line("p0-0", "anything").weight(), 1);
}

#[test]
fn a_dead_procs_last_lines_show_the_member_tag_without_its_mark() {
    let cause = crate::policy::FailureCause::ProcExited {
        proc: regent_net::ProcId::new("p0-1").unwrap(),
        status: crate::alloc::ProcStatus::Signal(9),
        last_lines: vec![line("p0-1", "\u{1e}[m r1 g2] bye"), line("p0-1", "raw")],
    };
    let shown = cause.to_string();
    assert!(
        shown.contains("| [m r1 g2] bye") && shown.contains("| raw"),
        "{shown}"
    );
    assert!(!shown.contains(TAG_MARK), "{shown:?}");
}

fn marked() -> Option<Arc<str>> {
    MEMBER.with(|m| m.borrow().clone())
}

/// A member's code polled on a shared thread marks it as the member's
/// only while it runs: between its polls, after it, and after it panicked
/// (caught further up, as a life catches its handlers' panics), the mark
/// is what it was before.
#[test]
fn a_members_mark_on_a_shared_thread_lasts_only_while_its_code_runs() {
    use futures::FutureExt as _;
    let tag = MemberTag {
        mesh: "m".into(),
        rank: 3,
        generation: 1,
    };
    let prefix = member_prefix(&tag).unwrap();
    assert!(prefix.ends_with("[m r3 g1] "), "{prefix:?}");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        assert_eq!(marked(), None);
        let seen = as_member(Some(&prefix), async {
            let first = marked();
            tokio::task::yield_now().await;
            (first, marked())
        });
        // Another task runs between the member's polls, unmarked.
        let other = tokio::spawn(async { marked() });
        let (seen, other) = tokio::join!(seen, other);
        assert_eq!(seen, (Some(prefix.clone()), Some(prefix.clone())));
        assert_eq!(other.unwrap(), None);
        assert_eq!(marked(), None);
        let panicked = std::panic::AssertUnwindSafe(as_member(Some(&prefix), async {
            panic!("a member's panic");
        }))
        .catch_unwind()
        .await;
        assert!(panicked.is_err());
        assert_eq!(marked(), None, "the mark outlived a panic");
    });
}
