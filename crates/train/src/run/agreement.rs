//! The run configuration as named fields, for agreement at gang admission (issue 29, see
//! `launch::agree`): every node of a job must train the same model on the same layout with the
//! same hyperparameters, data and code, or their replicas diverge and a checkpoint splices
//! them. Settings a node may choose for itself (threads, output paths, logging, the MFU
//! denominator) are not fields.

use super::RunConfig;

impl RunConfig {
    /// The fields every node of a job must agree on, in a fixed order, each named as the
    /// configuration names it (`lr`, `batch`, `tp`, ...), its value in words.
    pub fn agreement(&self) -> Vec<(String, String)> {
        let t = &self.train;
        let l = &self.layout;
        let ckpt = self.checkpoint.as_ref().map(|c| (c.every, c.auto_mtbf));
        let fields: [(&str, String); 23] = [
            ("code", format!("flotilla {}", env!("CARGO_PKG_VERSION"))),
            ("model", format!("{:?}", t.model)),
            ("ep", format!("{}", self.layout.ep)),
            ("batch", t.batch.to_string()),
            ("grad_accum", t.grad_accum.to_string()),
            ("seq_len", t.seq_len.to_string()),
            ("steps", t.steps.to_string()),
            ("lr", format!("{:?}", t.lr)),
            ("schedule", format!("{:?}", t.schedule)),
            ("adamw", format!("{:?}", t.adamw)),
            ("decay_all", t.decay_all.to_string()),
            ("grad_clip", format!("{:?}", t.grad_clip)),
            ("seed", t.seed.to_string()),
            ("recompute", t.recompute.to_string()),
            ("bf16", t.bf16.to_string()),
            ("data", format!("{:?}", t.data)),
            ("tp", l.tp.to_string()),
            ("sp", l.sp.to_string()),
            ("pp", l.pp.to_string()),
            ("pipeline_schedule", format!("{:?}", l.schedule)),
            ("zero", l.zero.to_string()),
            ("bucket_bytes", l.bucket_bytes.to_string()),
            ("checkpoint_every", format!("{ckpt:?}")),
        ];
        fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::TrainConfig;
    use crate::run::{LayoutConfig, RunConfig};

    #[test]
    fn the_fields_name_what_differs_and_skip_per_node_settings() {
        let model = model::config::ModelConfig::gpt2(2, 2, 16, 8, 32);
        let a = RunConfig::new(TrainConfig::new(model.clone(), 4), LayoutConfig::default());
        let mut b = a.clone();
        b.train.lr = 1e-3;
        b.train.threads = 7;
        b.log_every = 3;
        let (fa, fb) = (a.agreement(), b.agreement());
        let differ: Vec<&str> = fa
            .iter()
            .zip(&fb)
            .filter(|(x, y)| x != y)
            .map(|(x, _)| x.0.as_str())
            .collect();
        assert_eq!(differ, ["lr"]);
        assert!(
            fa.iter()
                .any(|(k, v)| k == "code" && v.starts_with("flotilla "))
        );
    }
}
