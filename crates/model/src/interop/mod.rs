//! Weights interchange: Flotilla's own safetensors checkpoints and Hugging
//! Face `GPT2LMHeadModel` / `LlamaForCausalLM` directories.
//!
//! - [`safetensors_io`]: a checked safetensors reader ([`TensorFile`]) and
//!   writer ([`TensorWriter`]); [`save_flotilla`] / [`load_flotilla`] /
//!   [`load_flotilla_with_config`] under Flotilla's names with the config in
//!   the metadata; [`write_reference`] for `scripts/hf_check.py`.
//! - [`hf`]: [`export_hf`] / [`import_hf`], mapping names, the fused qkv and
//!   gate/up rows, and GPT-2's transposed Conv1D weights, plus `config.json`.
//!
//! All failures are [`ModelError::Io`](crate::ModelError::Io) naming the file
//! and the tensor or key, or [`ModelError::Config`](crate::ModelError::Config)
//! naming the config field a Hugging Face class cannot represent.
pub mod hf;
pub mod safetensors_io;

pub use hf::{
    HF_CONFIG, HF_TOKENIZER, HF_TOKENIZER_FILES, HfArch, HfDtype, config_from_hf_json, export_hf,
    export_hf_as, hf_arch, hf_config_json, import_hf, read_hf_config,
};
pub use safetensors_io::{
    CONFIG_PREFIX, MAX_TENSOR_FILE_BYTES, REFERENCE_FILE, TensorFile, TensorWriter,
    config_from_metadata, config_to_metadata, load_flotilla, load_flotilla_file,
    load_flotilla_with_config, read_reference, save_flotilla, write_reference,
};
