//! Learning-rate schedules: constant, or linear warmup followed by linear or
//! cosine decay (the shapes of Hugging Face's `get_linear_schedule_with_warmup`
//! and `get_cosine_with_min_lr_schedule_with_warmup`).
//!
//! `step` is the 0-based index of the optimizer step about to be taken: the
//! learning rate rises linearly from 0 at step 0 to the peak at step
//! `warmup`, then decays to `min_lr_ratio * peak` at step `total` and stays
//! there.
use crate::error::{ModelError, Result};

/// The names [`Schedule::parse`] accepts.
pub const SCHEDULE_NAMES: [&str; 3] = ["constant", "linear", "cosine"];

/// A learning-rate schedule relative to a peak learning rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Schedule {
    /// The peak learning rate at every step (no warmup).
    Constant,
    /// Linear warmup over `warmup` steps, then linear decay to
    /// `min_lr_ratio * peak` at step `total`.
    Linear {
        /// Warmup steps (`<= total`).
        warmup: u64,
        /// Step at which the minimum is reached.
        total: u64,
        /// Final learning rate as a fraction of the peak, in `[0, 1]`.
        min_lr_ratio: f64,
    },
    /// Linear warmup over `warmup` steps, then half a cosine down to
    /// `min_lr_ratio * peak` at step `total`.
    Cosine {
        /// Warmup steps (`<= total`).
        warmup: u64,
        /// Step at which the minimum is reached.
        total: u64,
        /// Final learning rate as a fraction of the peak, in `[0, 1]`.
        min_lr_ratio: f64,
    },
}

impl Schedule {
    /// Build a schedule from its name (one of [`SCHEDULE_NAMES`]) and
    /// validate it. `"constant"` ignores `warmup`, `total` and `min_ratio`.
    pub fn parse(name: &str, warmup: u64, total: u64, min_ratio: f64) -> Result<Self> {
        let s = match name {
            "constant" => Self::Constant,
            "linear" => Self::Linear {
                warmup,
                total,
                min_lr_ratio: min_ratio,
            },
            "cosine" => Self::Cosine {
                warmup,
                total,
                min_lr_ratio: min_ratio,
            },
            _ => {
                return Err(ModelError::Optim {
                    field: "schedule",
                    value: format!("{name:?}"),
                    reason: format!(
                        "unknown schedule; expected one of: {}",
                        SCHEDULE_NAMES.join(", ")
                    ),
                });
            }
        };
        s.validate()?;
        Ok(s)
    }

    /// The schedule's name, as [`parse`](Self::parse) accepts it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Linear { .. } => "linear",
            Self::Cosine { .. } => "cosine",
        }
    }

    /// Check `warmup <= total` and `min_lr_ratio` in `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        let (Self::Linear {
            warmup,
            total,
            min_lr_ratio,
        }
        | Self::Cosine {
            warmup,
            total,
            min_lr_ratio,
        }) = *self
        else {
            return Ok(());
        };
        if warmup > total {
            return Err(ModelError::Optim {
                field: "warmup",
                value: warmup.to_string(),
                reason: format!("must be <= total steps ({total})"),
            });
        }
        if !(0.0..=1.0).contains(&min_lr_ratio) {
            return Err(ModelError::Optim {
                field: "min_lr_ratio",
                value: min_lr_ratio.to_string(),
                reason: "must be in [0, 1]".into(),
            });
        }
        Ok(())
    }

    /// The learning rate for the 0-based optimizer step `step`, given the
    /// peak learning rate (computed in f64, rounded once).
    pub fn lr_at(&self, peak: f32, step: u64) -> f32 {
        (f64::from(peak) * self.factor(step)) as f32
    }

    /// The multiplier of the peak learning rate at `step`.
    pub fn factor(&self, step: u64) -> f64 {
        let (Self::Linear {
            warmup,
            total,
            min_lr_ratio,
        }
        | Self::Cosine {
            warmup,
            total,
            min_lr_ratio,
        }) = *self
        else {
            return 1.0;
        };
        if step < warmup {
            return step as f64 / warmup as f64;
        }
        if step >= total {
            return min_lr_ratio;
        }
        // warmup <= step < total, so total - warmup >= 1.
        let progress = (step - warmup) as f64 / (total - warmup) as f64;
        let shape = match self {
            Self::Cosine { .. } => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            _ => 1.0 - progress,
        };
        min_lr_ratio + (1.0 - min_lr_ratio) * shape
    }
}
