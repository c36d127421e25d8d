//! A rank's data file, `step-<N>.tmp/rank-<r>.safetensors`, and the [`RankWriter`] that
//! streams it.
//!
//! The file is a valid safetensors file: an 8-byte little-endian header length, a JSON header
//! (padded with spaces so the data starts on a 4 KiB boundary) naming every piece
//! `<tensor>[<begin>..<end>, ...]` with its dtype, its own shape and its data offsets, then the
//! pieces back to back in the order they were planned. Any safetensors reader can therefore open
//! a rank file and find a piece by name; Flotilla's reader goes through the manifest instead,
//! which records each piece's absolute byte range and chunk checksums.
//!
//! Because the header precedes the data, a writer is created with the rank's whole plan (every
//! tensor and slice it will write, in order): the plan fixes every offset up front, then the
//! pieces stream straight to the file. While writing, the writer hashes each
//! [`DEFAULT_CHUNK_BYTES`] chunk from the caller's buffer (the checksums the manifest records)
//! and asks the kernel to start writing back every [`WRITEBACK_KICK_BYTES`] written, so the
//! disk works while the rest is still being copied and the final fsync waits only for the tail.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{CkptError, Result, io_err};
use crate::fsio::{checksum_hex, fsync_dir, start_writeback};
use crate::header::HeaderEntry;
use crate::layout::{Slice, TensorMeta};
use crate::manifest::{COMMIT_FILE, DEFAULT_CHUNK_BYTES, Piece};
use crate::reader::{read_piece_range, step_dir_name};
use crate::writer::{FailPoint, tmp_dir_name};

/// Data in a rank file starts at a multiple of this (page and direct-I/O friendly).
pub const DATA_ALIGN: u64 = 4096;
/// Bytes written between two write-back requests to the kernel (`sync_file_range`).
pub const WRITEBACK_KICK_BYTES: u64 = 32 << 20;

/// Name of rank `rank`'s data file inside a step directory.
pub fn rank_file_name(rank: u32) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Name of a piece inside its rank file: the tensor name followed by the slice,
/// e.g. `layers.0.w[0..512, 0..4096]`.
pub fn piece_key(tensor: &str, slice: &Slice) -> String {
    format!("{tensor}{slice}")
}

/// One planned piece: what it is and where its bytes go.
#[derive(Debug, Clone)]
struct Planned {
    tensor: TensorMeta,
    slice: Slice,
    /// Absolute offset in the file.
    offset: u64,
    bytes: u64,
}

/// Checks a plan and lays it out: returns the header bytes (length prefix included, padded to
/// [`DATA_ALIGN`]) and each piece's absolute offset.
fn lay_out(
    step: u64,
    rank: u32,
    file: &str,
    plan: &[(&TensorMeta, &Slice)],
) -> Result<(Vec<u8>, Vec<Planned>)> {
    let serialize = |source| CkptError::Serialize {
        what: "rank file header",
        source,
    };
    let mut keys = HashSet::with_capacity(plan.len());
    let mut header = serde_json::Map::new();
    let mut planned = Vec::with_capacity(plan.len());
    let mut rel = 0u64;
    for (tensor, slice) in plan {
        slice.check_fits(&tensor.name, &tensor.shape)?;
        let bytes = slice.byte_size(tensor.dtype, &tensor.name)?;
        let bad = |reason: String| CkptError::Piece {
            step,
            tensor: tensor.name.clone(),
            file: file.to_string(),
            reason,
        };
        if bytes == 0 {
            return Err(bad(format!(
                "empty slice {slice}: tensors without elements need no pieces"
            )));
        }
        let key = piece_key(&tensor.name, slice);
        if !keys.insert(key.clone()) {
            return Err(bad(format!("slice {slice} planned twice")));
        }
        let entry = HeaderEntry::new(tensor.dtype, slice, rel, bytes);
        header.insert(key, serde_json::to_value(entry).map_err(serialize)?);
        planned.push(Planned {
            tensor: (*tensor).clone(),
            slice: (*slice).clone(),
            offset: rel,
            bytes,
        });
        rel += bytes;
    }
    let metadata: BTreeMap<&str, String> = [
        ("format", "flotilla-ckpt".to_string()),
        ("step", step.to_string()),
        ("rank", rank.to_string()),
    ]
    .into();
    header.insert("__metadata__".into(), serde_json::json!(metadata));
    let mut json = serde_json::to_vec(&header).map_err(serialize)?;
    let data_start = (8 + json.len() as u64).next_multiple_of(DATA_ALIGN);
    json.resize((data_start - 8) as usize, b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    for p in &mut planned {
        p.offset += data_start;
    }
    Ok((bytes, planned))
}

/// Refuses to write a step whose commit marker already exists.
pub(crate) fn ensure_not_committed(root: &Path, step: u64) -> Result<()> {
    let marker = root.join(step_dir_name(step)).join(COMMIT_FILE);
    if std::fs::symlink_metadata(marker).is_ok() {
        return Err(CkptError::AlreadyCommitted {
            step,
            dir: root.to_path_buf(),
        });
    }
    Ok(())
}

/// Writes one rank's pieces of one step into its own safetensors file,
/// `step-<N>.tmp/rank-<r>.safetensors`, in the order of the plan given to [`RankWriter::create`].
#[derive(Debug)]
pub struct RankWriter {
    step: u64,
    rank: u32,
    dir: PathBuf,
    file_name: String,
    file: File,
    plan: Vec<Planned>,
    pieces: Vec<Piece>,
    /// Bytes written so far (header included).
    written: u64,
    /// End of the last range handed to [`start_writeback`].
    kicked: u64,
    readback: bool,
    fail: Option<FailPoint>,
    poisoned: bool,
}

impl RankWriter {
    /// Creates (truncating) this rank's data file in the step's staging directory and writes its
    /// header; `plan` lists every piece the rank will write, in order.
    pub fn create(
        root: &Path,
        step: u64,
        rank: u32,
        plan: &[(&TensorMeta, &Slice)],
    ) -> Result<Self> {
        ensure_not_committed(root, step)?;
        let file_name = rank_file_name(rank);
        let (header, plan) = lay_out(step, rank, &file_name, plan)?;
        let dir = root.join(tmp_dir_name(step));
        std::fs::create_dir_all(&dir).map_err(io_err("create dir", &dir))?;
        let path = dir.join(&file_name);
        let mut file = File::create(&path).map_err(io_err("create", &path))?;
        file.write_all(&header).map_err(io_err("write", &path))?;
        Ok(RankWriter {
            step,
            rank,
            dir,
            file_name,
            file,
            pieces: Vec::with_capacity(plan.len()),
            plan,
            written: header.len() as u64,
            kicked: 0,
            readback: false,
            fail: None,
            poisoned: false,
        })
    }

    /// Writes every piece of `pieces` (tensor, slice, row-major bytes) with one writer and
    /// finishes it: the one-call form of [`RankWriter::create`], [`RankWriter::write_piece`] and
    /// [`RankWriter::finish`].
    pub fn write_all(
        root: &Path,
        step: u64,
        rank: u32,
        pieces: &[(&TensorMeta, &Slice, &[u8])],
    ) -> Result<Vec<Piece>> {
        let plan: Vec<_> = pieces.iter().map(|(t, s, _)| (*t, *s)).collect();
        let mut w = RankWriter::create(root, step, rank, &plan)?;
        for (t, s, data) in pieces {
            w.write_piece(t, s, data)?;
        }
        w.finish()
    }

    /// Arms a fail point (only [`FailPoint::MidPiece`] concerns a rank writer).
    pub fn with_fail_point(mut self, point: FailPoint) -> Self {
        self.fail = Some(point);
        self
    }

    /// After fsync, also read every piece back from the file and check it against the
    /// checksums taken from the caller's buffers (off by default: the checksums are taken from
    /// the source bytes and every load verifies them, and a read-back served by the page cache
    /// proves little about the disk).
    pub fn with_readback(mut self, readback: bool) -> Self {
        self.readback = readback;
        self
    }

    fn path(&self) -> PathBuf {
        self.dir.join(&self.file_name)
    }

    /// Writes the next planned piece: `data` holds the elements of `slice` of `tensor`,
    /// row-major, and must match the next entry of the plan.
    pub fn write_piece(&mut self, tensor: &TensorMeta, slice: &Slice, data: &[u8]) -> Result<()> {
        if self.poisoned {
            return Err(CkptError::WriterPoisoned {
                rank: self.rank,
                step: self.step,
            });
        }
        let index = self.pieces.len();
        let Some(next) = self.plan.get(index) else {
            return Err(self.off_plan(tensor, format!("slice {slice} is beyond the plan")));
        };
        if next.tensor != *tensor || next.slice != *slice {
            let reason = format!(
                "slice {slice} written where the plan has {:?} slice {}",
                next.tensor.name, next.slice
            );
            return Err(self.off_plan(tensor, reason));
        }
        if next.bytes != data.len() as u64 {
            return Err(CkptError::BufferSize {
                what: "piece data",
                expected: next.bytes,
                actual: data.len() as u64,
            });
        }
        let offset = next.offset;
        if self.fail == Some(FailPoint::MidPiece) {
            self.poisoned = true;
            let path = self.path();
            self.file
                .write_all(&data[..data.len() / 2])
                .map_err(io_err("write", &path))?;
            return Err(CkptError::InjectedFailure {
                point: FailPoint::MidPiece,
                step: self.step,
            });
        }
        let mut chunks =
            Vec::with_capacity(Piece::chunk_count(next.bytes, DEFAULT_CHUNK_BYTES) as usize);
        for chunk in data.chunks(DEFAULT_CHUNK_BYTES as usize) {
            chunks.push(checksum_hex(chunk));
            if let Err(e) = self.file.write_all(chunk) {
                self.poisoned = true;
                return Err(io_err("write", &self.path())(e));
            }
            self.written += chunk.len() as u64;
            if self.written - self.kicked >= WRITEBACK_KICK_BYTES {
                start_writeback(&self.file, self.kicked, self.written - self.kicked);
                self.kicked = self.written;
            }
        }
        self.pieces.push(Piece {
            tensor: tensor.name.clone(),
            file: self.file_name.clone(),
            offset,
            bytes: data.len() as u64,
            slice: slice.clone(),
            chunks,
        });
        Ok(())
    }

    fn off_plan(&mut self, tensor: &TensorMeta, reason: String) -> CkptError {
        self.poisoned = true;
        CkptError::Piece {
            step: self.step,
            tensor: tensor.name.clone(),
            file: self.file_name.clone(),
            reason,
        }
    }

    /// Makes the file durable (fsync of file and directory; with
    /// [`RankWriter::with_readback`], reads every piece back and checks it) and returns this
    /// rank's piece list for [`crate::commit`]. Every planned piece must have been written.
    pub fn finish(self) -> Result<Vec<Piece>> {
        if self.poisoned {
            return Err(CkptError::WriterPoisoned {
                rank: self.rank,
                step: self.step,
            });
        }
        if let Some(missing) = self.plan.get(self.pieces.len()) {
            return Err(CkptError::Piece {
                step: self.step,
                tensor: missing.tensor.name.clone(),
                file: self.file_name.clone(),
                reason: format!(
                    "slice {} planned but never written ({} of {} pieces written)",
                    missing.slice,
                    self.pieces.len(),
                    self.plan.len()
                ),
            });
        }
        let path = self.path();
        self.file.sync_all().map_err(io_err("fsync", &path))?;
        fsync_dir(&self.dir)?;
        if self.readback {
            for piece in &self.pieces {
                read_piece_range(
                    &self.dir,
                    self.step,
                    piece,
                    DEFAULT_CHUNK_BYTES,
                    0..piece.bytes,
                )?;
            }
        }
        Ok(self.pieces)
    }
}
