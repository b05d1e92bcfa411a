//! Checkpoints: round trips, the standard format, atomic writes, and
//! refusal of truncated or corrupted files.

use std::collections::BTreeMap;
use std::path::PathBuf;

use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

use super::*;

/// A fresh directory under the system's temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "regent-ckpt-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sample() -> (Vec<(String, Tensor)>, BTreeMap<String, String>) {
    crate::testing::init_torch();
    tch::manual_seed(7);
    let mut tensors = vec![
        (
            "w".to_owned(),
            Tensor::randn([17, 5], (Kind::Float, Device::Cpu)),
        ),
        // Non-contiguous: written row-major.
        (
            "w_t".to_owned(),
            Tensor::randn([4, 6], (Kind::Double, Device::Cpu)).transpose(0, 1),
        ),
        (
            "adam.m".to_owned(),
            Tensor::randn([9], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16),
        ),
        ("step".to_owned(), Tensor::from(1234i64)),
        (
            "empty".to_owned(),
            Tensor::zeros([0, 3], (Kind::Half, Device::Cpu)),
        ),
    ];
    for d in [DType::I32, DType::I16, DType::I8, DType::U8, DType::Bool] {
        tensors.push((
            format!("t_{d}"),
            Tensor::arange(11, (Kind::Int64, Device::Cpu)).to_kind(d.kind()),
        ));
    }
    let meta = BTreeMap::from([("step".to_owned(), "1234".to_owned())]);
    (tensors, meta)
}

fn refs(t: &[(String, Tensor)]) -> Vec<(&str, &Tensor)> {
    t.iter().map(|(n, t)| (n.as_str(), t)).collect()
}

fn assert_same(ck: &Checkpoint, tensors: &[(String, Tensor)], meta: &BTreeMap<String, String>) {
    assert_eq!(ck.tensors.len(), tensors.len());
    for (n, t) in tensors {
        let got = &ck.tensors[n];
        assert_eq!(got.size(), t.size(), "{n}");
        assert_eq!(got.kind(), t.kind(), "{n}");
        assert!(got.equal(t), "{n}");
    }
    assert_eq!(&ck.metadata, meta);
}

#[test]
fn named_tensors_round_trip_through_bytes_and_files() {
    let (tensors, meta) = sample();
    let bytes = to_bytes(&refs(&tensors), &meta).unwrap();
    assert_same(
        &from_bytes(&bytes, Verify::Required).unwrap(),
        &tensors,
        &meta,
    );
    let dir = TempDir::new("roundtrip");
    let path = dir.0.join("model.safetensors");
    save(&path, &refs(&tensors), &meta).unwrap();
    assert_same(&load(&path, Verify::Required).unwrap(), &tensors, &meta);
    // The file is the same bytes as `to_bytes`, and only it is left.
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(dir.entries(), ["model.safetensors"]);
}

#[test]
fn the_same_checkpoint_gives_the_same_bytes() {
    let (tensors, _) = sample();
    let meta: BTreeMap<String, String> = (0..20)
        .map(|i| (format!("key{i}"), format!("v{i}")))
        .collect();
    let a = to_bytes(&refs(&tensors), &meta).unwrap();
    for _ in 0..5 {
        assert!(to_bytes(&refs(&tensors), &meta).unwrap() == a);
    }
    let mut reversed = refs(&tensors);
    reversed.reverse();
    assert!(
        to_bytes(&reversed, &meta).unwrap() == a,
        "the order given does not matter"
    );
}

#[test]
fn files_are_standard_safetensors_with_the_checksum_in_the_metadata() {
    let (tensors, meta) = sample();
    let bytes = to_bytes(&refs(&tensors), &meta).unwrap();
    // The reference reader (the core of Python's `safetensors`) reads it.
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("w").unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::F32);
    assert_eq!(w.shape(), [17, 5]);
    let mut expect = vec![0u8; 17 * 5 * 4];
    tensors[0].1.copy_data_u8(&mut expect, 85);
    assert_eq!(w.data(), &expect[..]);
    assert_eq!(st.tensor("w_t").unwrap().shape(), [6, 4]);
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let m = header.metadata().as_ref().unwrap();
    assert_eq!(m["step"], "1234");
    assert!(m[CHECKSUM_KEY].starts_with("sha256:") && m[CHECKSUM_KEY].len() == 7 + 64);
    // A file another tool wrote, without a checksum: refused unless asked.
    let plain = safetensors::serialize(
        [(
            "x",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &[0u8; 8])
                .unwrap(),
        )],
        None,
    )
    .unwrap();
    let e = from_bytes(&plain, Verify::Required).unwrap_err();
    assert!(e.to_string().contains("no checksum"), "{e}");
    assert_eq!(
        from_bytes(&plain, Verify::IfPresent).unwrap().tensors["x"].size(),
        [2]
    );
}

#[test]
fn a_failed_save_leaves_the_old_file_and_no_temporary() {
    let (tensors, meta) = sample();
    let dir = TempDir::new("atomic");
    let path = dir.0.join("ck.safetensors");
    save(&path, &refs(&tensors), &meta).unwrap();
    let before = std::fs::read(&path).unwrap();
    // A repeated name, a reserved key: refused before anything is written.
    let t = Tensor::zeros([2], (Kind::Float, Device::Cpu));
    assert!(save(&path, &[("a", &t), ("a", &t)], &meta).is_err());
    let bad = BTreeMap::from([(CHECKSUM_KEY.to_owned(), "x".to_owned())]);
    assert!(save(&path, &[("a", &t)], &bad).is_err());
    // Writing fails midway (the destination is a directory: the temporary
    // is written, the rename fails): the temporary is removed.
    let sub = dir.0.join("sub");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("x"), b"keep").unwrap();
    assert!(save(&sub, &[("a", &t)], &meta).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(dir.entries(), ["ck.safetensors", "sub"]);
}

#[test]
fn load_into_checks_every_target_before_writing_any() {
    let (tensors, meta) = sample();
    let dir = TempDir::new("into");
    let path = dir.0.join("ck.safetensors");
    save(&path, &refs(&tensors), &meta).unwrap();
    let mut w = Tensor::zeros([17, 5], (Kind::Float, Device::Cpu));
    let mut m = Tensor::zeros([9], (Kind::BFloat16, Device::Cpu));
    let mut wrong = Tensor::zeros([10], (Kind::Float, Device::Cpu));
    let e = load_into(
        &path,
        Verify::Required,
        &mut [("w", &mut w), ("step", &mut wrong)],
    )
    .unwrap_err();
    assert!(matches!(e, Error::LayoutMismatch { .. }), "{e}");
    assert_eq!(
        w.abs().sum(Kind::Float).double_value(&[]),
        0.0,
        "nothing written"
    );
    let e = load_into(&path, Verify::Required, &mut [("nope", &mut wrong)]).unwrap_err();
    assert!(e.to_string().contains("no tensor nope"), "{e}");
    let got = load_into(
        &path,
        Verify::Required,
        &mut [("w", &mut w), ("adam.m", &mut m)],
    )
    .unwrap();
    assert!(w.equal(&tensors[0].1) && m.equal(&tensors[2].1));
    assert_eq!(got, meta);
}

/// Loading gives exactly the saved tensors, or an error: never a partial
/// or altered checkpoint.
fn loads_whole_or_not_at_all(
    bytes: &[u8],
    tensors: &[(String, Tensor)],
    meta: &BTreeMap<String, String>,
    dir: &TempDir,
    what: &str,
) -> bool {
    let path = dir.0.join("ck.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let from_file = load(&path, Verify::Required);
    let from_mem = from_bytes(bytes, Verify::Required);
    assert_eq!(
        from_file.is_ok(),
        from_mem.is_ok(),
        "{what}: {:?} vs {:?}",
        from_file.as_ref().err(),
        from_mem.as_ref().err()
    );
    match from_file {
        Ok(ck) => {
            assert_same(&ck, tensors, meta);
            assert_same(&from_mem.unwrap(), tensors, meta);
            true
        }
        Err(e) => {
            assert!(matches!(e, Error::Checkpoint { .. }), "{what}: {e}");
            false
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn truncated_files_are_refused(cut in any::<prop::sample::Index>()) {
        let (tensors, meta) = sample();
        let bytes = to_bytes(&refs(&tensors), &meta).unwrap();
        let at = cut.index(bytes.len());
        let dir = TempDir::new("trunc");
        prop_assert!(!loads_whole_or_not_at_all(&bytes[..at], &tensors, &meta, &dir, "truncated"));
        // Bytes added at the end are refused too.
        let mut longer = bytes.clone();
        longer.push(0);
        prop_assert!(!loads_whole_or_not_at_all(&longer, &tensors, &meta, &dir, "extended"));
    }

    /// A changed byte anywhere (header, checksum, data) is refused, except
    /// one that leaves the content the same (a blank of the header's
    /// padding turned into another blank).
    #[test]
    fn corrupted_files_are_refused(at in any::<prop::sample::Index>(), x in 1u8..=255) {
        let (tensors, meta) = sample();
        let mut bytes = to_bytes(&refs(&tensors), &meta).unwrap();
        let i = at.index(bytes.len());
        let old = bytes[i];
        bytes[i] ^= x;
        let dir = TempDir::new("corrupt");
        let loaded = loads_whole_or_not_at_all(&bytes, &tensors, &meta, &dir, "corrupted");
        if loaded {
            prop_assert!(old.is_ascii_whitespace() && bytes[i].is_ascii_whitespace(), "byte {} changed {:#x} -> {:#x} and loaded", i, old, bytes[i]);
        }
    }
}
