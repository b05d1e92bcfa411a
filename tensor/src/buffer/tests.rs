//! Tensors over registered memory: zero copy, lifetime, handles, reads.

use tch::{Device, Kind, Tensor};

use super::*;
use crate::transport::local::local_managers;

fn init() {
    crate::testing::init_torch();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_buffer_shares_memory_with_its_tensor() {
    init();
    let m = local_managers(2, Default::default()).await.unwrap();
    let mut tb = TensorBuffer::zeros(&m[0], DType::F32, &[4, 5]).unwrap();
    assert_eq!(tb.tensor().size(), [4, 5]);
    assert_eq!(tb.tensor().kind(), Kind::Float);
    let _ = tb.tensor_mut().fill_(3.5);
    // A peer reads the tensor's bytes from the buffer: what tch wrote is there.
    let h = TensorHandle::decode(&tb.handle().encode()).unwrap();
    let mut got = vec![0u8; 80];
    m[1].read_into(h.buffer(), 0, &mut got).await.unwrap();
    assert!(
        got.chunks(4)
            .all(|c| f32::from_ne_bytes(c.try_into().unwrap()) == 3.5)
    );
    // A peer writes the buffer: the tensor sees it.
    m[1].write_from(h.buffer(), 4, &7.0f32.to_ne_bytes())
        .await
        .unwrap();
    assert_eq!(tb.tensor().double_value(&[0, 1]), 7.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_of_the_tensor_keep_the_buffer_registered() {
    init();
    let m = local_managers(2, Default::default()).await.unwrap();
    let tb = TensorBuffer::zeros(&m[0], DType::I64, &[8]).unwrap();
    let h = tb.handle();
    let view = tb.tensor().narrow(0, 2, 3);
    drop(tb);
    // The view still points into the registered memory, which is alive.
    assert_eq!(m[0].registered(), 1);
    m[1].write_from(h.buffer(), 16, &42i64.to_ne_bytes())
        .await
        .unwrap();
    assert_eq!(view.int64_value(&[0]), 42);
    drop(view);
    // The last tensor went: the buffer is released and peers are told so.
    assert_eq!(m[0].registered(), 0);
    let e = m[1]
        .read_into(h.buffer(), 0, &mut [0u8; 8])
        .await
        .unwrap_err();
    assert!(e.is_invalidated(), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_refuse_or_copy_non_contiguous_tensors() {
    init();
    let m = local_managers(1, Default::default()).await.unwrap();
    let t = Tensor::arange(12, (Kind::Float, Device::Cpu)).reshape([3, 4]);
    let tt = t.transpose(0, 1);
    let e = TensorBuffer::copy_from(&m[0], &tt, Contiguity::Refuse).unwrap_err();
    assert!(matches!(e, Error::NotContiguous { .. }), "{e}");
    assert!(e.to_string().contains("[1, 4]"), "{e}");
    let c = TensorBuffer::copy_from(&m[0], &tt, Contiguity::Copy).unwrap();
    assert!(c.layout().is_contiguous());
    assert!(c.tensor().equal(&tt));
    let d = TensorBuffer::copy_from(&m[0], &t, Contiguity::Refuse).unwrap();
    assert!(d.tensor().equal(&t));
    // Every dtype.
    for dtype in DType::ALL {
        let x = Tensor::arange(10, (Kind::Float, Device::Cpu)).to_kind(dtype.kind());
        let b = TensorBuffer::copy_from(&m[0], &x, Contiguity::Refuse).unwrap();
        assert_eq!(b.layout().dtype(), dtype);
        assert!(b.tensor().equal(&x), "{dtype}");
    }
    // Empty and scalar tensors.
    let e = TensorBuffer::zeros(&m[0], DType::F32, &[0, 3]).unwrap();
    assert_eq!(e.tensor().numel(), 0);
    let s = TensorBuffer::zeros(&m[0], DType::F32, &[]).unwrap();
    assert_eq!(s.tensor().size(), Vec::<i64>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_tensor_is_read_into_an_existing_tensor_of_the_same_layout() {
    init();
    let m = local_managers(2, Default::default()).await.unwrap();
    let x = Tensor::randn([33, 7], (Kind::Float, Device::Cpu));
    let src = TensorBuffer::copy_from(&m[0], &x, Contiguity::Refuse).unwrap();
    let handle = TensorHandle::decode(&src.handle().encode()).unwrap();
    let mut dst = TensorBuffer::zeros(&m[1], DType::F32, &[33, 7]).unwrap();
    let before = dst.tensor().data_ptr();
    dst.read_from(&m[1], &handle).await.unwrap();
    assert!(dst.tensor().equal(&x));
    assert_eq!(dst.tensor().data_ptr(), before, "read in place");
    // A transposed (dense) layout on both sides.
    let tl = Layout::new(DType::F32, vec![7, 33], vec![1, 7], 0).unwrap();
    let mut tsrc = TensorBuffer::with_layout(&m[0], tl.clone()).unwrap();
    tsrc.tensor_mut().copy_(&x.transpose(0, 1));
    let mut tdst = TensorBuffer::with_layout(&m[1], tl).unwrap();
    tdst.read_from(&m[1], &tsrc.handle()).await.unwrap();
    assert!(tdst.tensor().equal(&x.transpose(0, 1)));
    // Writes go the other way.
    let y = Tensor::randn([33, 7], (Kind::Float, Device::Cpu));
    let mut w = TensorBuffer::copy_from(&m[1], &y, Contiguity::Refuse).unwrap();
    w.write_to(&m[1], &handle).await.unwrap();
    assert!(src.tensor().equal(&y));
    // Another layout is refused before any byte moves.
    let mut other = TensorBuffer::zeros(&m[1], DType::F32, &[7, 33]).unwrap();
    let e = other.read_from(&m[1], &handle).await.unwrap_err();
    assert!(matches!(e, Error::LayoutMismatch { .. }), "{e}");
    let mut other = TensorBuffer::zeros(&m[1], DType::F64, &[33, 7]).unwrap();
    assert!(other.read_from(&m[1], &handle).await.is_err());
    assert!(with_gaps(&m[1]).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_f32_tensor_buffer_is_a_slice_of_its_own_memory() {
    init();
    let m = local_managers(2, Default::default()).await.unwrap();
    let x = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
    let mut tb = TensorBuffer::copy_from(&m[0], &x, Contiguity::Refuse).unwrap();
    let want: Vec<f32> = Vec::try_from(x.reshape([-1])).unwrap();
    assert_eq!(tb.as_f32().unwrap(), &want[..]);
    // Writes through the slice are the tensor's, and a peer reads them.
    tb.as_f32_mut().unwrap()[4] = 9.25;
    assert_eq!(tb.tensor().double_value(&[1, 1]), 9.25);
    let mut got = [0u8; 4];
    m[1].read_into(tb.handle().buffer(), 16, &mut got)
        .await
        .unwrap();
    assert_eq!(f32::from_ne_bytes(got), 9.25);
    assert_eq!(
        tb.as_f32().unwrap().as_ptr() as i64,
        tb.tensor().data_ptr() as i64,
        "no copy"
    );
    // Only contiguous f32 tensors are slices of f32.
    let mut d = TensorBuffer::zeros(&m[0], DType::F64, &[4]).unwrap();
    assert!(matches!(d.as_f32_mut(), Err(Error::Invalid(_))));
    let t = TensorBuffer::with_layout(
        &m[0],
        Layout::new(DType::F32, vec![3, 2], vec![1, 3], 0).unwrap(),
    )
    .unwrap();
    assert!(matches!(t.as_f32(), Err(Error::NotContiguous { .. })));
    let e = TensorBuffer::zeros(&m[0], DType::F32, &[0]).unwrap();
    assert!(e.as_f32().unwrap().is_empty());
}

fn with_gaps(m: &BufferManager) -> Result<TensorBuffer, Error> {
    TensorBuffer::with_layout(
        m,
        Layout::new(DType::F32, vec![2, 2], vec![4, 1], 0).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_whose_layout_leaves_the_buffer_are_refused_on_decode() {
    init();
    let m = local_managers(1, Default::default()).await.unwrap();
    let tb = TensorBuffer::zeros(&m[0], DType::F32, &[10]).unwrap();
    let h = tb.handle();
    assert_eq!(TensorHandle::decode(&h.encode()).unwrap(), h);
    // The buffer holds 40 bytes: a layout of 11 elements does not fit.
    let long = Layout::contiguous(DType::F32, &[11], 0).unwrap();
    assert!(TensorHandle::new(h.buffer().clone(), long.clone()).is_err());
    // Forge the wire form of such a handle: decode refuses it.
    #[derive(serde::Serialize)]
    struct Wire<'a> {
        buffer: &'a regent_rdma::RemoteBuffer,
        layout: &'a Layout,
    }
    let bytes = postcard::to_allocvec(&Wire {
        buffer: h.buffer(),
        layout: &long,
    })
    .unwrap();
    let e = TensorHandle::decode(&bytes).unwrap_err();
    assert!(e.to_string().contains("past the 40 bytes"), "{e}");
    let mut trailing = h.encode();
    trailing.push(0);
    assert!(TensorHandle::decode(&trailing).is_err());
}
