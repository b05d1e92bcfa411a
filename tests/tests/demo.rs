//! The main job of README.md, `regent demo`, run as a test: a tree of
//! supervisors recovers from injected panics, errors, kills and a hung child,
//! then escalates a permanent fault to the root. The demo checks each claim it
//! prints (which children restarted, who gave up) and fails otherwise.
//!
//! It runs in its own test binary because it installs a quiet panic hook.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supervision_demo_recovers_and_escalates_as_documented() -> anyhow::Result<()> {
    regent::demo::run().await
}
