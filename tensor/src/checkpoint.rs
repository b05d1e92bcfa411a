//! Checkpoints: named tensors (weights, optimizer state) in the
//! safetensors format, so Python tools read them (the `safetensors`
//! Python package is built on the same Rust crate used here), with a
//! checksum in the metadata, written atomically, and refused whole when
//! truncated or corrupted.
//!
//! # Checksum
//!
//! Metadata key [`CHECKSUM_KEY`] holds `sha256:<64 hex digits>` of:
//!
//! ```text
//! "regent-safetensors-v1\n"
//! for each tensor, by name (bytewise order):
//!     u64le(len(name)) name  dtype-name "\0"  u64le(ndims) u64le(dim)...  sha256(data)
//! for each other metadata entry, by key:
//!     u64le(len(key)) key  u64le(len(value)) value
//! ```
//!
//! (dtype names as in the safetensors header: `F32`, `BF16`, ...). It
//! covers every byte that decides a loaded tensor, so a flipped bit in a
//! shape, a dtype, a name or the data is caught, not only in the data.
//!
//! # Atomic writes
//!
//! [`save`] writes a temporary file in the destination's directory,
//! fsyncs it, renames it over the destination and fsyncs the directory:
//! a crash leaves the old file or the new one, never a mix.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Metadata, TensorInfo};
use sha2::{Digest, Sha256};
use tch::Tensor;

use crate::buffer::{check_cpu, plain_bytes, plain_bytes_mut};
use crate::dtype::DType;
use crate::error::Error;

/// The metadata key of the checksum.
pub const CHECKSUM_KEY: &str = "regent.sha256";
/// The largest header accepted (safetensors' own limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Whether a checkpoint without a checksum (written by another tool) is
/// accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Verify {
    /// The checksum must be present and match.
    #[default]
    Required,
    /// A checksum that is present must match; none is accepted (the
    /// safetensors format's own checks still apply).
    IfPresent,
}

/// Named tensors and string metadata, as loaded.
#[derive(Debug)]
pub struct Checkpoint {
    /// The tensors, by name.
    pub tensors: BTreeMap<String, Tensor>,
    /// The metadata other than the checksum.
    pub metadata: BTreeMap<String, String>,
}

/// A running checksum (the module docs give the definition).
struct Checksum {
    entries: Vec<(String, Vec<u8>)>,
}

impl Checksum {
    fn new() -> Self {
        Self {
            entries: Vec::new(),
        }
    }

    fn tensor(
        &mut self,
        name: &str,
        dtype: safetensors::Dtype,
        shape: &[usize],
        data_sha: [u8; 32],
    ) {
        let mut e = Vec::new();
        e.extend((name.len() as u64).to_le_bytes());
        e.extend(name.as_bytes());
        e.extend(dtype.to_string().as_bytes());
        e.push(0);
        e.extend((shape.len() as u64).to_le_bytes());
        for &d in shape {
            e.extend((d as u64).to_le_bytes());
        }
        e.extend(data_sha);
        self.entries.push((name.to_owned(), e));
    }

    fn finish(mut self, metadata: &BTreeMap<String, String>) -> String {
        self.entries
            .sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let mut h = Sha256::new();
        h.update(b"regent-safetensors-v1\n");
        for (_, e) in &self.entries {
            h.update(e);
        }
        for (k, v) in metadata {
            if k != CHECKSUM_KEY {
                h.update((k.len() as u64).to_le_bytes());
                h.update(k.as_bytes());
                h.update((v.len() as u64).to_le_bytes());
                h.update(v.as_bytes());
            }
        }
        let digest = h.finalize();
        let mut s = String::from("sha256:");
        for b in digest {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
}

fn sha(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// A tensor ready to write: name, dtype, shape, contiguous data.
type Prepared = (String, DType, Vec<usize>, Tensor);

/// The tensors, made contiguous, and the metadata with the checksum.
fn prepare(
    tensors: &[(&str, &Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<Prepared>, BTreeMap<String, String>), Error> {
    if metadata.contains_key(CHECKSUM_KEY) {
        return Err(Error::Invalid(format!(
            "metadata key {CHECKSUM_KEY} is reserved for the checksum"
        )));
    }
    let mut names = std::collections::BTreeSet::new();
    let mut out = Vec::with_capacity(tensors.len());
    let mut sum = Checksum::new();
    for (name, t) in tensors {
        if name.is_empty() || *name == "__metadata__" || !names.insert(*name) {
            return Err(Error::Invalid(format!(
                "tensor name {name:?} is empty, reserved or repeated"
            )));
        }
        check_cpu(t)?;
        let dtype = DType::from_kind(t.f_kind()?)?;
        let t = t.f_contiguous()?;
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        sum.tensor(name, dtype.safetensors(), &shape, sha(plain_bytes(&t)?));
        out.push((name.to_string(), dtype, shape, t));
    }
    let mut meta = metadata.clone();
    meta.insert(CHECKSUM_KEY.to_owned(), sum.finish(metadata));
    Ok((out, meta))
}

/// The header (length prefix included) of a file holding `prepared`, in
/// the order their data follows it: by descending dtype alignment, then
/// name (safetensors' own order). Canonical: the same tensors and
/// metadata give the same bytes (JSON objects with sorted keys; the
/// safetensors crate's writer orders metadata by a randomly seeded hash).
fn header(prepared: &mut [Prepared], meta: &BTreeMap<String, String>) -> Result<Vec<u8>, Error> {
    prepared.sort_by(|(ln, ld, ..), (rn, rd, ..)| {
        rd.safetensors().cmp(&ld.safetensors()).then(ln.cmp(rn))
    });
    let mut obj = serde_json::Map::new();
    obj.insert(
        "__metadata__".into(),
        serde_json::to_value(meta).map_err(json)?,
    );
    let mut offset = 0usize;
    for (name, dtype, shape, t) in prepared.iter() {
        let n = plain_bytes(t)?.len();
        obj.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype.safetensors(),
                "shape": shape,
                "data_offsets": [offset, offset + n],
            }),
        );
        offset += n;
    }
    let mut json_bytes = serde_json::to_vec(&obj).map_err(json)?;
    // Data starts 8-byte aligned, as safetensors writes it.
    json_bytes.resize(json_bytes.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json_bytes.len());
    out.extend((json_bytes.len() as u64).to_le_bytes());
    out.extend(json_bytes);
    Ok(out)
}

fn json(e: serde_json::Error) -> Error {
    Error::checkpoint(None, format!("encoding the header: {e}"))
}

/// Named tensors (CPU; any layout, written row-major) and metadata, as
/// the bytes of a safetensors file with a checksum. The same tensors and
/// metadata give the same bytes.
pub fn to_bytes(
    tensors: &[(&str, &Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, Error> {
    let (mut prepared, meta) = prepare(tensors, metadata)?;
    let mut out = header(&mut prepared, &meta)?;
    // One allocation: growing by doubling copied the data again and
    // faulted in fresh pages at each step (a model's state is megabytes).
    let mut data = 0usize;
    for (.., t) in &prepared {
        data += plain_bytes(t)?.len();
    }
    out.reserve_exact(data);
    for (.., t) in &prepared {
        out.extend_from_slice(plain_bytes(t)?);
    }
    Ok(out)
}

/// Checks a parsed header's tensors and the checksum; returns the
/// metadata without the checksum.
fn verify(
    metadata: &Option<HashMap<String, String>>,
    sum: Checksum,
    verify: Verify,
    path: Option<&Path>,
) -> Result<BTreeMap<String, String>, Error> {
    let meta: BTreeMap<String, String> = metadata.clone().unwrap_or_default().into_iter().collect();
    match meta.get(CHECKSUM_KEY) {
        Some(stored) => {
            let actual = sum.finish(&meta);
            if *stored != actual {
                return Err(Error::checkpoint(
                    path,
                    format!(
                        "checksum mismatch: the file says {stored}, its contents give {actual} (corrupted)"
                    ),
                ));
            }
        }
        None if verify == Verify::Required => {
            return Err(Error::checkpoint(
                path,
                format!("no checksum ({CHECKSUM_KEY}) in the metadata"),
            ));
        }
        None => {}
    }
    let mut meta = meta;
    meta.remove(CHECKSUM_KEY);
    Ok(meta)
}

/// A tensor's dtype and shape from the header, checked.
fn tensor_kind(
    name: &str,
    dtype: safetensors::Dtype,
    shape: &[usize],
    path: Option<&Path>,
) -> Result<(DType, Vec<i64>), Error> {
    let dtype = DType::from_safetensors(dtype)
        .map_err(|e| Error::checkpoint(path, format!("tensor {name}: {e}")))?;
    let shape = shape
        .iter()
        .map(|&d| i64::try_from(d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| Error::checkpoint(path, format!("tensor {name}: dimension too large")))?;
    Ok((dtype, shape))
}

/// Loads the bytes of a safetensors file: everything is checked (the
/// format, the checksum) before a single tensor is made.
pub fn from_bytes(bytes: &[u8], mode: Verify) -> Result<Checkpoint, Error> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| Error::checkpoint(None, format!("not a valid safetensors file: {e}")))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::checkpoint(None, format!("not a valid safetensors file: {e}")))?;
    let mut sum = Checksum::new();
    let views = st.tensors();
    for (name, v) in &views {
        sum.tensor(name, v.dtype(), v.shape(), sha(v.data()));
    }
    let metadata = verify(header.metadata(), sum, mode, None)?;
    let mut tensors = BTreeMap::new();
    for (name, v) in views {
        let (dtype, shape) = tensor_kind(&name, v.dtype(), v.shape(), None)?;
        tensors.insert(
            name,
            Tensor::f_from_data_size(v.data(), &shape, dtype.kind())?,
        );
    }
    Ok(Checkpoint { tensors, metadata })
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn io<'a>(context: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        context,
        path: path.to_owned(),
        source,
    }
}

/// Removes a temporary file unless disarmed.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Writes named tensors and metadata to `path` atomically (module docs),
/// in the safetensors format with a checksum.
pub fn save(
    path: &Path,
    tensors: &[(&str, &Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), Error> {
    let (mut prepared, meta) = prepare(tensors, metadata)?;
    let head = header(&mut prepared, &meta)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::Invalid(format!("{} names no file", path.display())))?;
    let temp = dir.join(format!(
        ".{}.tmp-{}-{}",
        file_name.to_string_lossy(),
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)
        .map_err(io("create", &temp))?;
    // Ours from here on: removed on any failure.
    let mut guard = TempFile(Some(temp.clone()));
    {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        w.write_all(&head).map_err(io("write", &temp))?;
        for (.., t) in &prepared {
            w.write_all(plain_bytes(t)?).map_err(io("write", &temp))?;
        }
        let file = w.into_inner().map_err(|e| Error::Io {
            context: "write",
            path: temp.clone(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(io("fsync", &temp))?;
    }
    std::fs::rename(&temp, path).map_err(io("rename into place", path))?;
    guard.0 = None;
    File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync the directory", &dir))?;
    Ok(())
}

/// Loads a checkpoint file. It is read once, straight into new tensors,
/// and returned only if the format and the checksum check out: a
/// truncated or corrupted file gives an error and no tensor.
pub fn load(path: &Path, mode: Verify) -> Result<Checkpoint, Error> {
    let p = Some(path);
    let mut f = File::open(path).map_err(io("open", path))?;
    let file_len = f.metadata().map_err(io("stat", path))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| Error::checkpoint(p, format!("truncated: {file_len} bytes, no header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES || n.saturating_add(8) > file_len {
        return Err(Error::checkpoint(
            p,
            format!("header of {n} bytes in a file of {file_len} (truncated or corrupted)"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(io("read", path))?;
    let header: Metadata = serde_json::from_slice(&header)
        .map_err(|e| Error::checkpoint(p, format!("invalid header: {e}")))?;
    let expected = 8 + n + header.data_len() as u64;
    if expected != file_len {
        return Err(Error::checkpoint(
            p,
            format!(
                "the header describes {expected} bytes, the file has {file_len} ({})",
                if file_len < expected {
                    "truncated"
                } else {
                    "trailing bytes"
                }
            ),
        ));
    }
    // In file order (offsets are contiguous: the header was validated).
    let mut infos: Vec<(String, &TensorInfo)> = header.tensors().into_iter().collect();
    infos.sort_by_key(|(_, i)| i.data_offsets);
    let mut sum = Checksum::new();
    let mut tensors = BTreeMap::new();
    for (name, info) in infos {
        let (dtype, shape) = tensor_kind(&name, info.dtype, &info.shape, p)?;
        let mut t = Tensor::f_empty(&shape, (dtype.kind(), tch::Device::Cpu))?;
        let dst = plain_bytes_mut(&mut t)?;
        if dst.len() != info.data_offsets.1 - info.data_offsets.0 {
            return Err(Error::checkpoint(
                p,
                format!("tensor {name}: size does not match its offsets"),
            ));
        }
        f.read_exact(dst).map_err(io("read", path))?;
        sum.tensor(&name, info.dtype, &info.shape, sha(dst));
        tensors.insert(name, t);
    }
    let metadata = verify(header.metadata(), sum, mode, p)?;
    Ok(Checkpoint { tensors, metadata })
}

/// Loads a checkpoint into existing tensors (e.g. a model's variables),
/// by name: the file is loaded and verified whole, and every target is
/// checked (present, same dtype and shape) before any is written. Returns
/// the metadata.
pub fn load_into(
    path: &Path,
    mode: Verify,
    targets: &mut [(&str, &mut Tensor)],
) -> Result<BTreeMap<String, String>, Error> {
    let ck = load(path, mode)?;
    for (name, t) in targets.iter() {
        let src = ck
            .tensors
            .get(*name)
            .ok_or_else(|| Error::checkpoint(Some(path), format!("no tensor {name}")))?;
        if src.size() != t.size() || src.kind() != t.f_kind()? {
            return Err(Error::LayoutMismatch {
                expected: format!("{name}: {:?} {:?}", t.kind(), t.size()),
                found: format!("{:?} {:?} in {}", src.kind(), src.size(), path.display()),
            });
        }
    }
    for (name, t) in targets.iter_mut() {
        // Checked present above.
        let src = &ck.tensors[*name];
        tch::no_grad(|| t.f_copy_(src))?;
    }
    Ok(ck.metadata)
}

#[cfg(test)]
mod tests;
