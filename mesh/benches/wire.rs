//! Micro-benchmarks of the control plane's per-cast work on a frame: the
//! cast frame a proc takes off the wire for every call and cast
//! (`ProcCommand::Cast`), as `call_one` sends it to one member of a
//! `{hosts=16, gpus=8}` mesh: decoding it, encoding it, and binding its
//! selection to its view (which the caller, the controller and the proc
//! each do).
//!
//! The baseline, measured in the same run, is copying the frame's bytes
//! into a fresh `Bytes` (what any decode that keeps the payload must at
//! least do); compare `decode_call_frame` and `encode_call_frame` against
//! it. Decoding and encoding run the same frame again and again, as a
//! control thread does, so they measure the memo's hits
//! (`regent_net::memo`).
//!
//! Run: `cargo bench -p regent-mesh --bench wire`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, criterion_main};
use regent_mesh::protocol::{
    CastFrame, CastOrder, CastToken, Collect, MeshId, ProcCommand, ReplyTo,
};
use regent_mesh::{Selection, Shape};
use regent_net::{ActorId, ActorName, Generation, ProcId};

/// The frame `call_one` sends to the member at `{hosts=3, gpus=5}`.
fn call_frame() -> CastFrame {
    let controller = ActorId {
        proc: ProcId::new("controller").expect("a proc id"),
        name: ActorName::new("controller").expect("a name"),
        index: 0,
    };
    CastFrame {
        mesh: MeshId(7),
        generation: Generation(1),
        token: CastToken(0x1234_5678_9abc_def0_1234_5678_9abc_def0),
        origin: controller.clone(),
        order: CastOrder {
            caster: 0x5eed,
            seq: 1_000,
        },
        view: Shape::new([("hosts", 16), ("gpus", 8)]).expect("a shape"),
        selection: "hosts=3,gpus=5".parse::<Selection>().expect("a selection"),
        seed: 42,
        procs: (0, 16),
        per_proc: 8,
        lost: Vec::new(),
        payload: Bytes::from_static(&[1, 2, 3, 4, 5, 6, 7, 8]),
        more: Vec::new(),
        reply: Some(ReplyTo {
            port: controller.port(2),
            call: 99,
        }),
        collect: Collect::Gather,
        budget_ms: 30_000,
    }
}

fn frames(c: &mut Criterion) {
    let bytes = postcard::to_allocvec(&ProcCommand::Cast(call_frame())).expect("encodes");
    let mut group = c.benchmark_group("wire");
    group.bench_function("baseline_copy_frame_bytes", |b| {
        b.iter(|| Bytes::copy_from_slice(black_box(&bytes)))
    });
    group.bench_function("decode_call_frame", |b| {
        b.iter(|| postcard::from_bytes::<ProcCommand>(black_box(&bytes)).expect("decodes"))
    });
    group.bench_function("bind_call_selection", |b| {
        let frame = call_frame();
        b.iter(|| {
            black_box(&frame.selection)
                .bind(&frame.view, frame.seed)
                .expect("binds")
        })
    });
    group.bench_function("encode_call_frame", |b| {
        let command = ProcCommand::Cast(call_frame());
        b.iter(|| postcard::to_allocvec(black_box(&command)).expect("encodes"))
    });
    group.finish();
}

/// `criterion_group!` makes an undocumented `pub fn`; keep it private here.
#[allow(unreachable_pub, reason = "criterion_group! declares a pub fn")]
mod group {
    criterion::criterion_group!(benches, super::frames);
}

criterion_main!(group::benches);
