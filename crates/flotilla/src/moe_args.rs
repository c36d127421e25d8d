//! `flotilla train`'s mixture-of-experts options, mapped to the model's
//! [`model::config::MoeSpec`] and the layout's expert-parallel degree.
use crate::flag_range::number_in;
use anyhow::{Result, bail};
use model::config::MoeSpec;

/// Experts per token when --top-k is not given.
const DEFAULT_TOP_K: u8 = 2;
/// Capacity factor when --capacity-factor is not given.
const DEFAULT_CAPACITY_FACTOR: f64 = 1.25;
/// Load-balancing loss weight when --aux-loss-coef is not given.
const DEFAULT_AUX_LOSS_COEF: f64 = 0.01;

/// Mixture-of-experts options of `flotilla train`.
#[derive(clap::Args, Debug, Clone)]
pub struct MoeArgs {
    /// Experts per block: every block's feed-forward becomes E experts, each the block's MLP
    /// (--ffn wide, its activation and biases), behind a router. 0: the dense model.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=4096))]
    experts: u32,
    /// Experts each token is sent to: 1 (Switch) or 2 (Mixtral) [default: 2; needs --experts].
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=2))]
    top_k: Option<u8>,
    /// Per-expert capacity ceil(C x tokens x k / E) over the EP group; assignments past it are
    /// dropped (the residual carries the token) [default: 1.25; in (0, 64]; needs --experts].
    #[arg(long, value_parser = capacity_factor)]
    capacity_factor: Option<f64>,
    /// Weight of the Switch load-balancing loss in the objective [default: 0.01; in [0, 10];
    /// needs --experts].
    #[arg(long, value_parser = aux_loss_coef)]
    aux_loss_coef: Option<f64>,
    /// Expert-parallel degree: the experts split over groups of P data-parallel ranks; P
    /// divides the data-parallel degree and --experts [default: 1; needs --experts].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    ep: Option<u32>,
}

impl MoeArgs {
    /// The model's experts (None: dense) and the expert-parallel degree; a MoE flag without
    /// --experts is refused by name.
    pub fn settings(&self) -> Result<(Option<MoeSpec>, usize)> {
        if self.experts == 0 {
            let given = [
                (self.top_k.is_some(), "--top-k"),
                (self.capacity_factor.is_some(), "--capacity-factor"),
                (self.aux_loss_coef.is_some(), "--aux-loss-coef"),
                (self.ep.is_some(), "--ep"),
            ];
            if let Some((_, flag)) = given.iter().find(|(g, _)| *g) {
                bail!(
                    "{flag} needs --experts E (a mixture-of-experts model); without it the model is dense"
                );
            }
            return Ok((None, 1));
        }
        let spec = MoeSpec {
            experts: self.experts as usize,
            top_k: usize::from(self.top_k.unwrap_or(DEFAULT_TOP_K)),
            capacity_factor: self.capacity_factor.unwrap_or(DEFAULT_CAPACITY_FACTOR),
            aux_weight: self.aux_loss_coef.unwrap_or(DEFAULT_AUX_LOSS_COEF),
        };
        Ok((Some(spec), self.ep.map_or(1, |p| p as usize)))
    }
}

/// `--capacity-factor`: in (0, 64].
fn capacity_factor(s: &str) -> Result<f64, String> {
    number_in(s, 0.0, 64.0, true)
}

/// `--aux-loss-coef`: in [0, 10].
fn aux_loss_coef(s: &str) -> Result<f64, String> {
    number_in(s, 0.0, 10.0, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_named() {
        assert_eq!(capacity_factor("1.5"), Ok(1.5));
        assert!(capacity_factor("0").unwrap_err().contains("(0, 64]"));
        assert!(capacity_factor("nan").is_err());
        assert_eq!(aux_loss_coef("0"), Ok(0.0));
        assert!(aux_loss_coef("-0.1").unwrap_err().contains("[0, 10]"));
    }
}
