//! The bytes of a safetensors file: a read-only memory map of the file, or an in-memory image.
use std::path::Path;

use super::{MAX_TENSOR_FILE_BYTES, io_err, show};
use crate::error::Result;

/// The bytes of a [`super::TensorFile`]: a read-only mapping of the file, so a
/// multi-gigabyte shard is paged in tensor by tensor as it is read instead of
/// being copied whole into memory, or an in-memory image.
pub(super) enum Bytes {
    Owned(Vec<u8>),
    Mapped(memmap2::Mmap),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Owned(v) => v,
            Bytes::Mapped(m) => m,
        }
    }
}

/// Maps `path`: a regular file (a FIFO or a link to a device is refused) of at most
/// [`MAX_TENSOR_FILE_BYTES`].
pub(super) fn map_file(path: &Path) -> Result<Bytes> {
    let cannot = |e: &dyn std::fmt::Display| io_err(show(path), format!("cannot read: {e}"));
    let (file, size) = fsread::open_regular(path, fsread::Links::Follow).map_err(|e| cannot(&e))?;
    if size > MAX_TENSOR_FILE_BYTES {
        return Err(io_err(
            show(path),
            format!("{size} bytes is over the {MAX_TENSOR_FILE_BYTES}-byte cap"),
        ));
    }
    if size == 0 {
        // An empty file cannot be mapped; its parse error names it.
        return Ok(Bytes::Owned(Vec::new()));
    }
    // SAFETY: the mapping is read-only and private to this value; the file is a regular
    // file opened read-only. Its contents must not change while it is mapped: a weight
    // file being rewritten or truncated during a load is outside the contract (as for
    // every safetensors loader that maps, transformers' included) and faults the reader.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| cannot(&e))?;
    Ok(Bytes::Mapped(map))
}
