//! The chaos suite: seeded scenarios mixing kills, pauses, partitions, loss
//! and delay on meshes of 4–8 real procs (`chaos_proc`) behind UDP chaos
//! proxies, running a workload that counts and checks its messages; every
//! invariant of `chaos/SEMANTICS.md` is checked after each. Every scenario
//! prints its seed and timeline; the same seed replays the same timeline.

use regent_chaos::scenario::run;
use regent_chaos::{
    ClusterConfig, FaultKind, FaultMix, Length, Report, Scenario, ScheduleConfig, Seed,
};

fn cluster() -> ClusterConfig {
    ClusterConfig::default().program(env!("CARGO_BIN_EXE_chaos_proc"))
}

async fn play(s: Scenario) -> Report {
    println!("scenario {} seed {}", s.name, s.seed);
    let r = run(&s, cluster(), Length::Rounds(1), |p| {
        println!("{}", p.schedule)
    })
    .await
    .expect("the scenario could not start");
    println!("{r}");
    r.assert_clean();
    r
}

fn mix(kinds: &[FaultKind]) -> ScheduleConfig {
    ScheduleConfig::default().mix(FaultMix::only(kinds))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s01_kills() {
    play(Scenario::new("s01-kills", Seed(101)).schedule(mix(&[FaultKind::Kill]))).await;
}
