//! A training state as bytes (for a heal over the payload plane) and on
//! disk (checkpoints in a run directory).
//!
//! Both use the tensor layer's safetensors encoding with its checksum, so a
//! state read from a peer or a file is checked whole before anything is
//! loaded. A run directory holds `ckpt-<step>.safetensors` files (the last
//! [`KEEP_CHECKPOINTS`] of them) and `latest`, which names the newest; each
//! is written atomically (temporary file, fsync, rename), so a kill while
//! one is written leaves the previous one in force; the temporary such a
//! kill leaves behind is removed by the next checkpoint. If `latest` or the
//! file it names is damaged or missing, the newest checkpoint that verifies
//! is used; if there are checkpoints and none verifies, loading fails
//! rather than silently start again from step 0.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use regent_tensor::checkpoint::{self, Verify};

use crate::Error;
use crate::state::TrainState;

/// Checkpoints a run directory keeps.
pub const KEEP_CHECKPOINTS: usize = 3;

/// The bytes of a state (canonical: the same state gives the same bytes).
pub fn to_bytes(state: &TrainState) -> Result<Vec<u8>, Error> {
    let named = state.to_named_tensors();
    let refs: Vec<(&str, &tch::Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Ok(checkpoint::to_bytes(&refs, &BTreeMap::new())?)
}

/// A state from its bytes; refused whole if anything does not check out.
pub fn from_bytes(bytes: &[u8]) -> Result<TrainState, Error> {
    let c = checkpoint::from_bytes(bytes, Verify::Required)?;
    TrainState::from_named_tensors(c.tensors.into_iter().collect())
}

fn run_dir_error(path: &Path, message: impl Into<String>) -> Error {
    Error::RunDir {
        path: path.to_owned(),
        message: message.into(),
    }
}

fn ckpt_name(step: u64) -> String {
    format!("ckpt-{step:012}.safetensors")
}

fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("ckpt-")?
        .strip_suffix(".safetensors")?
        .parse()
        .ok()
}

/// Writes `state` as the run directory's newest checkpoint; returns its
/// path and size.
pub fn save_checkpoint(dir: &Path, state: &TrainState) -> Result<(PathBuf, u64), Error> {
    std::fs::create_dir_all(dir).map_err(|e| run_dir_error(dir, e.to_string()))?;
    let path = dir.join(ckpt_name(state.step));
    let named = state.to_named_tensors();
    let refs: Vec<(&str, &tch::Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    checkpoint::save(&path, &refs, &BTreeMap::new())?;
    let bytes = std::fs::metadata(&path)
        .map_err(|e| run_dir_error(&path, e.to_string()))?
        .len();
    write_atomic(&dir.join("latest"), ckpt_name(state.step).as_bytes())?;
    prune(dir)?;
    remove_stale_temporaries(dir);
    Ok((path, bytes))
}

/// Whether `name` is a temporary of a checkpoint or final-state write
/// (`.<name>.tmp-<pid>-<n>`, the tensor layer's naming) by another process
/// than this one.
fn stale_temporary(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(".ckpt-").or_else(|| {
        name.strip_prefix(".")
            .and_then(|n| n.strip_prefix(FINAL_NAME))
    }) else {
        return false;
    };
    let Some((_, tail)) = rest.split_once(".tmp-") else {
        return false;
    };
    let pid = tail.split('-').next().and_then(|p| p.parse::<u32>().ok());
    pid.is_some_and(|p| p != std::process::id())
}

/// Removes the temporaries other processes left (a writer killed before
/// its rename). Only one process of a job writes to its run directory at a
/// time (rank 0; a controller holds the run directory's lock), so another
/// process's temporary is a dead writer's.
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        if e.file_name().to_str().is_some_and(stale_temporary) {
            match std::fs::remove_file(e.path()) {
                Ok(()) => {
                    tracing::info!(path = %e.path().display(), "a dead writer's temporary is removed")
                }
                Err(err) => {
                    tracing::warn!(path = %e.path().display(), error = %err, "a dead writer's temporary could not be removed")
                }
            }
        }
    }
}

/// The name of a run's final state in its run directory.
pub const FINAL_NAME: &str = "final.safetensors";

/// Writes a run's final state to its run directory (atomically); returns
/// the path.
pub fn save_final(dir: &Path, state: &TrainState) -> Result<PathBuf, Error> {
    std::fs::create_dir_all(dir).map_err(|e| run_dir_error(dir, e.to_string()))?;
    let path = dir.join(FINAL_NAME);
    let named = state.to_named_tensors();
    let refs: Vec<(&str, &tch::Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    checkpoint::save(&path, &refs, &BTreeMap::new())?;
    Ok(path)
}

/// Loads a state written by [`save_final`] or [`save_checkpoint`].
pub fn load(path: &Path) -> Result<TrainState, Error> {
    let c = checkpoint::load(path, Verify::Required)?;
    TrainState::from_named_tensors(c.tensors.into_iter().collect())
}

/// Replaces `path`'s contents atomically.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    use std::io::Write as _;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    let err = |e: std::io::Error| run_dir_error(path, e.to_string());
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    f.write_all(bytes).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(err)
}

/// The checkpoints of a run directory, newest first.
fn checkpoints(dir: &Path) -> Result<Vec<(u64, PathBuf)>, Error> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(run_dir_error(dir, e.to_string())),
    };
    let mut found: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            Some((step_of(&name)?, e.path()))
        })
        .collect();
    found.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    Ok(found)
}

fn prune(dir: &Path) -> Result<(), Error> {
    for (_, path) in checkpoints(dir)?.into_iter().skip(KEEP_CHECKPOINTS) {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// The newest checkpoint of the run directory that verifies (the one
/// `latest` names, or else the newest of the others), loaded; `None` when
/// the directory holds no checkpoint. Checkpoints of which none verifies
/// are an error: starting again from step 0 would drop the run's progress
/// without a word.
pub fn latest_checkpoint(dir: &Path) -> Result<Option<(PathBuf, TrainState)>, Error> {
    let mut candidates = checkpoints(dir)?;
    let found = candidates.len();
    let mut last_error = None;
    if let Ok(name) = std::fs::read_to_string(dir.join("latest"))
        && let Some(step) = step_of(name.trim())
        && let Some(i) = candidates.iter().position(|(s, _)| *s == step)
    {
        let named = candidates.remove(i);
        candidates.insert(0, named);
    }
    for (_, path) in candidates {
        match checkpoint::load(&path, Verify::Required) {
            Ok(c) => {
                let state = TrainState::from_named_tensors(c.tensors.into_iter().collect())?;
                return Ok(Some((path, state)));
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "a damaged checkpoint is skipped");
                last_error = Some(format!("{}: {e}", path.display()));
            }
        }
    }
    match last_error {
        None => Ok(None),
        Some(e) => Err(run_dir_error(
            dir,
            format!("none of its {found} checkpoints verifies (the last: {e})"),
        )),
    }
}

#[cfg(test)]
mod tests;
