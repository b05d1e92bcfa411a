//! The built-in character-level transformer: a small GPT (token and
//! position embeddings, pre-norm blocks of causal self-attention and a GELU
//! MLP, a final layer norm, a head tied to the token embedding or its own).

use tch::nn::Path;
use tch::{Kind, Tensor};

use crate::Error;
use crate::data::Batch;
use crate::model::{Model, const_var, cross_entropy, dim, linear, uniform_var};

/// Largest width, context, vocabulary a configuration may ask for.
pub const MAX_GPT_DIM: usize = 1 << 14;
/// Most blocks.
pub const MAX_GPT_LAYERS: usize = 64;

/// The transformer's shape. The default has 409,472 parameters with the
/// generated corpus's 35-character vocabulary (`CharGpt::parameters`).
#[derive(Debug, Clone, PartialEq)]
pub struct GptConfig {
    /// Tokens in the vocabulary. Default 64.
    pub vocab: usize,
    /// Longest input, in tokens. Default 64.
    pub context: usize,
    /// Embedding width; a multiple of `heads`. Default 128.
    pub width: usize,
    /// Attention heads. Default 4.
    pub heads: usize,
    /// Blocks. Default 2.
    pub layers: usize,
    /// Logits through the token embedding (true) or a head of its own.
    /// Default true.
    pub tied_head: bool,
    /// Seed of the initial weights. Default 0.
    pub init_seed: u64,
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig {
            vocab: 64,
            context: 64,
            width: 128,
            heads: 4,
            layers: 2,
            tied_head: true,
            init_seed: 0,
        }
    }
}

#[derive(Debug)]
struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    fn new(path: &Path<'_>, width: i64) -> Result<Norm, Error> {
        Ok(Norm {
            weight: const_var(path, "weight", &[width], 1.0)?,
            bias: const_var(path, "bias", &[width], 0.0)?,
        })
    }

    fn forward(&self, x: &Tensor, width: i64) -> Result<Tensor, Error> {
        Ok(x.f_layer_norm([width], Some(&self.weight), Some(&self.bias), 1e-5, false)?)
    }
}

#[derive(Debug)]
struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    /// Weight uniform with standard deviation `std`, bias zero.
    fn new(path: &Path<'_>, out: i64, inp: i64, std: f32, seed: u64) -> Result<Dense, Error> {
        Ok(Dense {
            weight: uniform_var(path, "weight", &[out, inp], std * 3f32.sqrt(), seed)?,
            bias: const_var(path, "bias", &[out], 0.0)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, Error> {
        linear(x, &self.weight, &self.bias)
    }
}

#[derive(Debug)]
struct Block {
    ln1: Norm,
    qkv: Dense,
    proj: Dense,
    ln2: Norm,
    fc: Dense,
    fc_proj: Dense,
}

/// A GPT-style character-level language model. Variables: `tok_emb`
/// `[vocab, width]`, `pos_emb` `[context, width]`, per block `i`
/// `blocks.i.{ln1,ln2}.{weight,bias}`, `blocks.i.attn.{qkv,proj}.{weight,bias}`,
/// `blocks.i.mlp.{fc,proj}.{weight,bias}`, then `ln_f.{weight,bias}` and,
/// untied, `head.weight`. Initialisation as GPT-2: weights of standard
/// deviation 0.02 (uniform), residual projections scaled by
/// `1/sqrt(2 * layers)`, biases zero, norms one.
#[derive(Debug)]
pub struct CharGpt {
    tok_emb: Tensor,
    pos_emb: Tensor,
    blocks: Vec<Block>,
    ln_f: Norm,
    head: Option<Tensor>,
    /// `mask[i][j]` is true where position `i` must not see `j > i`.
    mask: Tensor,
    vocab: i64,
    context: i64,
    width: i64,
    heads: i64,
}

impl CharGpt {
    /// Creates the variables under `path`.
    pub fn new(path: &Path<'_>, config: &GptConfig) -> Result<CharGpt, Error> {
        let vocab = dim(config.vocab, MAX_GPT_DIM, "gpt vocab")?;
        let context = dim(config.context, MAX_GPT_DIM, "gpt context")?;
        let width = dim(config.width, MAX_GPT_DIM, "gpt width")?;
        let heads = dim(config.heads, MAX_GPT_DIM, "gpt heads")?;
        let layers = dim(config.layers, MAX_GPT_LAYERS, "gpt layers")?;
        if width % heads != 0 {
            return Err(Error::Config(format!(
                "gpt width {width} is not a multiple of heads {heads}"
            )));
        }
        let seed = config.init_seed;
        let std = 0.02f32;
        let residual_std = std / (2.0 * layers as f32).sqrt();
        let bound = std * 3f32.sqrt();
        let tok_emb = uniform_var(path, "tok_emb", &[vocab, width], bound, seed)?;
        let pos_emb = uniform_var(path, "pos_emb", &[context, width], bound, seed)?;
        let blocks_path = path.sub("blocks");
        let mut blocks = Vec::with_capacity(layers as usize);
        for i in 0..layers {
            let p = blocks_path.sub(i);
            let attn = p.sub("attn");
            let mlp = p.sub("mlp");
            blocks.push(Block {
                ln1: Norm::new(&p.sub("ln1"), width)?,
                qkv: Dense::new(&attn.sub("qkv"), 3 * width, width, std, seed)?,
                proj: Dense::new(&attn.sub("proj"), width, width, residual_std, seed)?,
                ln2: Norm::new(&p.sub("ln2"), width)?,
                fc: Dense::new(&mlp.sub("fc"), 4 * width, width, std, seed)?,
                fc_proj: Dense::new(&mlp.sub("proj"), width, 4 * width, residual_std, seed)?,
            });
        }
        let ln_f = Norm::new(&path.sub("ln_f"), width)?;
        let head = if config.tied_head {
            None
        } else {
            Some(uniform_var(
                &path.sub("head"),
                "weight",
                &[vocab, width],
                bound,
                seed,
            )?)
        };
        let mask = Tensor::f_ones([context, context], (Kind::Bool, path.device()))?.f_triu(1)?;
        Ok(CharGpt {
            tok_emb,
            pos_emb,
            blocks,
            ln_f,
            head,
            mask,
            vocab,
            context,
            width,
            heads,
        })
    }

    fn attention(&self, b: &Block, x: &Tensor, n: i64, t: i64) -> Result<Tensor, Error> {
        let (c, h) = (self.width, self.heads);
        let d = c / h;
        let qkv = b.qkv.forward(x)?;
        let parts = qkv.f_split(c, -1)?;
        let heads = |x: &Tensor| -> Result<Tensor, Error> {
            Ok(x.f_view([n, t, h, d])?.f_transpose(1, 2)?)
        };
        let (q, k, v) = (heads(&parts[0])?, heads(&parts[1])?, heads(&parts[2])?);
        let scores = q
            .f_matmul(&k.f_transpose(-2, -1)?)?
            .f_mul_scalar(1.0 / (d as f64).sqrt())?;
        let mask = self.mask.f_narrow(0, 0, t)?.f_narrow(1, 0, t)?;
        let att = scores
            .f_masked_fill(&mask, f64::NEG_INFINITY)?
            .f_softmax(-1, Kind::Float)?;
        let y = att
            .f_matmul(&v)?
            .f_transpose(1, 2)?
            .f_contiguous()?
            .f_view([n, t, c])?;
        b.proj.forward(&y)
    }

    /// Parameters (trainable elements).
    pub fn parameters(config: &GptConfig) -> usize {
        let (v, t, c, l) = (config.vocab, config.context, config.width, config.layers);
        let block =
            2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c);
        v * c + t * c + l * block + 2 * c + if config.tied_head { 0 } else { v * c }
    }
}

impl Model for CharGpt {
    fn forward(&self, inputs: &Tensor) -> Result<Tensor, Error> {
        let size = inputs.size();
        if inputs.f_kind()? != Kind::Int64
            || size.len() != 2
            || !(1..=self.context).contains(&size[1])
        {
            return Err(Error::Batch(format!(
                "gpt inputs must be i64 [n, 1..={}], are {:?} {size:?}",
                self.context,
                inputs.kind()
            )));
        }
        let (n, t) = (size[0], size[1]);
        let tok = Tensor::f_embedding(&self.tok_emb, inputs, -1, false, false)?;
        let mut x = tok.f_add(&self.pos_emb.f_narrow(0, 0, t)?)?;
        for b in &self.blocks {
            x = x.f_add(&self.attention(b, &b.ln1.forward(&x, self.width)?, n, t)?)?;
            let h =
                b.fc.forward(&b.ln2.forward(&x, self.width)?)?
                    .f_gelu("none")?;
            x = x.f_add(&b.fc_proj.forward(&h)?)?;
        }
        let x = self.ln_f.forward(&x, self.width)?;
        Ok(match &self.head {
            Some(w) => x.f_matmul(&w.f_tr()?)?,
            None => x.f_matmul(&self.tok_emb.f_tr()?)?,
        })
    }

    fn loss(&self, batch: &Batch) -> Result<Tensor, Error> {
        let size = batch.inputs.size();
        if batch.targets.f_kind()? != Kind::Int64 || batch.targets.size() != size {
            return Err(Error::Batch(format!(
                "gpt targets must be i64 shaped like the inputs {size:?}, are {:?} {:?}",
                batch.targets.kind(),
                batch.targets.size()
            )));
        }
        let logits = self.forward(&batch.inputs)?;
        cross_entropy(
            &logits.f_view([-1, self.vocab])?,
            &batch.targets.f_view([-1])?,
        )
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;
    use tch::nn::VarStore;

    use super::*;
    use crate::layout::Layout;

    fn small(tied: bool) -> GptConfig {
        GptConfig {
            vocab: 11,
            context: 8,
            width: 16,
            heads: 2,
            layers: 2,
            tied_head: tied,
            init_seed: 3,
        }
    }

    #[test]
    fn parameter_counts_match_the_store() {
        for config in [
            small(true),
            small(false),
            GptConfig {
                vocab: 35,
                ..GptConfig::default()
            },
        ] {
            let vs = VarStore::new(Device::Cpu);
            CharGpt::new(&vs.root(), &config).unwrap();
            assert_eq!(
                Layout::of(&vs).unwrap().len(),
                CharGpt::parameters(&config),
                "{config:?}"
            );
        }
        // The documented size of the default.
        let default = GptConfig {
            vocab: 35,
            ..GptConfig::default()
        };
        assert_eq!(CharGpt::parameters(&default), 409_472);
    }

    #[test]
    fn attention_is_causal() {
        let vs = VarStore::new(Device::Cpu);
        let m = CharGpt::new(&vs.root(), &small(true)).unwrap();
        let a = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8]).view([1, 8]);
        let b = Tensor::from_slice(&[1i64, 2, 3, 4, 9, 9, 9, 9]).view([1, 8]);
        let (la, lb) = (m.forward(&a).unwrap(), m.forward(&b).unwrap());
        assert_eq!(la.size(), [1, 8, 11]);
        // The first four positions cannot see the changed ones...
        assert!(la.narrow(1, 0, 4).equal(&lb.narrow(1, 0, 4)));
        // ...and the later ones do.
        assert!(!la.narrow(1, 4, 4).equal(&lb.narrow(1, 4, 4)));
        // A shorter input is the prefix.
        let prefix = m.forward(&a.narrow(1, 0, 5)).unwrap();
        assert!(prefix.allclose(&la.narrow(1, 0, 5), 1e-6, 1e-6, false));
    }

    #[test]
    fn bad_inputs_and_configurations_are_errors() {
        let vs = VarStore::new(Device::Cpu);
        let m = CharGpt::new(&vs.root(), &small(false)).unwrap();
        let long = Tensor::zeros([1, 9], (Kind::Int64, Device::Cpu));
        assert!(matches!(m.forward(&long), Err(Error::Batch(_))));
        let float = Tensor::zeros([1, 4], (Kind::Float, Device::Cpu));
        assert!(matches!(m.forward(&float), Err(Error::Batch(_))));
        let unknown = Tensor::from_slice(&[11i64]).view([1, 1]);
        assert!(matches!(m.forward(&unknown), Err(Error::Torch(_))));
        let batch = Batch {
            inputs: Tensor::zeros([2, 4], (Kind::Int64, Device::Cpu)),
            targets: Tensor::zeros([2, 3], (Kind::Int64, Device::Cpu)),
        };
        assert!(matches!(m.loss(&batch), Err(Error::Batch(_))));
        let vs = VarStore::new(Device::Cpu);
        assert!(
            CharGpt::new(
                &vs.root(),
                &GptConfig {
                    width: 15,
                    ..small(true)
                }
            )
            .is_err()
        );
        assert!(
            CharGpt::new(
                &vs.root(),
                &GptConfig {
                    layers: 0,
                    ..small(true)
                }
            )
            .is_err()
        );
    }
}
