//! Running a contiguous range of units (a pipeline stage's chunk) in one [`Model`]: start the
//! forward at any unit with the residual received from the previous chunk, read the residual
//! to send on, start the backward at the chunk's last unit with the gradient received from the
//! next chunk, and read the gradient to send back (file 000 Algorithm 1 steps 2-5: activations
//! flow forward, their gradients flow back between neighbouring stages).
//!
//! A chunk `first..=last` runs as
//! `begin_at(first, ..)`, `forward_unit` for each unit, `unit_output(last)` (sent on),
//! later `begin_backward_at(last, ..)`, `backward_unit` for each unit in reverse, and
//! `input_grad()` (sent back). Every kernel is the one [`Model::forward`] and
//! [`Model::backward`] run, on the same buffers, so splitting the units over several models
//! gives bit-identical losses and gradients.
use crate::error::{ModelError, Result};
use crate::layout::Unit;
use crate::model::Model;
use crate::real::Real;

/// Position of `unit` in forward order: the embeddings 0, block `l` at `l + 1`, the head last.
fn order(unit: Unit, layers: usize) -> usize {
    match unit {
        Unit::Embed => 0,
        Unit::Block(l) => l + 1,
        Unit::Head => layers + 1,
    }
}

impl<T: Real> Model<T> {
    fn check_unit(&self, what: &'static str, unit: Unit) -> Result<()> {
        match unit {
            Unit::Block(l) if l >= self.cfg.layers => Err(ModelError::Config {
                field: what,
                value: format!("{unit:?}"),
                reason: format!("the model has {} blocks", self.cfg.layers),
            }),
            _ => Ok(()),
        }
    }

    /// Starts a forward at `first`, to be run unit by unit with [`Model::forward_unit`] from
    /// `first` on (a pipeline chunk). `first == Unit::Embed` needs `tokens` (B*T ids) and no
    /// `input`; otherwise `input` is the residual stream entering `first` (N, C), the previous
    /// chunk's [`Model::unit_output`], and `tokens` must be `None`. With `targets` (B*T ids),
    /// reaching the head computes the loss and makes the backward possible. Activations of
    /// units before `first` (an earlier chunk of the same micro-batch in this model) are kept.
    pub fn begin_at(
        &mut self,
        first: Unit,
        input: Option<&[T]>,
        tokens: Option<&[u32]>,
        targets: Option<&[u32]>,
    ) -> Result<()> {
        self.check_unit("first unit", first)?;
        let missing = |what: &'static str, reason: &str| ModelError::Config {
            field: what,
            value: "none".into(),
            reason: reason.into(),
        };
        let extra = |what: &'static str, reason: &str| ModelError::Config {
            field: what,
            value: "given".into(),
            reason: reason.into(),
        };
        match (first, input, tokens) {
            (Unit::Embed, None, Some(t)) => self.check_tokens("tokens", t)?,
            (Unit::Embed, None, None) => {
                return Err(missing(
                    "tokens",
                    "a forward from the embeddings needs tokens",
                ));
            }
            (Unit::Embed, Some(_), _) => {
                return Err(extra("input", "the embeddings take tokens, not a residual"));
            }
            (_, Some(x), None) => self.check_len(
                "input residual (rows*C)",
                x.len(),
                self.dims.rows * self.dims.c,
            )?,
            (_, None, _) => {
                return Err(missing(
                    "input",
                    "a forward from a block or the head needs the residual entering it",
                ));
            }
            (_, Some(_), Some(_)) => {
                return Err(extra(
                    "tokens",
                    "only a forward from the embeddings reads tokens",
                ));
            }
        }
        if let Some(t) = targets {
            self.check_tokens("targets", t)?;
        }
        match (first, input, tokens) {
            (Unit::Embed, _, Some(t)) => self.tokens.copy_from_slice(t),
            (Unit::Block(l), Some(x), _) => self.arena[self.acts.input(l)].copy_from_slice(x),
            (Unit::Head, Some(x), _) => {
                let last = self.acts.outs[self.cfg.layers - 1].clone();
                self.arena[last].copy_from_slice(x);
            }
            _ => unreachable!("checked above"),
        }
        self.loss = None;
        self.want_targets = targets.is_some();
        if let Some(t) = targets {
            self.targets.copy_from_slice(t);
        }
        self.next_fwd = Some(first);
        self.next_bwd = None;
        Ok(())
    }

    /// The output of `unit`'s last forward: the residual stream leaving the embeddings or
    /// block `l` (N, C), what a chunk ending there sends to the next; for the head, the logits
    /// (N, V).
    pub fn unit_output(&self, unit: Unit) -> Result<&[T]> {
        self.check_unit("unit", unit)?;
        Ok(match unit {
            Unit::Embed => &self.arena[self.acts.emb.clone()],
            Unit::Block(l) => &self.arena[self.acts.outs[l].clone()],
            Unit::Head => &self.arena[self.acts.logits.clone()],
        })
    }

    /// Starts the backward of a chunk ending at `last`, to be run with [`Model::backward_unit`]
    /// from `last` down. `last == Unit::Head` starts from the loss (`dout` must be `None`, and
    /// the forward must have reached the head with targets); for a block or the embeddings,
    /// `dout` is the gradient of the loss with respect to `last`'s output residual (N, C), the
    /// next chunk's [`Model::input_grad`]. The forward must have run past `last`.
    pub fn begin_backward_at(&mut self, last: Unit, dout: Option<&[T]>) -> Result<()> {
        self.check_unit("last unit", last)?;
        let layers = self.cfg.layers;
        let ran_past = match self.next_fwd {
            None => true,
            Some(next) => order(next, layers) > order(last, layers),
        };
        let refuse = |reason: String| ModelError::Config {
            field: "unit order",
            value: format!("backward from {last:?}"),
            reason,
        };
        match (last, dout) {
            (Unit::Head, None) => {
                if !(ran_past && self.want_targets && self.loss.is_some()) {
                    return Err(refuse(
                        "the backward from the head needs a complete forward with targets".into(),
                    ));
                }
            }
            (Unit::Head, Some(_)) => {
                return Err(refuse(
                    "the head's backward starts from the loss: no dout".into(),
                ));
            }
            (_, None) => {
                return Err(refuse(
                    "a backward from a block or the embeddings needs its output's gradient".into(),
                ));
            }
            (_, Some(g)) => {
                self.check_len(
                    "output gradient (rows*C)",
                    g.len(),
                    self.dims.rows * self.dims.c,
                )?;
                if !ran_past {
                    return Err(refuse(format!(
                        "the forward has not run {last:?} yet (next is {:?})",
                        self.next_fwd
                    )));
                }
                self.dresid.copy_from_slice(g);
            }
        }
        self.next_bwd = Some(last);
        Ok(())
    }

    /// The gradient of the loss with respect to the residual entering the last unit
    /// backwarded (N, C): after the backward of a chunk starting at a block, what it sends to
    /// the previous chunk. (After the embeddings' backward it is the gradient of the
    /// embedding output, which nothing consumes.)
    pub fn input_grad(&self) -> &[T] {
        &self.dresid
    }
}

#[cfg(test)]
mod tests {
    use crate::config::ModelConfig;
    use crate::init::init_params;
    use crate::layout::Unit;
    use crate::model::Model;
    use crate::threads::Threads;

    fn run_split(cfg: &ModelConfig, recompute: bool) {
        let th = Threads::new(1).unwrap();
        let (b, t) = (2, 16);
        let mut whole = Model::<f32>::new(cfg, b, t, recompute).unwrap();
        let mut params = vec![0f32; whole.n_params()];
        init_params(cfg, whole.layout(), 7, &mut params);
        let n = b * t;
        let tokens: Vec<u32> = (0..n).map(|i| (i * 7 % cfg.vocab) as u32).collect();
        let targets: Vec<u32> = (0..n)
            .map(|i| (i * 5 + 3) as u32 % cfg.vocab as u32)
            .collect();
        let loss = whole
            .forward(&th, &params, &tokens, Some(&targets))
            .unwrap();
        let mut g_whole = vec![0f32; params.len()];
        whole.backward(&th, &params, &mut g_whole).unwrap();

        let layers = cfg.layers;
        for k in 1..layers {
            // Stage A: Embed, blocks 0..k; stage B: blocks k..L, head.
            let mut a = Model::<f32>::new(cfg, b, t, recompute).unwrap();
            let mut bm = Model::<f32>::new(cfg, b, t, recompute).unwrap();
            let mut g = vec![0f32; params.len()];
            a.begin_at(Unit::Embed, None, Some(&tokens), None).unwrap();
            a.forward_unit(&th, &params, Unit::Embed).unwrap();
            for l in 0..k {
                a.forward_unit(&th, &params, Unit::Block(l)).unwrap();
            }
            let x = a.unit_output(Unit::Block(k - 1)).unwrap().to_vec();
            bm.begin_at(Unit::Block(k), Some(&x), None, Some(&targets))
                .unwrap();
            for l in k..layers {
                bm.forward_unit(&th, &params, Unit::Block(l)).unwrap();
            }
            bm.forward_unit(&th, &params, Unit::Head).unwrap();
            assert_eq!(bm.loss().map(f64::to_bits), loss.map(f64::to_bits));
            bm.begin_backward_at(Unit::Head, None).unwrap();
            bm.backward_unit(&th, &params, &mut g, Unit::Head).unwrap();
            for l in (k..layers).rev() {
                bm.backward_unit(&th, &params, &mut g, Unit::Block(l))
                    .unwrap();
            }
            let dx = bm.input_grad().to_vec();
            a.begin_backward_at(Unit::Block(k - 1), Some(&dx)).unwrap();
            for l in (0..k).rev() {
                a.backward_unit(&th, &params, &mut g, Unit::Block(l))
                    .unwrap();
            }
            a.backward_unit(&th, &params, &mut g, Unit::Embed).unwrap();
            let same = g
                .iter()
                .zip(&g_whole)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "split at {k} (recompute {recompute}): gradients differ"
            );
        }
    }

    #[test]
    fn split_forward_backward_is_bit_identical() {
        let mut cfg = ModelConfig::gpt2(3, 4, 32, 16, 48);
        run_split(&cfg, false);
        run_split(&cfg, true);
        cfg.tied_embeddings = false;
        run_split(&cfg, false);
    }

    #[test]
    fn bad_stage_calls_are_refused() {
        let cfg = ModelConfig::gpt2(2, 4, 32, 16, 48);
        let mut m = Model::<f32>::new(&cfg, 1, 8, false).unwrap();
        let x = vec![0f32; 8 * 32];
        assert!(m.begin_at(Unit::Block(2), Some(&x), None, None).is_err());
        assert!(m.begin_at(Unit::Block(1), None, None, None).is_err());
        assert!(
            m.begin_at(Unit::Block(1), Some(&x[1..]), None, None)
                .is_err()
        );
        assert!(m.begin_at(Unit::Embed, Some(&x), None, None).is_err());
        m.begin_at(Unit::Block(1), Some(&x), None, None).unwrap();
        // The forward has not run block 1 yet.
        assert!(m.begin_backward_at(Unit::Block(1), Some(&x)).is_err());
        // No targets: no backward from the head.
        assert!(m.begin_backward_at(Unit::Head, None).is_err());
        assert!(m.unit_output(Unit::Block(5)).is_err());
    }
}
