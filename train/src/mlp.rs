//! The built-in MLP and its synthetic data: a classifier of points drawn
//! around seeded class centres (a Gaussian-like mixture).

use std::ops::Range;

use tch::nn::Path;
use tch::{Kind, Tensor};

use crate::Error;
use crate::data::{Batch, DataSource, MAX_GLOBAL_BATCH, check_elements};
use crate::model::{Model, cross_entropy, dim, linear, uniform_var};
use crate::rng::Rng;

/// Largest dimension (features, hidden width, classes) a configuration may
/// ask for.
pub const MAX_MLP_DIM: usize = 1 << 16;
/// Most hidden layers.
pub const MAX_MLP_LAYERS: usize = 64;

/// The MLP's shape. The default has 1,837,312 parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct MlpConfig {
    /// Input features. Default 512.
    pub input: usize,
    /// Widths of the hidden layers (ReLU after each). Default `[1024, 1024]`.
    pub hidden: Vec<usize>,
    /// Output classes. Default 256.
    pub classes: usize,
    /// Seed of the initial weights. Default 0.
    pub init_seed: u64,
}

impl Default for MlpConfig {
    fn default() -> Self {
        MlpConfig {
            input: 512,
            hidden: vec![1024, 1024],
            classes: 256,
            init_seed: 0,
        }
    }
}

/// A multi-layer perceptron classifier: `layers.<i>.weight` `[out, in]` and
/// `layers.<i>.bias` `[out]`, initialised like PyTorch's `nn.Linear`
/// (uniform in `±1/sqrt(in)`) from the configuration's seed.
#[derive(Debug)]
pub struct Mlp {
    layers: Vec<(Tensor, Tensor)>,
    input: i64,
}

impl Mlp {
    /// Creates the variables under `path`.
    pub fn new(path: &Path<'_>, config: &MlpConfig) -> Result<Mlp, Error> {
        if config.hidden.len() > MAX_MLP_LAYERS {
            return Err(Error::Config(format!(
                "at most {MAX_MLP_LAYERS} hidden layers"
            )));
        }
        let mut widths = vec![dim(config.input, MAX_MLP_DIM, "mlp input")?];
        for &h in &config.hidden {
            widths.push(dim(h, MAX_MLP_DIM, "mlp hidden width")?);
        }
        widths.push(dim(config.classes, MAX_MLP_DIM, "mlp classes")?);
        let layers_path = path.sub("layers");
        let mut layers = Vec::with_capacity(widths.len() - 1);
        for (i, w) in widths.windows(2).enumerate() {
            let p = layers_path.sub(i);
            let bound = 1.0 / (w[0] as f32).sqrt();
            let weight = uniform_var(&p, "weight", &[w[1], w[0]], bound, config.init_seed)?;
            let bias = uniform_var(&p, "bias", &[w[1]], bound, config.init_seed)?;
            layers.push((weight, bias));
        }
        Ok(Mlp {
            layers,
            input: widths[0],
        })
    }
}

impl Model for Mlp {
    fn forward(&self, inputs: &Tensor) -> Result<Tensor, Error> {
        let size = inputs.size();
        if inputs.f_kind()? != Kind::Float || size.len() != 2 || size[1] != self.input {
            return Err(Error::Batch(format!(
                "mlp inputs must be f32 [n, {}], are {:?} {size:?}",
                self.input,
                inputs.kind()
            )));
        }
        let mut x = inputs.shallow_clone();
        for (i, (w, b)) in self.layers.iter().enumerate() {
            x = linear(&x, w, b)?;
            if i + 1 < self.layers.len() {
                x = x.f_relu()?;
            }
        }
        Ok(x)
    }

    fn loss(&self, batch: &Batch) -> Result<Tensor, Error> {
        let n = batch.len() as i64;
        if batch.targets.f_kind()? != Kind::Int64 || batch.targets.size() != [n] {
            return Err(Error::Batch(format!(
                "mlp targets must be i64 [{n}], are {:?} {:?}",
                batch.targets.kind(),
                batch.targets.size()
            )));
        }
        cross_entropy(&self.forward(&batch.inputs)?, &batch.targets)
    }
}

/// The synthetic classification data of [`Blobs`].
#[derive(Debug, Clone, PartialEq)]
pub struct BlobsConfig {
    /// Features per sample. Default 512 (the default MLP's input).
    pub input: usize,
    /// Classes. Default 256 (the default MLP's classes).
    pub classes: usize,
    /// Samples per global batch. Default 64.
    pub global_batch: usize,
    /// Standard deviation of the noise around a class centre (the centres'
    /// coordinates have standard deviation 1). Default 3.
    pub noise: f32,
    /// Seed of the centres and samples. Default 1.
    pub seed: u64,
}

impl Default for BlobsConfig {
    fn default() -> Self {
        BlobsConfig {
            input: 512,
            classes: 256,
            global_batch: 64,
            noise: 3.0,
            seed: 1,
        }
    }
}

const CENTRES: u64 = 0;
const SAMPLES: u64 = 1;

/// Points around seeded class centres: sample `j` of step `s` draws its
/// class uniformly and its features as centre + noise, all from the stream
/// of `(seed, s, j)`. Targets are the class indices (`i64`).
#[derive(Debug)]
pub struct Blobs {
    config: BlobsConfig,
    centres: Vec<f32>,
}

impl Blobs {
    /// The source of `config` (its centres are drawn now).
    pub fn new(config: BlobsConfig) -> Result<Blobs, Error> {
        dim(config.input, MAX_MLP_DIM, "blobs input")?;
        dim(config.classes, MAX_MLP_DIM, "blobs classes")?;
        dim(config.global_batch, MAX_GLOBAL_BATCH, "global batch")?;
        check_elements(config.input, config.classes, "blobs centres")?;
        check_elements(config.input, config.global_batch, "blobs batch")?;
        if !(config.noise.is_finite() && config.noise >= 0.0) {
            return Err(Error::Config("blobs noise must be finite and >= 0".into()));
        }
        let mut rng = Rng::keyed(config.seed, &[CENTRES]);
        let centres = (0..config.input * config.classes)
            .map(|_| rng.normal())
            .collect();
        Ok(Blobs { config, centres })
    }

    /// The configuration.
    pub fn config(&self) -> &BlobsConfig {
        &self.config
    }
}

impl DataSource for Blobs {
    fn global_batch(&self) -> usize {
        self.config.global_batch
    }

    fn seed(&self) -> u64 {
        self.config.seed
    }

    fn samples(&self, step: u64, range: Range<usize>) -> Result<Batch, Error> {
        if range.end > self.config.global_batch || range.start > range.end {
            return Err(Error::Batch(format!(
                "samples {range:?} of a global batch of {}",
                self.config.global_batch
            )));
        }
        let d = self.config.input;
        let mut inputs = Vec::with_capacity(range.len() * d);
        let mut targets = Vec::with_capacity(range.len());
        for j in range.clone() {
            let mut rng = Rng::keyed(self.config.seed, &[SAMPLES, step, j as u64]);
            let class = rng.below(self.config.classes as u64) as usize;
            let centre = &self.centres[class * d..(class + 1) * d];
            inputs.extend(centre.iter().map(|&c| c + self.config.noise * rng.normal()));
            targets.push(class as i64);
        }
        Ok(Batch {
            inputs: Tensor::f_from_slice(&inputs)?.f_reshape([range.len() as i64, d as i64])?,
            targets: Tensor::f_from_slice(&targets)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;
    use tch::nn::VarStore;

    use super::*;
    use crate::data::testing::{bits, check_rank_batches_concatenate};
    use crate::layout::Layout;

    #[test]
    fn the_default_has_its_documented_size() {
        let vs = VarStore::new(Device::Cpu);
        Mlp::new(&vs.root(), &MlpConfig::default()).unwrap();
        assert_eq!(Layout::of(&vs).unwrap().len(), 1_837_312);
    }

    #[test]
    fn initial_weights_are_a_function_of_the_seed() {
        let small = MlpConfig {
            input: 4,
            hidden: vec![8],
            classes: 3,
            init_seed: 5,
        };
        let weights = |c: &MlpConfig| {
            let vs = VarStore::new(Device::Cpu);
            let m = Mlp::new(&vs.root(), c).unwrap();
            bits(&m.layers[0].0)
        };
        assert_eq!(weights(&small), weights(&small));
        assert_ne!(
            weights(&small),
            weights(&MlpConfig {
                init_seed: 6,
                ..small.clone()
            })
        );
        // libtorch's generator plays no part.
        tch::manual_seed(1);
        let a = weights(&small);
        tch::manual_seed(2);
        assert_eq!(a, weights(&small));
    }

    #[test]
    fn rank_batches_concatenate_to_the_global_batch() {
        let data = Blobs::new(BlobsConfig {
            input: 8,
            classes: 5,
            global_batch: 13,
            ..BlobsConfig::default()
        })
        .unwrap();
        check_rank_batches_concatenate(&data, 13);
    }

    #[test]
    fn bad_batches_and_configurations_are_errors() {
        let vs = VarStore::new(Device::Cpu);
        let m = Mlp::new(
            &vs.root(),
            &MlpConfig {
                input: 4,
                hidden: vec![8],
                classes: 3,
                init_seed: 0,
            },
        )
        .unwrap();
        let good = Batch {
            inputs: Tensor::zeros([2, 4], (Kind::Float, Device::Cpu)),
            targets: Tensor::from_slice(&[0i64, 2]),
        };
        assert_eq!(m.loss(&good).unwrap().size(), Vec::<i64>::new());
        let wide = Batch {
            inputs: Tensor::zeros([2, 5], (Kind::Float, Device::Cpu)),
            targets: Tensor::from_slice(&[0i64, 2]),
        };
        assert!(matches!(m.loss(&wide), Err(Error::Batch(_))));
        let short = Batch {
            inputs: Tensor::zeros([2, 4], (Kind::Float, Device::Cpu)),
            targets: Tensor::from_slice(&[0i64]),
        };
        assert!(matches!(m.loss(&short), Err(Error::Batch(_))));
        let out_of_range = Batch {
            inputs: Tensor::zeros([2, 4], (Kind::Float, Device::Cpu)),
            targets: Tensor::from_slice(&[0i64, 3]),
        };
        assert!(matches!(m.loss(&out_of_range), Err(Error::Torch(_))));
        assert!(
            Mlp::new(
                &vs.root(),
                &MlpConfig {
                    input: 0,
                    ..MlpConfig::default()
                }
            )
            .is_err()
        );
        assert!(
            Blobs::new(BlobsConfig {
                noise: f32::INFINITY,
                ..BlobsConfig::default()
            })
            .is_err()
        );
        assert!(
            Blobs::new(BlobsConfig {
                global_batch: 0,
                ..BlobsConfig::default()
            })
            .is_err()
        );
        // Each dimension is in range, their product is not.
        let huge = BlobsConfig {
            input: MAX_MLP_DIM,
            classes: MAX_MLP_DIM,
            ..BlobsConfig::default()
        };
        assert!(matches!(Blobs::new(huge), Err(Error::Config(_))));
    }
}
