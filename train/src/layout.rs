//! The gradient layout: every trainable variable of a `VarStore`, in a fixed
//! order, flattened into one contiguous `f32` buffer.
//!
//! Order: trainable variables sorted by name (byte order of the `VarStore`
//! names, e.g. `blocks.0.attn.weight` < `blocks.0.ln1.bias`), independent of
//! the order the model created them in. Each variable occupies
//! `numel` consecutive elements in row-major (C) order, starting where the
//! previous one ends; there is no padding. Two replicas built from the same
//! configuration have the same layout; [`Layout::digest`] lets peers check
//! that before they exchange buffers.

use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::Error;
use crate::rng::name_key;

/// One variable's place in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutEntry {
    /// Name in the `VarStore`.
    pub name: String,
    /// Shape of the variable.
    pub shape: Vec<i64>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

/// The trainable variables of a `VarStore` and their places in a flat
/// buffer.
#[derive(Debug)]
pub struct Layout {
    entries: Vec<LayoutEntry>,
    params: Vec<Tensor>,
    len: usize,
}

impl Layout {
    /// The layout of `vs`'s trainable variables (those that require a
    /// gradient). Every one must be `f32`.
    pub fn of(vs: &VarStore) -> Result<Layout, Error> {
        let mut named: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut entries = Vec::with_capacity(named.len());
        let mut params = Vec::with_capacity(named.len());
        let mut offset = 0usize;
        for (name, t) in named {
            let kind = t.f_kind()?;
            if kind != Kind::Float {
                return Err(Error::NotF32 { name, kind });
            }
            let len = t.numel();
            entries.push(LayoutEntry {
                name,
                shape: t.size(),
                offset,
                len,
            });
            params.push(t);
            offset = offset
                .checked_add(len)
                .ok_or_else(|| Error::Config("more parameters than usize holds".into()))?;
        }
        Ok(Layout {
            entries,
            params,
            len: offset,
        })
    }

    /// Elements of the flat buffer (the number of trainable parameters).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no trainable parameter.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The variables in layout order.
    pub fn entries(&self) -> &[LayoutEntry] {
        &self.entries
    }

    /// The trainable variables themselves (shallow handles), in layout order.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// FNV-1a over every entry's name and shape: equal digests mean equal
    /// layouts (for all practical purposes).
    pub fn digest(&self) -> u64 {
        let mut h = name_key("regent-train layout v1");
        for e in &self.entries {
            h = (h ^ name_key(&e.name)).wrapping_mul(0x0100_0000_01b3);
            for &d in &e.shape {
                h = (h ^ d as u64).wrapping_mul(0x0100_0000_01b3);
            }
            h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
        }
        h
    }

    /// Copies `grads` (one per variable, in layout order) into `out`, which
    /// must hold exactly [`len`](Self::len) elements (the caller owns it: it
    /// may be registered memory of the payload plane). An undefined gradient
    /// (a variable the loss does not use) is written as zeros.
    pub fn gather(&self, grads: &[Tensor], out: &mut [f32]) -> Result<(), Error> {
        if grads.len() != self.entries.len() {
            return Err(Error::BufferLength {
                got: grads.len(),
                want: self.entries.len(),
            });
        }
        if out.len() != self.len {
            return Err(Error::BufferLength {
                got: out.len(),
                want: self.len,
            });
        }
        for (e, g) in self.entries.iter().zip(grads) {
            let dst = &mut out[e.offset..e.offset + e.len];
            if !g.defined() {
                dst.fill(0.0);
                continue;
            }
            if g.size() != e.shape {
                return Err(Error::State(format!(
                    "gradient of {} has shape {:?}, the variable {:?}",
                    e.name,
                    g.size(),
                    e.shape
                )));
            }
            g.f_copy_data(dst, e.len)?;
        }
        Ok(())
    }

    /// The flat buffer as one tensor per variable, in layout order: one copy
    /// of `flat` into a fresh tensor, and views of it shaped like the
    /// variables.
    pub fn unflatten(&self, flat: &[f32]) -> Result<Vec<Tensor>, Error> {
        if flat.len() != self.len {
            return Err(Error::BufferLength {
                got: flat.len(),
                want: self.len,
            });
        }
        self.views(&Tensor::f_from_slice(flat)?)
    }

    /// Views of a flat `f32` tensor of the layout's length (one dimension,
    /// contiguous), one per variable and shaped like it, in layout order:
    /// no copy — the views share `flat`'s memory (a registered buffer a
    /// collective reduced in place, say).
    pub fn views(&self, flat: &Tensor) -> Result<Vec<Tensor>, Error> {
        let kind = flat.f_kind()?;
        if kind != Kind::Float {
            return Err(Error::NotF32 {
                name: "the flat buffer".into(),
                kind,
            });
        }
        if flat.dim() != 1 || !flat.is_contiguous() || flat.numel() != self.len {
            return Err(Error::State(format!(
                "a flat buffer is one contiguous dimension of {} elements, not {:?} with strides {:?}",
                self.len,
                flat.size(),
                flat.stride()
            )));
        }
        self.entries
            .iter()
            .map(|e| {
                Ok(flat
                    .f_narrow(0, e.offset as i64, e.len as i64)?
                    .f_view(e.shape.as_slice())?)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;
    use tch::nn::Init;

    use super::*;

    fn store() -> VarStore {
        let vs = VarStore::new(Device::Cpu);
        let root = vs.root();
        // Created out of name order on purpose.
        let _ = root.sub("b").var("w", &[2, 3], Init::Const(1.0));
        let _ = root.sub("a").var("w", &[4], Init::Const(2.0));
        let _ = root.zeros_no_train("not_trained", &[5]);
        vs
    }

    #[test]
    fn the_order_is_by_name_and_excludes_untrained_variables() {
        let layout = Layout::of(&store()).unwrap();
        let names: Vec<&str> = layout.entries().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a.w", "b.w"]);
        assert_eq!(layout.entries()[1].offset, 4);
        assert_eq!(layout.len(), 10);
    }

    #[test]
    fn gather_then_unflatten_round_trips_bits() {
        let layout = Layout::of(&store()).unwrap();
        let flat: Vec<f32> = (0..10).map(|i| i as f32 * 0.1 - 0.3).collect();
        let tensors = layout.unflatten(&flat).unwrap();
        assert_eq!(tensors[1].size(), [2, 3]);
        let mut back = vec![f32::NAN; 10];
        layout.gather(&tensors, &mut back).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&flat));
        // An unused variable's gradient is undefined: zeros.
        let grads = [Tensor::new(), tensors[1].shallow_clone()];
        layout.gather(&grads, &mut back).unwrap();
        assert_eq!(&back[..4], &[0.0; 4]);
        assert!(matches!(
            layout.gather(&grads, &mut back[..9]),
            Err(Error::BufferLength { .. })
        ));
        assert!(matches!(
            layout.gather(&grads[..1], &mut back),
            Err(Error::BufferLength { .. })
        ));
    }

    #[test]
    fn views_share_the_flat_buffer_and_refuse_other_shapes() {
        let layout = Layout::of(&store()).unwrap();
        let flat = Tensor::arange(10, (Kind::Float, Device::Cpu));
        let views = layout.views(&flat).unwrap();
        assert_eq!(views[1].size(), [2, 3]);
        assert_eq!(views[1].data_ptr() as usize, flat.data_ptr() as usize + 16);
        let _ = flat.narrow(0, 4, 1).fill_(-1.0);
        assert_eq!(views[1].double_value(&[0, 0]), -1.0);
        assert!(layout.views(&flat.narrow(0, 0, 9)).is_err());
        assert!(layout.views(&flat.reshape([2, 5])).is_err());
        assert!(layout.views(&flat.to_kind(Kind::Double)).is_err());
    }

    #[test]
    fn the_digest_sees_names_and_shapes() {
        let a = Layout::of(&store()).unwrap().digest();
        assert_eq!(a, Layout::of(&store()).unwrap().digest());
        let vs = store();
        let _ = vs.root().var("c", &[1], Init::Const(0.0));
        assert_ne!(a, Layout::of(&vs).unwrap().digest());
    }
}
