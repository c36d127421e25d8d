//! The loss on batches the trainer does not learn from: fresh ones of its own stream, or a
//! held-out split's.
use super::Trainer;
use crate::error::Result;
use crate::expert::BlockGroups;
use crate::source::Source;
use crate::tensor::BlockComm;

impl Trainer {
    /// Mean loss over `batches` fresh batches without updating anything.
    pub fn eval_loss(&mut self, batches: usize) -> Result<f64> {
        let mut sum = 0.0;
        let mut groups = BlockGroups::new(self.tensor.as_ref(), self.experts.as_ref());
        let comm: &mut dyn BlockComm<f32> = &mut groups;
        for _ in 0..batches {
            self.source
                .next_batch(&mut self.inputs, &mut self.targets)?;
            self.drawn += 1;
            let (inputs, targets) = (&self.inputs, Some(&self.targets[..]));
            let loss = match &mut self.zero {
                Some(z) => z.forward(
                    &mut self.model,
                    &self.th,
                    &mut self.params,
                    (inputs, targets),
                    false,
                    comm,
                )?,
                None => self
                    .model
                    .forward_with(&self.th, &self.params, inputs, targets, comm)?,
            };
            sum += loss.unwrap_or(f64::NAN);
        }
        Ok(sum / batches.max(1) as f64)
    }

    /// [`Trainer::eval_loss`] over `batches` batches of `held_out` (a held-out split) instead
    /// of the training stream, whose position (and so the data cursor) is left as it was.
    pub fn eval_loss_on(&mut self, held_out: &mut Source, batches: usize) -> Result<f64> {
        std::mem::swap(&mut self.source, held_out);
        let drawn = self.drawn;
        let loss = self.eval_loss(batches);
        self.drawn = drawn;
        std::mem::swap(&mut self.source, held_out);
        loss
    }
}
