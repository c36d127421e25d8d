//! Where a run's parameters start: from the seed, or from a Hugging Face directory
//! (`flotilla train --init-hf DIR`, fine-tuning).
//!
//! A Hugging Face start reads the directory's `config.json` before any worker starts
//! ([`HfInit::open`]: the model's shape and maximum sequence length, and its tokenizer), then
//! every rank loads the whole weights ([`model::interop::import_hf`], shards memory-mapped) and
//! places them as a checkpoint's restore does (`Trainer::load_whole_state`): a
//! tensor-parallel rank keeps its shards, ZeRO its part, bf16 its rounded copy; the optimizer
//! starts with zero moments at step 0. A committed checkpoint in `--ckpt-dir` is restored after
//! it, so a resume wins over the Hugging Face weights.
use std::path::{Path, PathBuf};

use model::config::ModelConfig;
use model::interop::{HF_TOKENIZER, HF_TOKENIZER_FILES, HfArch};

use super::config::refused;
use super::engine::Engine;
use crate::error::{Context, Result, TrainError};

/// Where a run's parameters start.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Init {
    /// Initialised from the training seed.
    #[default]
    Seed,
    /// The weights of a Hugging Face directory (fine-tuning).
    HuggingFace(HfInit),
}

/// A Hugging Face model directory to start from, its `config.json` read.
#[derive(Clone, Debug, PartialEq)]
pub struct HfInit {
    /// The directory.
    pub dir: PathBuf,
    /// Its architecture (`model_type`).
    pub arch: HfArch,
    /// The model `config.json` describes (shape, maximum sequence length).
    pub model: ModelConfig,
    /// Its `tokenizer.json`, when it has one.
    pub tokenizer: Option<PathBuf>,
}

impl HfInit {
    /// Reads `dir`'s `config.json` (no weights) and looks for its `tokenizer.json`.
    ///
    /// # Errors
    /// The model crate's error naming `config.json` and the field it cannot take.
    pub fn open(dir: &Path) -> Result<HfInit> {
        let (arch, model) = model::interop::read_hf_config(dir)?;
        let tok = dir.join(HF_TOKENIZER);
        Ok(HfInit {
            dir: dir.to_path_buf(),
            arch,
            model,
            tokenizer: tok.is_file().then_some(tok),
        })
    }
}

impl HfInit {
    /// Checks that `data` is tokenized as this model expects: a token dataset's vocabulary
    /// fits the model's, and was made with the directory's `tokenizer.json` when it has one;
    /// text tokenized on the fly (`--data grammar/text`, built-in tokenizers) is refused when
    /// the directory has its own tokenizer.
    ///
    /// # Errors
    /// [`TrainError::Refused`] naming the dataset or the data kind and what to do instead.
    pub fn check_data(&self, data: &crate::DataSpec) -> Result<()> {
        let dir = self.dir.display();
        let mine = match &self.tokenizer {
            Some(path) => Some(
                data::HfTokenizer::from_file(path, None)
                    .ctx(|| format!("loading {}", path.display()))?,
            ),
            None => None,
        };
        match data {
            crate::DataSpec::Dataset { dirs, loader } => {
                for d in dirs {
                    let m = data::cache::read_manifest(d, &loader.cache)?;
                    if m.vocab_size as usize > self.model.vocab {
                        return Err(refused(format!(
                            "--dataset {}: its vocabulary of {} does not fit the model's \
                             vocab_size {} ({dir}/config.json)",
                            d.display(),
                            m.vocab_size,
                            self.model.vocab
                        )));
                    }
                    if let Some(t) = &mine
                        && data::Tokenizer::name(t) != m.tokenizer
                    {
                        return Err(refused(format!(
                            "--dataset {} was tokenized with {}, not with {dir}/tokenizer.json \
                             ({}): prepare it with `flotilla data prepare --tokenizer \
                             {dir}/tokenizer.json`",
                            d.display(),
                            m.tokenizer,
                            data::Tokenizer::name(t)
                        )));
                    }
                }
            }
            crate::DataSpec::Grammar { .. } | crate::DataSpec::Text { .. } if mine.is_some() => {
                return Err(refused(format!(
                    "--data grammar/text tokenize with a built-in tokenizer, but {dir} has its \
                     own tokenizer.json: tokenize the text with `flotilla data prepare \
                     --tokenizer {dir}/tokenizer.json` and train on --dataset"
                )));
            }
            _ => {}
        }
        Ok(())
    }
}

impl Init {
    /// The directory whose tokenizer files an export copies, if any.
    pub fn tokenizer_dir(&self) -> Option<&Path> {
        match self {
            Init::HuggingFace(h) if h.tokenizer.is_some() => Some(&h.dir),
            _ => None,
        }
    }
}

/// The refusal of a start from a Hugging Face directory under a layout that cannot take it
/// (checked before any worker starts), if any: `pp` pipeline stages, or experts in the model.
pub(super) fn check_layout(init: &Init, pp: usize, moe: bool) -> Result<()> {
    let Init::HuggingFace(h) = init else {
        return Ok(());
    };
    let dir = h.dir.display();
    if moe {
        return Err(refused(format!(
            "--init-hf {dir} with --experts: a Hugging Face {} is a dense model (its blocks have \
             MLPs, not experts)",
            h.arch.class_name()
        )));
    }
    if pp > 1 {
        return Err(refused(format!(
            "--init-hf {dir} with --pp {pp}: pipeline stages do not load Hugging Face weights \
             yet (data parallel, ZeRO and --tp do)"
        )));
    }
    Ok(())
}

/// Loads the run's starting weights into `engine` when they come from a Hugging Face
/// directory (every rank reads the whole model and keeps its part); the line saying so.
pub(super) fn apply(
    init: &Init,
    train: &ModelConfig,
    engine: &mut Engine,
) -> Result<Option<String>> {
    let Init::HuggingFace(h) = init else {
        return Ok(None);
    };
    let dir = h.dir.display();
    let (cfg, params) =
        model::interop::import_hf(&h.dir).ctx(|| format!("loading --init-hf {dir}"))?;
    if &cfg != train {
        return Err(refused(format!(
            "--init-hf {dir}: its config.json describes {cfg:?}, the run was configured for \
             {train:?} (the directory changed since the run was set up?)"
        )));
    }
    let n = params.len();
    match engine {
        Engine::Data(t) | Engine::Tensor(t) => {
            let zeros = vec![0f32; n];
            t.load_whole_state([params, zeros.clone(), zeros], 0, 0)?;
        }
        Engine::Pipeline(_) => {
            return Err(refused(format!(
                "--init-hf {dir}: this layout does not load Hugging Face weights"
            )));
        }
    }
    Ok(Some(format!(
        "# initialised from the Hugging Face {} in {dir} ({:.2}M parameters)",
        h.arch.class_name(),
        n as f64 / 1e6
    )))
}

/// Copies the Hugging Face tokenizer files present in `from` (see
/// [`model::interop::HF_TOKENIZER_FILES`]) into `to`, each read as a bounded regular file;
/// returns how many were copied.
pub(super) fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<usize> {
    /// Largest tokenizer file copied (256 MiB; real ones are a few MB).
    const MAX_BYTES: u64 = 256 << 20;
    let mut copied = 0;
    for name in HF_TOKENIZER_FILES {
        let src = from.join(name);
        if !src.exists() {
            continue;
        }
        let bytes = data::fsread::read_bounded(&src, MAX_BYTES)?;
        let dst = to.join(name);
        std::fs::write(&dst, bytes).map_err(|source| TrainError::Io { path: dst, source })?;
        copied += 1;
    }
    Ok(copied)
}
