//! # flotilla-ckpt: distributed checkpoints
//!
//! A checkpoint is one directory per step under a root:
//!
//! ```text
//! root/
//!   step-100/            committed: has COMMIT
//!     rank-00000.safetensors   rank 0's pieces: a safetensors file, one entry per piece
//!     rank-00001.safetensors
//!     manifest.json      tensors, pieces (file, byte range, global slice, chunk xxh3-128s),
//!                        each rank file's header length and xxh3-128, state
//!     COMMIT             written last; records the manifest's length and xxh3-128
//!   step-200.tmp/        being written (or abandoned by a crash): invisible to readers
//!   LOCK                 the job using the directory (see [`DirLock`])
//! ```
//!
//! Every rank writes its own pieces with a [`RankWriter`], checksumming them as it goes; one
//! coordinator [`commit`]s once every rank has. Readers see only steps with a commit marker ([`list_committed`]);
//! [`open_latest`] verifies marker, manifest and (optionally) every piece, falls back to the
//! newest earlier step on any mismatch and reports what it rejected. [`Checkpoint::read_slice`]
//! serves any global slice of any tensor from whatever pieces overlap it, so a checkpoint saved
//! under one sharding loads under any other.
//!
//! [`AsyncSaver`] takes a rank's pieces into reused host buffers (the only pause the caller
//! sees) and writes them in the background.
//!
//! ```
//! use ckpt::{CheckpointMeta, DType, RankWriter, Slice, TensorMeta, Verify, commit, open_latest};
//!
//! let root = tempfile::tempdir()?;
//! let w = TensorMeta { name: "w".into(), dtype: DType::U8, shape: vec![4, 2] };
//! // Two ranks save row halves...
//! let mut pieces = Vec::new();
//! for rank in 0..2u8 {
//!     let rows = Slice::new(&[(2 * rank as u64, 2), (0, 2)]);
//!     let data = [4 * rank, 4 * rank + 1, 4 * rank + 2, 4 * rank + 3];
//!     pieces.extend(RankWriter::write_all(root.path(), 7, rank.into(), &[(&w, &rows, &data)])?);
//! }
//! let meta = CheckpointMeta {
//!     run_id: "demo".into(),
//!     world_size: 2,
//!     layout: serde_json::json!("rows"),
//!     config_hash: "0".into(),
//!     tensors: vec![w],
//!     state: serde_json::json!({"optimizer_step": 7}),
//! };
//! commit(root.path(), 7, pieces, meta)?;
//! // ...and one rank loads column 1 of every row.
//! let opened = open_latest(root.path(), Verify::AllPieces)?;
//! let col = opened.checkpoint.read_slice("w", &Slice::new(&[(0, 4), (1, 1)]))?;
//! assert_eq!(col, [1, 3, 5, 7]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod async_save;
pub mod bench;
pub mod convert;
pub mod error;
mod fsio;
pub mod handoff;
pub mod header;
pub mod layout;
pub mod lock;
pub mod manifest;
pub mod names;
pub mod policy;
pub mod rank_file;
pub mod reader;
#[cfg(feature = "s3")]
pub mod remote;
pub mod writer;

pub use async_save::{AfterWrite, AsyncSaver, SaveReport};
pub use convert::{rank_rows, reshard, reshard_with_progress};
pub use error::{CkptError, Result};
pub use fsio::{checksum_hex, start_writeback};
pub use header::{HeaderSum, MAX_HEADER_BYTES};
pub use layout::{DType, Extent, Slice, TensorMeta, copy_overlap, f32_bytes, f32_from_bytes};
pub use lock::DirLock;
pub use manifest::{CommitMarker, Manifest, Piece};
pub use policy::{GcMode, IntervalPlanner, PolicyError, Retention, gc};
pub use rank_file::{RankWriter, rank_file_name};
pub use reader::{
    Checkpoint, Opened, Rejected, StepCheck, Verify, list_committed, open_latest, quarantine,
    step_dir_name, verify_step,
};
pub use writer::{CheckpointMeta, FailPoint, commit, commit_with_fail_point, tmp_dir_name};
