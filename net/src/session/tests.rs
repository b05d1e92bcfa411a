use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

#[derive(Debug, Clone, PartialEq)]
struct Item {
    seq: Seq,
    id: u64,
}

impl Pending for Item {
    fn renumber(&mut self, seq: Seq) {
        self.seq = seq;
    }
}

#[test]
fn acks_release_and_rewind_replays() {
    let mut w = SendWindow::new();
    for id in 0..4 {
        let seq = w.next_seq();
        w.push(seq, Item { seq, id });
    }
    let mut written = vec![];
    w.take_unwritten(|i| written.push(i.id));
    assert_eq!(written, [0, 1, 2, 3]);
    assert_eq!(w.ack(Seq(2)).unwrap().len(), 2);
    assert!(
        w.ack(Seq(9)).is_err(),
        "acking unsent messages is a violation"
    );
    assert_eq!(w.rewind(), Seq(3));
    let mut again = vec![];
    w.take_unwritten(|i| again.push(i.id));
    assert_eq!(again, [2, 3]);
}

#[test]
fn a_restarted_peer_gets_back_what_it_may_have_seen_and_a_fresh_numbering() {
    let mut w = SendWindow::new();
    for id in 0..3 {
        let seq = w.next_seq();
        w.push(seq, Item { seq, id });
    }
    w.take_unwritten(|_| {});
    let seq = w.next_seq();
    w.push(seq, Item { seq, id: 3 });
    let back = w.restart_session();
    assert_eq!(back.iter().map(|i| i.id).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(w.rewind(), Seq(1));
    let mut rest = vec![];
    w.take_unwritten(|i| rest.push((i.id, i.seq)));
    assert_eq!(rest, [(3, Seq(1))]);
}

#[test]
fn receiver_drops_duplicates_and_repeats_rejections() {
    let mut r = RecvWindow::new(1);
    let mut c = r.open(Seq(1)).unwrap();
    assert_eq!(r.arrive(&mut c, Seq(1)).unwrap(), Verdict::Deliver);
    r.handled(Seq(1), None);
    assert_eq!(r.arrive(&mut c, Seq(2)).unwrap(), Verdict::Deliver);
    r.handled(Seq(2), Some(RejectCause::NoSuchPort));
    assert!(r.arrive(&mut c, Seq(4)).is_err(), "a gap within a stream");
    let mut c = r.open(Seq(1)).unwrap();
    assert_eq!(r.arrive(&mut c, Seq(1)).unwrap(), Verdict::Duplicate(None));
    assert_eq!(
        r.arrive(&mut c, Seq(2)).unwrap(),
        Verdict::Duplicate(Some(RejectCause::NoSuchPort))
    );
    assert_eq!(r.arrive(&mut c, Seq(3)).unwrap(), Verdict::Deliver);
    // A declared gap (the sender gave 4..=9 back).
    r.handled(Seq(3), None);
    let mut c = r.open(Seq(10)).unwrap();
    assert_eq!(r.arrive(&mut c, Seq(10)).unwrap(), Verdict::Deliver);
}

#[derive(Debug, Clone)]
enum Step {
    Send(u8),
    Transmit,
    Receive(u8),
    ReturnAcks,
    Break,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1u8..5).prop_map(Step::Send),
        3 => Just(Step::Transmit),
        3 => (1u8..6).prop_map(Step::Receive),
        2 => Just(Step::ReturnAcks),
        1 => Just(Step::Break),
    ]
}

enum Back {
    Ack(Seq),
    Reject(Seq, RejectCause),
}

/// Sender and receiver windows over a stream that can break at any point
/// (dropping frames in flight both ways), against the model: every message
/// is delivered exactly once and in order, or (ids divisible by 5, "no such
/// port") given back exactly once.
fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let mut tx: SendWindow<Item> = SendWindow::new();
    let mut rx = RecvWindow::new(1);
    let mut next_id = 0u64;
    let mut to_rx: VecDeque<Item> = VecDeque::new();
    let mut to_tx: VecDeque<Back> = VecDeque::new();
    let mut cursor = rx.open(tx.rewind()).unwrap();
    let mut delivered: Vec<u64> = vec![];
    let mut given_back: Vec<u64> = vec![];
    let receive = |rx: &mut RecvWindow,
                   cursor: &mut StreamCursor,
                   item: Item,
                   delivered: &mut Vec<u64>,
                   to_tx: &mut VecDeque<Back>| {
        match rx.arrive(cursor, item.seq).unwrap() {
            Verdict::Deliver => {
                if item.id.is_multiple_of(5) {
                    rx.handled(item.seq, Some(RejectCause::NoSuchPort));
                    to_tx.push_back(Back::Reject(item.seq, RejectCause::NoSuchPort));
                } else {
                    rx.handled(item.seq, None);
                    delivered.push(item.id);
                }
            }
            Verdict::Duplicate(Some(cause)) => to_tx.push_back(Back::Reject(item.seq, cause)),
            Verdict::Duplicate(None) => {}
        }
        to_tx.push_back(Back::Ack(item.seq));
    };
    let ret = |tx: &mut SendWindow<Item>, to_tx: &mut VecDeque<Back>, given_back: &mut Vec<u64>| {
        while let Some(b) = to_tx.pop_front() {
            match b {
                Back::Ack(s) => {
                    tx.ack(s).unwrap();
                }
                Back::Reject(s, cause) => {
                    assert_eq!(cause, RejectCause::NoSuchPort);
                    given_back.push(tx.reject(s).unwrap().id)
                }
            }
        }
    };
    for s in steps {
        match s {
            Step::Send(n) => {
                for _ in 0..n {
                    let seq = tx.next_seq();
                    tx.push(seq, Item { seq, id: next_id });
                    next_id += 1;
                }
            }
            Step::Transmit => tx.take_unwritten(|i| to_rx.push_back(i.clone())),
            Step::Receive(n) => {
                for _ in 0..n {
                    let Some(item) = to_rx.pop_front() else { break };
                    receive(&mut rx, &mut cursor, item, &mut delivered, &mut to_tx);
                }
            }
            Step::ReturnAcks => ret(&mut tx, &mut to_tx, &mut given_back),
            Step::Break => {
                to_rx.clear();
                to_tx.clear();
                cursor = rx.open(tx.rewind()).unwrap();
            }
        }
        // Order and uniqueness hold at every step.
        prop_assert!(delivered.windows(2).all(|w| w[0] < w[1]), "{delivered:?}");
    }
    // Drain without faults.
    loop {
        tx.take_unwritten(|i| to_rx.push_back(i.clone()));
        while let Some(item) = to_rx.pop_front() {
            receive(&mut rx, &mut cursor, item, &mut delivered, &mut to_tx);
        }
        ret(&mut tx, &mut to_tx, &mut given_back);
        if tx.is_empty() {
            break;
        }
    }
    given_back.sort_unstable();
    let expect_delivered: Vec<u64> = (0..next_id).filter(|i| !i.is_multiple_of(5)).collect();
    let expect_back: Vec<u64> = (0..next_id).filter(|i| i.is_multiple_of(5)).collect();
    prop_assert_eq!(delivered, expect_delivered);
    prop_assert_eq!(given_back, expect_back);
    Ok(())
}

proptest! {
    #[test]
    fn exactly_once_in_order_across_breaks(steps in proptest::collection::vec(step(), 0..80)) {
        run(steps)?;
    }
}
