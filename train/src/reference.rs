//! The single-process data-parallel reference: the oracle a distributed job
//! must match bit for bit.

use crate::Error;
use crate::data::{DataSource, rank_range};
use crate::model::Model;
use crate::reduce::mean_in_rank_order;
use crate::replica::Replica;

/// Most ranks the reference simulates.
pub const MAX_REFERENCE_WORLD: usize = 4096;

/// Runs a world of simulated ranks in one process: each rank's
/// [`Replica::rank_gradients`] into its own buffer (every rank starts from
/// the same state, so one replica serves them all), the rank-order mean of
/// the buffers, one [`Replica::apply_mean`]. Holds the buffers between
/// steps.
#[derive(Debug, Default)]
pub struct Reference {
    parts: Vec<Vec<f32>>,
    mean: Vec<f32>,
}

impl Reference {
    /// A reference with no buffers yet.
    pub fn new() -> Reference {
        Reference::default()
    }

    /// One data-parallel step of `replica` in a world of `world` ranks.
    /// Returns the global batch's mean loss (the rank losses weighted by
    /// their share of the batch, summed in rank order in `f64`).
    pub fn step<M: Model, D: DataSource>(
        &mut self,
        replica: &mut Replica<M, D>,
        world: usize,
    ) -> Result<f64, Error> {
        if world == 0 || world > MAX_REFERENCE_WORLD {
            return Err(Error::Rank { rank: 0, world });
        }
        let len = replica.layout().len();
        self.parts.resize_with(world, Vec::new);
        self.parts.truncate(world);
        let global = replica.data().global_batch();
        let mut loss = 0.0;
        for (rank, part) in self.parts.iter_mut().enumerate() {
            part.resize(len, 0.0);
            let share = rank_range(global, rank, world)?.len() as f64 / global as f64;
            loss += share * replica.rank_gradients(rank, world, part)?;
        }
        self.mean.resize(len, 0.0);
        let parts: Vec<&[f32]> = self.parts.iter().map(Vec::as_slice).collect();
        mean_in_rank_order(&parts, &mut self.mean)?;
        replica.apply_mean(&self.mean)?;
        Ok(loss)
    }
}
