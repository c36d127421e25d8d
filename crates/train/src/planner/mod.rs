//! The planner's view of a training config (issue 7's "plan beside actual", issue 8's memory
//! per rank): the `plan` crate's [`Job`] for a [`ModelConfig`], so a run, its tests and the
//! command line all ask the planner about exactly the model they train.

pub mod calibrate;

use model::config::{Activation, ModelConfig};
use plan::PlanError;
use plan::job::{Job, JobFile};

/// The planner's job for `model` trained on sequences of `seq` tokens, `global_batch`
/// sequences a step, with f32 parameters and gradients and AdamW's two f32 moments (4 + 4 + 8
/// bytes per parameter: this project's dtypes, `precision = "fp32"`, `optimizer = "adam"`).
pub fn job(model: &ModelConfig, seq: usize, global_batch: usize) -> plan::Result<Job> {
    let json = serde_json::json!({
        "model": {
            "layers": model.layers, "hidden": model.d_model, "heads": model.heads,
            "kv_heads": model.kv_heads, "ffn": model.ffn, "vocab": model.vocab, "seq": seq,
            "gated": model.activation == Activation::SwiGlu,
            "tied_embeddings": model.tied_embeddings,
        },
        "training": { "global_batch": global_batch, "precision": "fp32", "optimizer": "adam" },
    });
    let file: JobFile = serde_json::from_value(json).map_err(|e| PlanError::Parse {
        what: "the planner's job for a model config".into(),
        message: e.to_string(),
    })?;
    Job::from_file(&file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_counts_the_models_parameters() {
        // GPT-2 style, 2 layers, C = 64, 4 heads, F = 256, V = 64, tied: the planner ignores
        // biases and positions, so its count is the block matmuls, the two norm weights and
        // the embedding.
        let m = ModelConfig::gpt2(2, 4, 64, 16, 64);
        let j = job(&m, 16, 8).unwrap();
        let per_layer = 4.0 * 64.0 * 64.0 + 2.0 * 64.0 * m.ffn as f64 + 2.0 * 64.0;
        assert_eq!(j.model.dense_params_per_layer(), per_layer);
        assert_eq!(j.model.embedding_params(), 64.0 * 64.0);
        assert_eq!(j.global_batch, 8);
        assert!(job(&m, 0, 8).is_err(), "seq 0 is refused by the planner");
    }
}
