//! Flotilla's data pipeline: text to token ids, and token ids to training batches.
//!
//! - [`tokenizer`]: the [`Tokenizer`] trait, [`ByteTokenizer`] (vocabulary 257) and
//!   [`Gpt2Tokenizer`] (GPT-2 BPE, vocabulary 50257), chosen by name through [`TokenizerKind`].
//! - [`corpus`]: built-in synthetic data needing no download: [`MarkovCorpus`], a seeded Markov
//!   chain whose exact entropy rate is the best achievable loss, and [`TextCorpus`], English-like
//!   sentences for byte-level models.
//! - [`text`]: plain-text files to one token stream, with end-of-text between files.
//! - [`batch`]: [`TokenWindows`], seeded random (input, target) windows, and [`validate_ids`].
//! - [`prepare`](mod@prepare): text, JSON Lines and Parquet files to a sharded dataset ([`prepare()`]), and
//!   [`verify`](mod@verify): re-hashing every shard of one ([`verify_dataset`]).
//!
//! Everything random is a deterministic function of a `u64` seed (ChaCha8), so runs repeat.
//!
//! ```
//! use data::{MarkovCorpus, TokenWindows};
//!
//! let mut corpus = MarkovCorpus::new(64, 7, 4)?;
//! let mut stream = vec![0u32; 10_000];
//! corpus.fill(&mut stream);
//! let best_loss = corpus.entropy_rate_nats(); // below corpus.uniform_nats() = ln 64
//!
//! let (b, t) = (4, 32);
//! let mut windows = TokenWindows::new(stream, t, 1)?;
//! let (mut inputs, mut targets) = (vec![0; b * t], vec![0; b * t]);
//! windows.next_batch(b, &mut inputs, &mut targets)?;
//! assert_eq!(inputs[1], targets[0]);
//! # assert!(best_loss > 0.0 && best_loss < corpus.uniform_nats());
//! # Ok::<(), data::DataError>(())
//! ```

pub mod batch;
pub mod bench;
pub mod cache;
pub mod corpus;
pub mod dataset;
pub mod error;
pub mod fsread;
pub mod loader;
pub mod manifest;
pub mod prepare;
#[cfg(feature = "s3")]
mod remote;
mod rng;
pub mod sampler;
pub mod shard;
pub mod stress;
pub mod synth;
pub mod text;
pub mod tokenizer;
pub mod verify;

pub use batch::{TokenWindows, validate_ids};
pub use cache::{CacheConfig, FetchStats};
pub use corpus::{MarkovCorpus, TextCorpus};
pub use dataset::Dataset;
pub use error::{DataError, Result};
pub use loader::{Batch, Loader, LoaderConfig, LoaderMetrics, LoaderState, Prefetch};
pub use manifest::{MANIFEST_FILE, Manifest, ShardEntry};
pub use prepare::{PrepareConfig, PrepareSummary, prepare};
pub use sampler::{RankShare, SampleRef, Sampler, SequenceSpace};
pub use shard::{Shard, ShardInfo, ShardWriter};
pub use text::{MAX_FILE_BYTES, load_tokens, load_tokens_capped};
pub use tokenizer::{
    ByteTokenizer, Gpt2Tokenizer, HfTokenizer, Tokenizer, TokenizerKind, TokenizerSpec,
};
pub use verify::{VerifyReport, verify_dataset, verify_dataset_with_progress};
