//! The whole decoder: embedding, blocks, final norm, LM head and loss,
//! over one flat parameter buffer and one activation arena.
//!
//! The arena is sized once per config and batch ([`ActLayout`]). With
//! recomputation, each block keeps only its output and the block's other
//! activations are rebuilt, one block at a time, during the backward.
use crate::block::{Alone, Block, BlockActs, BlockComm, BlockScratch, Dims};
use crate::config::{ModelConfig, Positions};
use crate::error::{ModelError, Result};
use crate::kernels::loss::{cross_entropy_fwd, mean_loss};
use crate::kernels::rope::RopeTable;
use crate::layout::{Layout, Unit};
use crate::moe::{Experts, Objective};
use crate::profile::timed;
use crate::real::Real;
use crate::threads::Threads;
use std::ops::Range;

mod ends;

/// Where each activation lives in the arena.
#[derive(Clone, Debug)]
pub struct ActLayout {
    /// Embedding output = the first block's input (N, C).
    pub emb: Range<usize>,
    /// Each block's output (N, C).
    pub outs: Vec<Range<usize>>,
    /// Each block's saved activations; the recomputed blocks all share one
    /// region.
    pub inner: Vec<Range<usize>>,
    /// Final norm output (rows, C), mean (rows), rstd (rows).
    pub lnf: Range<usize>,
    /// Under sequence parallelism, the final norm's output gathered from every rank (N, C),
    /// the head's input; empty otherwise.
    pub lnf_wide: Range<usize>,
    /// Logits (N, V); after the backward they hold the logits' gradient.
    pub logits: Range<usize>,
    /// Per-row loss (N) and log-sum-exp (N).
    pub losses: Range<usize>,
    /// Total elements.
    pub total: usize,
}

/// Checks that `ids` holds exactly `n` token ids, each below `vocab`: the check every model
/// (this one, the tensor-parallel and the expert-parallel decoders) makes of its inputs.
///
/// # Errors
/// [`ModelError::Shape`] for the wrong count, [`ModelError::Token`] naming the first id
/// outside the vocabulary and its position.
pub fn check_token_ids(what: &'static str, ids: &[u32], n: usize, vocab: usize) -> Result<()> {
    if ids.len() != n {
        return Err(ModelError::Shape {
            what,
            expected: n,
            got: ids.len(),
        });
    }
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(pos) => Err(ModelError::Token {
            what,
            id: ids[pos],
            pos,
            vocab,
        }),
        None => Ok(()),
    }
}

impl ActLayout {
    /// The arena layout for blocks of dims `d`; `recompute[l]` says whether
    /// block `l` keeps only its output.
    pub fn new(d: &Dims, recompute: &[bool]) -> Self {
        let layers = recompute.len();
        let mut at = 0;
        let mut take = |len: usize| {
            let r = at..at + len;
            at += len;
            r
        };
        // The residual stream (embedding output, block outputs) on this rank's rows.
        let nc = d.rows * d.c;
        let emb = take(nc);
        let mut outs = Vec::with_capacity(layers);
        let mut inner = Vec::with_capacity(layers);
        let shared = recompute
            .iter()
            .any(|&r| r)
            .then(|| take(d.block_acts_len()));
        for &r in recompute {
            outs.push(take(nc));
            inner.push(match (&shared, r) {
                (Some(s), true) => s.clone(),
                _ => take(d.block_acts_len()),
            });
        }
        let lnf = take(nc + 2 * d.rows);
        let lnf_wide = take(if d.sequence_split() { d.n * d.c } else { 0 });
        let logits = take(d.n * d.v);
        let losses = take(2 * d.n);
        Self {
            emb,
            outs,
            inner,
            lnf,
            lnf_wide,
            logits,
            losses,
            total: at,
        }
    }

    /// The input range of block `l`.
    pub fn input(&self, l: usize) -> Range<usize> {
        if l == 0 {
            self.emb.clone()
        } else {
            self.outs[l - 1].clone()
        }
    }
}

/// A decoder sized for one batch shape, holding its activation arena.
pub struct Model<T: Real> {
    pub(crate) cfg: ModelConfig,
    layout: Layout,
    pub(crate) dims: Dims,
    block: Block,
    rope: Option<RopeTable<T>>,
    recompute: Vec<bool>,
    pub(crate) acts: ActLayout,
    pub(crate) arena: Vec<T>,
    scratch: Vec<T>,
    pub(crate) dresid: Vec<T>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) targets: Vec<u32>,
    /// Whether the forward in progress has targets.
    pub(crate) want_targets: bool,
    /// The loss of the last forward with targets.
    pub(crate) loss: Option<f64>,
    /// The next unit of the forward and of the backward in progress.
    pub(crate) next_fwd: Option<Unit>,
    pub(crate) next_bwd: Option<Unit>,
    /// Each block's experts with their activations (empty for a dense model).
    experts: Vec<Experts<T>>,
}

impl<T: Real> Model<T> {
    /// A model for `cfg` running batches of `batch` sequences of `seq_len`
    /// tokens (at most `cfg.seq_len`). `recompute` trades a second block
    /// forward in the backward for keeping only block outputs, in every block.
    pub fn new(cfg: &ModelConfig, batch: usize, seq_len: usize, recompute: bool) -> Result<Self> {
        Self::with_recompute(cfg, batch, seq_len, vec![recompute; cfg.layers])
    }

    /// [`Model::new`] with activation recomputation chosen per block
    /// (`recompute[l]` for block `l`; one entry per layer).
    pub fn with_recompute(
        cfg: &ModelConfig,
        batch: usize,
        seq_len: usize,
        recompute: Vec<bool>,
    ) -> Result<Self> {
        Self::split(cfg, batch, seq_len, recompute, (1, false))
    }

    /// One rank's part of a `tp`-way tensor-parallel model (000 §2.15): the same decoder with
    /// every block stored as its shard ([`Layout::split`]: the parameters, gradients and
    /// activations of this rank's H/tp heads and F/tp feed-forward units; the embeddings,
    /// norms and head whole). With `sequence` (Megatron's sequence parallelism, 000 L3239)
    /// the residual stream, the norms and the block outputs keep only this rank's `N/tp`
    /// rows. The units then run with the group's [`BlockComm`] ([`Model::forward_with`],
    /// [`Model::forward_unit_with`], ...). `(1, false)` is [`Model::with_recompute`].
    /// Refuses what [`Layout::split`] refuses, and `sequence` when `tp` does not divide the
    /// batch's rows.
    pub fn split(
        cfg: &ModelConfig,
        batch: usize,
        seq_len: usize,
        recompute: Vec<bool>,
        (tp, sequence): (usize, bool),
    ) -> Result<Self> {
        Self::parts(
            cfg,
            (batch, seq_len),
            recompute,
            (tp, sequence),
            (1, 0),
            false,
        )
    }

    /// [`Model::split`] reading its parameters at the whole model's addresses: each block's
    /// shard at the start of its block's range ([`Layout::placed_in`]), the embeddings and the
    /// head where the whole layout has them; the buffers it takes are `Layout::new(cfg).total`
    /// long. A tensor-parallel pipeline stage keeps its state this way.
    pub fn split_in_place(
        cfg: &ModelConfig,
        batch: usize,
        seq_len: usize,
        recompute: Vec<bool>,
        (tp, sequence): (usize, bool),
    ) -> Result<Self> {
        Self::parts(
            cfg,
            (batch, seq_len),
            recompute,
            (tp, sequence),
            (1, 0),
            true,
        )
    }

    /// The general constructor: [`Model::split`] (or, `in_place`, [`Model::split_in_place`])
    /// on rank `ep_rank` of an `ep`-way expert-parallel group: each block's mixture of experts
    /// computes that rank's `E / ep` experts and exchanges rows over the
    /// [`BlockComm::experts`] group. The buffers keep the whole layout (every expert's place;
    /// the rank reads and writes only its own experts' ranges,
    /// [`Layout::owned_expert_ranges`]). Its gradients are one data-parallel replica's share
    /// ([`crate::moe::Objective::Mean`]): the replicas' mean of the dense and router
    /// gradients, and each expert's as it stands, are those of the mean loss. Refuses what
    /// [`Layout::split`] refuses, `ep` not dividing the experts, and experts under sequence
    /// parallelism.
    pub fn parts(
        cfg: &ModelConfig,
        (batch, seq_len): (usize, usize),
        recompute: Vec<bool>,
        (tp, sequence): (usize, bool),
        (ep, ep_rank): (usize, usize),
        in_place: bool,
    ) -> Result<Self> {
        cfg.validate()?;
        cfg.check_split(tp)?;
        if sequence && cfg.moe.is_some() {
            return Err(ModelError::Config {
                field: "sequence parallel",
                value: format!("tp {tp}"),
                reason: "a mixture-of-experts feed-forward under sequence parallelism is not \
                 built (the experts run on every rank's whole rows)"
                    .into(),
            });
        }
        let experts = match cfg.moe_layer() {
            Some(m) => (0..cfg.layers)
                .map(|_| Experts::new(m, (ep, ep_rank), Objective::Mean))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        if recompute.len() != cfg.layers {
            return Err(ModelError::Shape {
                what: "recompute (one flag per block)",
                expected: cfg.layers,
                got: recompute.len(),
            });
        }
        if batch == 0 {
            return Err(ModelError::Config {
                field: "batch",
                value: "0".into(),
                reason: "must be positive".into(),
            });
        }
        if seq_len == 0 || seq_len > cfg.seq_len {
            return Err(ModelError::Config {
                field: "seq_len",
                value: seq_len.to_string(),
                reason: format!("a batch's sequence length must be in 1..={}", cfg.seq_len),
            });
        }
        let layout = Layout::split(cfg, tp)?;
        let layout = match in_place {
            true => layout.placed_in(&Layout::new(cfg)),
            false => layout,
        };
        let mut dims = Dims::new(cfg, batch, seq_len).split(tp);
        if sequence {
            if !dims.n.is_multiple_of(tp) {
                return Err(ModelError::Config {
                    field: "sequence parallel",
                    value: format!("tp {tp}"),
                    reason: format!(
                        "each rank keeps rows/tp rows of the residual stream: batch x seq_len = \
                         {batch} x {seq_len} = {} rows must divide by tp ({tp})",
                        dims.n
                    ),
                });
            }
            dims = dims.sequence(tp);
        }
        let acts = ActLayout::new(&dims, &recompute);
        let floats = acts.total + dims.block_scratch_len() + dims.rows * dims.c;
        crate::memory::check_fits(
            &format!("the activations of a batch of {batch} x {seq_len} tokens"),
            crate::memory::bytes_of::<T>(floats)
                .saturating_add(crate::memory::bytes_of::<u32>(2 * dims.n)),
            crate::memory::available_bytes(),
            "lower the batch or the sequence length (the logits alone hold batch x seq_len x vocab \
             floats), or recompute activations",
        )?;
        let rope = match cfg.positions {
            Positions::Rope { theta } => Some(RopeTable::new(cfg.seq_len, cfg.head_dim(), theta)),
            Positions::Learned => None,
        };
        Ok(Self {
            block: Block::new(cfg, layout.block.clone()),
            cfg: cfg.clone(),
            arena: vec![T::zero(); acts.total],
            scratch: vec![T::zero(); dims.block_scratch_len()],
            dresid: vec![T::zero(); dims.rows * dims.c],
            tokens: vec![0; dims.n],
            targets: vec![0; dims.n],
            want_targets: false,
            loss: None,
            next_fwd: None,
            next_bwd: None,
            layout,
            dims,
            rope,
            recompute,
            acts,
            experts,
        })
    }

    /// Each block's routing metrics from the last forward (empty for a dense model or before a
    /// forward).
    pub fn moe_stats(&self) -> Vec<crate::moe::MoeStats> {
        self.experts
            .iter()
            .filter_map(|e| e.stats().cloned())
            .collect()
    }

    /// The config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The parameter layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The batch dimensions.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// Number of parameters.
    pub fn n_params(&self) -> usize {
        self.layout.total
    }

    /// Bytes of activations held (arena plus backward scratch).
    pub fn activation_bytes(&self) -> usize {
        (self.arena.len() + self.scratch.len() + self.dresid.len()) * std::mem::size_of::<T>()
    }

    /// Bytes one block keeps in the arena for its backward: its saved activations and its
    /// output (this rank's rows of the residual stream). With recompute, the shared region
    /// counts once for the model, so this is the per-block figure without it.
    pub fn layer_activation_bytes(&self) -> usize {
        let per = self.dims.block_acts_len() + self.acts.outs.first().map_or(0, Range::len);
        per * std::mem::size_of::<T>()
    }

    /// The logits of the last forward (N, V); after a backward, their gradient.
    pub fn logits(&self) -> &[T] {
        &self.arena[self.acts.logits.clone()]
    }

    pub(crate) fn check_len(&self, what: &'static str, got: usize, expected: usize) -> Result<()> {
        if got == expected {
            Ok(())
        } else {
            Err(ModelError::Shape {
                what,
                expected,
                got,
            })
        }
    }

    pub(crate) fn check_tokens(&self, what: &'static str, ids: &[u32]) -> Result<()> {
        check_token_ids(what, ids, self.dims.n, self.cfg.vocab)
    }

    /// Forward over `tokens` (B*T ids). With `targets`, also the mean
    /// cross-entropy loss, which is returned, and the backward becomes
    /// possible.
    pub fn forward(
        &mut self,
        th: &Threads,
        params: &[T],
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>> {
        self.forward_with(th, params, tokens, targets, &mut Alone)
    }

    /// [`Model::forward`] of a split model, its blocks communicating through `comm` (every
    /// rank of the group calls it with the same tokens).
    pub fn forward_with(
        &mut self,
        th: &Threads,
        params: &[T],
        tokens: &[u32],
        targets: Option<&[u32]>,
        comm: &mut dyn BlockComm<T>,
    ) -> Result<Option<f64>> {
        self.check_len("params", params.len(), self.layout.total)?;
        self.begin(tokens, targets)?;
        for unit in self.layout.units() {
            self.forward_unit_with(th, params, unit, comm)?;
        }
        Ok(self.loss)
    }

    /// Starts a forward over `tokens` (and `targets`), to be run unit by unit
    /// with [`Model::forward_unit`] in [`Layout::units`] order. [`Model::forward`]
    /// does all of it; a caller that fetches each unit's parameters just before
    /// its use (ZeRO-3) drives the units itself.
    pub fn begin(&mut self, tokens: &[u32], targets: Option<&[u32]>) -> Result<()> {
        self.check_tokens("tokens", tokens)?;
        if let Some(t) = targets {
            self.check_tokens("targets", t)?;
        }
        self.tokens.copy_from_slice(tokens);
        self.loss = None;
        self.want_targets = targets.is_some();
        if let Some(t) = targets {
            self.targets.copy_from_slice(t);
        }
        self.next_fwd = Some(Unit::Embed);
        self.next_bwd = None;
        Ok(())
    }

    /// The forward of `unit`, which must be the next one after
    /// [`Model::begin`]. Reads only `unit`'s range of `params` (and the
    /// embedding's for a tied head). After the head, [`Model::loss`] holds
    /// the loss when targets were given.
    pub fn forward_unit(&mut self, th: &Threads, params: &[T], unit: Unit) -> Result<()> {
        self.forward_unit_with(th, params, unit, &mut Alone)
    }

    /// [`Model::forward_unit`] of a split model, a block communicating through `comm`.
    pub fn forward_unit_with(
        &mut self,
        th: &Threads,
        params: &[T],
        unit: Unit,
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        self.check_len("params", params.len(), self.layout.total)?;
        self.expect("forward", self.next_fwd, unit)?;
        let layers = self.cfg.layers;
        self.next_fwd = match unit {
            Unit::Embed => {
                self.embed_forward(th, params, comm)?;
                Some(Unit::Block(0))
            }
            Unit::Block(l) => {
                self.block_forward(th, params, l, comm)?;
                Some(if l + 1 < layers {
                    Unit::Block(l + 1)
                } else {
                    Unit::Head
                })
            }
            Unit::Head => {
                self.head_forward(th, params, comm)?;
                if self.want_targets {
                    self.loss = Some(self.loss_forward(th));
                    self.next_bwd = Some(Unit::Head);
                }
                None
            }
        };
        Ok(())
    }

    /// The loss of the last complete forward with targets.
    pub fn loss(&self) -> Option<f64> {
        self.loss
    }

    /// An error unless `unit` is the `expected` next one of `pass`.
    fn expect(&self, pass: &'static str, expected: Option<Unit>, unit: Unit) -> Result<()> {
        match expected {
            Some(e) if e == unit => Ok(()),
            _ => Err(ModelError::Config {
                field: "unit order",
                value: format!("{pass} of {unit:?}"),
                reason: match expected {
                    Some(e) => format!("the next unit of the {pass} is {e:?}"),
                    None if pass == "backward" => {
                        "the backward needs a complete forward with targets".into()
                    }
                    None => "no forward in progress: call begin first".into(),
                },
            }),
        }
    }

    fn loss_forward(&mut self, th: &Threads) -> f64 {
        let d = &self.dims;
        let [logits, losses] = self
            .arena
            .get_disjoint_mut([self.acts.logits.clone(), self.acts.losses.clone()])
            .expect("disjoint");
        let (losses, lse) = losses.split_at_mut(d.n);
        timed!(
            "cross_entropy.fwd",
            cross_entropy_fwd(th, losses, lse, logits, &self.targets, d.n, d.v)
        );
        mean_loss(losses)
    }

    /// Backward of the last forward (which must have had targets): gradients
    /// of the mean loss accumulate (`+=`) into `grads`.
    pub fn backward(&mut self, th: &Threads, params: &[T], grads: &mut [T]) -> Result<()> {
        self.backward_hooked(th, params, grads, &mut |_, _| {})
    }

    /// [`Model::backward`], calling `ready(range, grads)` as soon as a range
    /// of the gradient buffer is final: the head's tensors, then each block
    /// from the last to the first, then the embeddings. Overlapped gradient
    /// buckets hang off this hook.
    pub fn backward_hooked(
        &mut self,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        ready: &mut dyn FnMut(Range<usize>, &mut [T]),
    ) -> Result<()> {
        self.backward_hooked_with(th, params, grads, ready, &mut Alone)
    }

    /// [`Model::backward_hooked`] of a split model, its blocks communicating through `comm`.
    pub fn backward_hooked_with(
        &mut self,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        ready: &mut dyn FnMut(Range<usize>, &mut [T]),
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        for unit in self.layout.units().into_iter().rev() {
            self.backward_unit_with(th, params, grads, unit, comm)?;
            ready(self.layout.unit_range(unit), grads);
        }
        Ok(())
    }

    /// The backward of `unit`, in reverse [`Layout::units`] order after a
    /// forward with targets: accumulates (`+=`) its parameters' gradients into
    /// `grads` (the head also into the embedding's when tied). Reads `unit`'s
    /// range of `params` (the embeddings' backward reads none; a tied head
    /// reads the embedding's). After it, `unit`'s gradient range is final.
    pub fn backward_unit(
        &mut self,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        unit: Unit,
    ) -> Result<()> {
        self.backward_unit_with(th, params, grads, unit, &mut Alone)
    }

    /// [`Model::backward_unit`] of a split model, a block (and its recomputed forward)
    /// communicating through `comm`.
    pub fn backward_unit_with(
        &mut self,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        unit: Unit,
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        self.check_len("params", params.len(), self.layout.total)?;
        self.check_len("grads", grads.len(), self.layout.total)?;
        self.expect("backward", self.next_bwd, unit)?;
        let layers = self.cfg.layers;
        self.next_bwd = match unit {
            Unit::Head => {
                self.head_backward(th, params, grads, comm)?;
                Some(Unit::Block(layers - 1))
            }
            Unit::Block(l) => {
                if self.recompute[l] {
                    self.block_forward(th, params, l, comm)?;
                }
                self.block_backward(th, params, grads, l, comm)?;
                Some(if l > 0 {
                    Unit::Block(l - 1)
                } else {
                    Unit::Embed
                })
            }
            Unit::Embed => {
                self.embed_backward(th, grads, comm)?;
                None
            }
        };
        Ok(())
    }

    fn block_forward(
        &mut self,
        th: &Threads,
        params: &[T],
        l: usize,
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let [x, inner, out] = self
            .arena
            .get_disjoint_mut([
                self.acts.input(l),
                self.acts.inner[l].clone(),
                self.acts.outs[l].clone(),
            ])
            .expect("arena regions are disjoint");
        let mut a = BlockActs::carve(inner, &self.dims);
        a.experts = self.experts.get_mut(l);
        let mut s = BlockScratch::carve(&mut self.scratch, &self.dims);
        let p = &params[self.layout.blocks[l].clone()];
        let rope = self.rope.as_ref();
        self.block
            .forward(th, &self.dims, p, rope, &mut a, &mut s, x, out, comm)
    }

    fn block_backward(
        &mut self,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        l: usize,
        comm: &mut dyn BlockComm<T>,
    ) -> Result<()> {
        let [x, inner] = self
            .arena
            .get_disjoint_mut([self.acts.input(l), self.acts.inner[l].clone()])
            .expect("arena regions are disjoint");
        let mut a = BlockActs::carve(inner, &self.dims);
        a.experts = self.experts.get_mut(l);
        let mut s = BlockScratch::carve(&mut self.scratch, &self.dims);
        let r = self.layout.blocks[l].clone();
        self.block.backward(
            th,
            &self.dims,
            &params[r.clone()],
            &mut grads[r],
            self.rope.as_ref(),
            &a,
            &mut s,
            x,
            &mut self.dresid,
            comm,
        )
    }
}
