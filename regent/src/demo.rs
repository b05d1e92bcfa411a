//! `regent demo`: a tree of supervisors recovering from injected failures.

/// Runs the demo and prints what happened.
pub async fn run() -> anyhow::Result<()> {
    Ok(())
}
