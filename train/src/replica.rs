//! `Replica`: one copy of the model with its data source, optimizer and
//! step counter, and the two halves of a data-parallel step around the
//! all-reduce.

use tch::Tensor;
use tch::nn::VarStore;

use crate::Error;
use crate::data::{Batch, DataSource, loss_scale};
use crate::layout::Layout;
use crate::model::Model;
use crate::optim::{Optimizer, OptimizerConfig};
use crate::state::TrainState;

/// A model in its `VarStore`, its data source, its optimizer and the number
/// of steps done.
///
/// A data-parallel step of rank `r` in a world of `w` is
/// [`rank_gradients`](Self::rank_gradients) into a flat buffer, the
/// all-reduce of the buffers (the rank-order mean of [`crate::reduce`]), then
/// [`apply_mean`](Self::apply_mean). Every replica that starts from the same
/// state and applies the same mean ends in the same state, bit for bit.
pub struct Replica<M, D> {
    vs: VarStore,
    model: M,
    data: D,
    layout: Layout,
    optimizer: Box<dyn Optimizer>,
    step: u64,
}

impl<M: std::fmt::Debug, D: std::fmt::Debug> std::fmt::Debug for Replica<M, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("model", &self.model)
            .field("data", &self.data)
            .field("parameters", &self.layout.len())
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl<M: Model, D: DataSource> Replica<M, D> {
    /// A replica at step 0 of `model` (whose variables are in `vs`), with a
    /// built-in optimizer whose state is added to `vs`.
    pub fn new(
        vs: VarStore,
        model: M,
        data: D,
        optimizer: &OptimizerConfig,
    ) -> Result<Self, Error> {
        Self::with_optimizer(vs, model, data, |vs, layout| optimizer.build(vs, layout))
    }

    /// A replica with an optimizer of the caller's, built over the layout
    /// (it must keep its state in `vs` for resume and heal to carry it).
    pub fn with_optimizer(
        vs: VarStore,
        model: M,
        data: D,
        build: impl FnOnce(&VarStore, &Layout) -> Result<Box<dyn Optimizer>, Error>,
    ) -> Result<Self, Error> {
        if let Some(name) = vs
            .variables()
            .into_keys()
            .find(|n| n.starts_with("optim.") || n.starts_with("train."))
        {
            return Err(Error::ReservedName(name));
        }
        let layout = Layout::of(&vs)?;
        let optimizer = build(&vs, &layout)?;
        Ok(Replica {
            vs,
            model,
            data,
            layout,
            optimizer,
            step: 0,
        })
    }

    /// Steps done (the next step to run).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The gradient layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The data source.
    pub fn data(&self) -> &D {
        &self.data
    }

    /// The variable store (parameters and optimizer state).
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// The step after this one (a restored state may carry any `u64`).
    fn next_step(&self) -> Result<u64, Error> {
        self.step
            .checked_add(1)
            .ok_or_else(|| Error::State("the step counter is at u64::MAX".into()))
    }

    fn gradients(&self, batch: &Batch, scale: f64) -> Result<(f64, Vec<Tensor>), Error> {
        let loss = self.model.loss(batch)?;
        let value = loss.f_double_value(&[])?;
        let root = if scale == 1.0 {
            loss
        } else {
            loss.f_mul_scalar(scale)?
        };
        let grads = Tensor::f_run_backward(&[&root], self.layout.params(), false, false)?;
        Ok((value, grads))
    }

    /// Rank `rank`'s half of the current step in a world of `world`: the
    /// forward and backward pass on its batch (the samples
    /// [`rank_range`](crate::rank_range) names), its gradient, scaled by
    /// [`loss_scale`], written into `out` in layout order. Returns the rank
    /// batch's mean loss (unscaled). Changes nothing in the replica.
    pub fn rank_gradients(&self, rank: usize, world: usize, out: &mut [f32]) -> Result<f64, Error> {
        let scale = loss_scale(self.data.global_batch(), rank, world)?;
        let batch = self.data.batch(self.step, rank, world)?;
        let (loss, grads) = self.gradients(&batch, scale)?;
        self.layout.gather(&grads, out)?;
        Ok(loss)
    }

    /// The second half of a step: one optimizer update from the world's mean
    /// gradient (flat, layout order), then the step counter advances.
    pub fn apply_mean(&mut self, mean: &[f32]) -> Result<(), Error> {
        let grads = self.layout.unflatten(mean)?;
        self.apply(&grads)
    }

    /// [`Self::apply_mean`] from a flat `f32` tensor of the layout's length,
    /// without copying it: the optimizer reads views of it (a gradient
    /// buffer in registered memory that a collective reduced in place).
    /// The same update, bit for bit.
    pub fn apply_mean_tensor(&mut self, mean: &Tensor) -> Result<(), Error> {
        let grads = self.layout.views(mean)?;
        self.apply(&grads)
    }

    /// One optimizer update from per-variable gradients, then the step
    /// counter advances.
    fn apply(&mut self, grads: &[Tensor]) -> Result<(), Error> {
        let next = self.next_step()?;
        self.optimizer.step(grads)?;
        self.step = next;
        Ok(())
    }

    /// Drops the current step: its batch is skipped and the step counter
    /// advances; nothing else changes (no optimizer update, no optimizer
    /// state). A job skips a step whose mean gradient is not finite this
    /// way, on every rank and in the reference alike.
    pub fn skip_step(&mut self) -> Result<(), Error> {
        self.step = self.next_step()?;
        Ok(())
    }

    /// One step of one process on the whole global batch (the baseline a
    /// data-parallel job is compared with): forward and backward on the
    /// global batch, the optimizer update from its gradient. Bit for bit
    /// the same as a world of one. Returns the batch's mean loss.
    pub fn local_step(&mut self) -> Result<f64, Error> {
        let next = self.next_step()?;
        let batch = self.data.batch(self.step, 0, 1)?;
        let (loss, grads) = self.gradients(&batch, 1.0)?;
        self.optimizer.step(&grads)?;
        self.step = next;
        Ok(loss)
    }

    /// The mean loss on `batch`, without gradients.
    pub fn evaluate(&self, batch: &Batch) -> Result<f64, Error> {
        tch::no_grad(|| Ok(self.model.loss(batch)?.f_double_value(&[])?))
    }

    /// A copy of the training state at this step boundary.
    pub fn state(&self) -> Result<TrainState, Error> {
        TrainState::capture(&self.vs, self.step, self.data.seed())
    }

    /// Loads `state` (a checkpoint's, or a live peer's) into this replica's
    /// variables in place and takes its step. The state's data seed must be
    /// this data source's, and it must name exactly this store's variables
    /// with their shapes; on error nothing changes.
    pub fn restore(&mut self, state: &TrainState) -> Result<(), Error> {
        if state.data_seed != self.data.seed() {
            return Err(Error::State(format!(
                "the state's data seed is {}, this source's {}",
                state.data_seed,
                self.data.seed()
            )));
        }
        state.load_into(&self.vs)?;
        self.step = state.step;
        Ok(())
    }
}
