//! Reading and writing safetensors files, and Flotilla's own checkpoint
//! format on top of them.
//!
//! A Flotilla checkpoint is a safetensors file holding every tensor of the
//! flat parameter layout under its Flotilla name (`wte`, `h.0.attn.qkv.weight`,
//! ...) in Flotilla's shapes, as little-endian f32, with the model config in
//! the file's `__metadata__` under `flotilla.*` keys (see
//! [`config_to_metadata`]). Every read checks the tensor's presence, shape and
//! dtype and names the tensor and file on failure; f16 and bf16 tensors are
//! widened to f32 on read.
mod mapped;
mod metadata;
#[cfg(test)]
mod tests;

pub use metadata::{CONFIG_PREFIX, config_from_metadata, config_to_metadata};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layout::Layout;
use mapped::Bytes;
use metadata::config_diff;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

/// File name [`write_reference`] writes inside its directory.
pub const REFERENCE_FILE: &str = "flotilla_reference.safetensors";

/// An [`ModelError::Io`] for `path`.
pub(crate) fn io_err(path: impl Into<String>, reason: impl Into<String>) -> ModelError {
    ModelError::Io {
        path: path.into(),
        reason: reason.into(),
    }
}

/// The display form of a path used in errors.
pub(crate) fn show(path: &Path) -> String {
    path.display().to_string()
}

/// A shape as `[a, b]`.
fn fmt_shape(shape: &[usize]) -> String {
    format!("{shape:?}")
}

fn describe(e: &SafeTensorError, len: usize) -> String {
    match e {
        SafeTensorError::HeaderTooSmall => {
            format!("not a safetensors file: {len} bytes is too short for the 8-byte header length")
        }
        SafeTensorError::InvalidHeaderLength => {
            format!(
                "truncated safetensors file: the declared header is longer than the file ({len} bytes)"
            )
        }
        SafeTensorError::MetadataIncompleteBuffer => format!(
            "truncated or padded safetensors file: the header's tensors do not cover exactly the file's {len} bytes"
        ),
        other => format!("invalid safetensors file: {other}"),
    }
}

/// A safetensors file, memory-mapped (opened from a path) or in memory, with
/// its header parsed and checked (offsets contiguous, sizes matching shapes
/// and dtypes, file length matching the header).
pub struct TensorFile {
    path: String,
    bytes: Bytes,
    data_start: usize,
    meta: Metadata,
}

impl std::fmt::Debug for TensorFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorFile")
            .field("path", &self.path)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// Largest safetensors file opened (1 TiB), checked before mapping or reading.
pub const MAX_TENSOR_FILE_BYTES: u64 = 1 << 40;

impl TensorFile {
    /// Map and parse the file at `path`: a regular file of at most [`MAX_TENSOR_FILE_BYTES`]
    /// (a FIFO or a link to a device is refused). The file is memory-mapped read-only, not
    /// read whole: tensors are paged in as they are read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::parse(show(path), mapped::map_file(path)?)
    }

    /// Parse an in-memory safetensors image; `label` names it in errors.
    pub fn from_bytes(label: impl Into<String>, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(label.into(), Bytes::Owned(bytes))
    }

    fn parse(path: String, bytes: Bytes) -> Result<Self> {
        let (n, meta) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| io_err(&path, describe(&e, bytes.len())))?;
        Ok(Self {
            path,
            data_start: 8 + n,
            bytes,
            meta,
        })
    }

    /// The path (or label) it was read from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The value of metadata key `key`, if any.
    pub fn metadata_value(&self, key: &str) -> Option<&str> {
        self.meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(key))
            .map(String::as_str)
    }

    /// All metadata, sorted by key.
    pub fn metadata(&self) -> BTreeMap<String, String> {
        self.meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    /// The tensor names, in file order.
    pub fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }

    /// Whether a tensor called `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.meta.info(name).is_some()
    }

    fn info(&self, name: &str) -> Result<&safetensors::tensor::TensorInfo> {
        self.meta
            .info(name)
            .ok_or_else(|| io_err(&self.path, format!("tensor `{name}` is missing")))
    }

    /// The shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.info(name)?.shape)
    }

    /// The dtype of tensor `name`, as safetensors spells it (`F32`, `BF16`, ...).
    pub fn dtype(&self, name: &str) -> Result<String> {
        Ok(self.info(name)?.dtype.to_string())
    }

    fn raw(&self, name: &str) -> Result<(Dtype, &[usize], &[u8])> {
        let info = self.info(name)?;
        let (s, e) = info.data_offsets;
        // read_metadata checked that the offsets tile the data exactly.
        let data = self
            .bytes
            .get(self.data_start + s..self.data_start + e)
            .ok_or_else(|| {
                io_err(
                    &self.path,
                    format!("tensor `{name}`: data offsets {s}..{e} outside the file"),
                )
            })?;
        Ok((info.dtype, &info.shape, data))
    }

    /// Tensor `name` as f32 (F32 as is; F16 and BF16 widened exactly), with its shape.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (dtype, shape, data) = self.raw(name)?;
        let values = match dtype {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            other => {
                return Err(io_err(
                    &self.path,
                    format!(
                        "tensor `{name}`: dtype {other} is not a float (expected F32, F16 or BF16)"
                    ),
                ));
            }
        };
        Ok((shape.to_vec(), values))
    }

    /// Tensor `name` as f32, which must have shape `shape`.
    pub fn read_f32_shaped(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let got = self.shape(name)?;
        if got != shape {
            return Err(io_err(
                &self.path,
                format!(
                    "tensor `{name}`: shape {} in the file, expected {}",
                    fmt_shape(got),
                    fmt_shape(shape)
                ),
            ));
        }
        Ok(self.read_f32(name)?.1)
    }

    /// Tensor `name` as token ids (I32, I64, U32 or U64 holding values in
    /// `0..=u32::MAX`), with its shape.
    pub fn read_ids(&self, name: &str) -> Result<(Vec<usize>, Vec<u32>)> {
        let (dtype, shape, data) = self.raw(name)?;
        let wide: Vec<i128> = match dtype {
            Dtype::I32 => data
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i128)
                .collect(),
            Dtype::U32 => data
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i128)
                .collect(),
            Dtype::I64 => data
                .chunks_exact(8)
                .map(|c| {
                    i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as i128
                })
                .collect(),
            Dtype::U64 => data
                .chunks_exact(8)
                .map(|c| {
                    u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as i128
                })
                .collect(),
            other => {
                return Err(io_err(
                    &self.path,
                    format!(
                        "tensor `{name}`: dtype {other} is not an integer (expected I32, I64, U32 or U64)"
                    ),
                ));
            }
        };
        let mut ids = Vec::with_capacity(wide.len());
        for (pos, &v) in wide.iter().enumerate() {
            let id = u32::try_from(v).map_err(|_| {
                io_err(
                    &self.path,
                    format!("tensor `{name}`: value {v} at position {pos} is not a valid token id"),
                )
            })?;
            ids.push(id);
        }
        Ok((shape.to_vec(), ids))
    }

    /// Every entry of `layout`, read from tensors named `prefix + entry.name`
    /// (shape-checked), into one flat buffer in layout order. Other tensors
    /// in the file are ignored.
    pub fn read_flat(&self, layout: &Layout, prefix: &str) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; layout.total];
        for e in &layout.entries {
            let v = self.read_f32_shaped(&format!("{prefix}{}", e.name), &e.shape)?;
            out[e.range()].copy_from_slice(&v);
        }
        Ok(out)
    }

    /// The model config stored in the metadata by [`config_to_metadata`],
    /// or `None` when the file has no `flotilla.layers` key.
    pub fn config(&self) -> Result<Option<ModelConfig>> {
        if self
            .metadata_value(&format!("{CONFIG_PREFIX}layers"))
            .is_none()
        {
            return Ok(None);
        }
        config_from_metadata(&self.path, |k| self.metadata_value(k)).map(Some)
    }
}

/// Builds a safetensors file tensor by tensor, then writes it.
#[derive(Debug)]
pub struct TensorWriter {
    path: PathBuf,
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    names: HashSet<String>,
    metadata: BTreeMap<String, String>,
}

impl TensorWriter {
    /// A writer that [`TensorWriter::write`]s to `path`.
    pub fn new(path: impl AsRef<Path>) -> Self {
        Self {
            path: path.as_ref().to_path_buf(),
            tensors: Vec::new(),
            names: HashSet::new(),
            metadata: BTreeMap::new(),
        }
    }

    /// Set metadata key `key` to `value`.
    pub fn set_metadata(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.metadata.insert(key.into(), value.into());
    }

    /// Set every `(key, value)` pair of `md`.
    pub fn extend_metadata(&mut self, md: BTreeMap<String, String>) {
        self.metadata.extend(md);
    }

    fn push(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        count: usize,
        bytes: Vec<u8>,
    ) -> Result<()> {
        let numel: usize = shape.iter().product();
        if numel != count {
            return Err(io_err(
                show(&self.path),
                format!(
                    "tensor `{name}`: shape {} holds {numel} elements but {count} were given",
                    fmt_shape(shape)
                ),
            ));
        }
        if name == "__metadata__" {
            return Err(io_err(
                show(&self.path),
                "`__metadata__` is reserved and cannot name a tensor",
            ));
        }
        if !self.names.insert(name.to_string()) {
            return Err(io_err(
                show(&self.path),
                format!("tensor `{name}` added twice"),
            ));
        }
        self.tensors
            .push((name.to_string(), dtype, shape.to_vec(), bytes));
        Ok(())
    }

    /// Add an F32 tensor.
    pub fn add_f32(&mut self, name: &str, shape: &[usize], data: &[f32]) -> Result<()> {
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.push(name, Dtype::F32, shape, data.len(), bytes)
    }

    /// Add a BF16 tensor: each value rounded to the nearest bfloat16 (ties to even).
    pub fn add_bf16(&mut self, name: &str, shape: &[usize], data: &[f32]) -> Result<()> {
        let bytes = data
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
            .collect();
        self.push(name, Dtype::BF16, shape, data.len(), bytes)
    }

    /// Add token ids as an I64 tensor (PyTorch's index dtype).
    pub fn add_ids(&mut self, name: &str, shape: &[usize], ids: &[u32]) -> Result<()> {
        let bytes = ids
            .iter()
            .flat_map(|&x| i64::from(x).to_le_bytes())
            .collect();
        self.push(name, Dtype::I64, shape, ids.len(), bytes)
    }

    /// Write the file: through a temporary file in the same directory,
    /// flushed to disk and renamed into place, so a reader never sees a
    /// partial file. Tensors are stored widest dtype first (so every tensor's
    /// data is aligned to its element size), in insertion order within a dtype.
    pub fn write(&self) -> Result<()> {
        let path = show(&self.path);
        let mut order: Vec<&(String, Dtype, Vec<usize>, Vec<u8>)> = self.tensors.iter().collect();
        order.sort_by_key(|t| std::cmp::Reverse(t.1.bitsize()));
        let mut header = serde_json::Map::new();
        if !self.metadata.is_empty() {
            header.insert("__metadata__".into(), serde_json::json!(self.metadata));
        }
        let mut at = 0usize;
        for (name, dtype, shape, bytes) in &order {
            let info = serde_json::json!({ "dtype": dtype.to_string(), "shape": shape, "data_offsets": [at, at + bytes.len()] });
            header.insert(name.clone(), info);
            at += bytes.len();
        }
        let mut head = serde_json::to_vec(&serde_json::Value::Object(header))
            .map_err(|e| io_err(&path, format!("cannot encode the header: {e}")))?;
        // Pad with spaces so the data starts 8-byte aligned.
        head.resize(head.len().next_multiple_of(8), b' ');

        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = self
            .path
            .with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        let result = (|| -> std::io::Result<()> {
            let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp)?);
            f.write_all(&(head.len() as u64).to_le_bytes())?;
            f.write_all(&head)?;
            for t in &order {
                f.write_all(&t.3)?;
            }
            f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        })();
        result.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io_err(&path, format!("cannot write: {e}"))
        })
    }
}

/// Check that `cfg` is valid and `layout` is its layout.
pub(crate) fn check_layout(path: &str, cfg: &ModelConfig, layout: &Layout) -> Result<()> {
    cfg.validate()?;
    if layout.entries != Layout::new(cfg).entries {
        return Err(io_err(
            path,
            "the layout passed does not match the config's layout",
        ));
    }
    Ok(())
}

/// Check that `layout` is `cfg`'s layout and `params` fills it.
pub(crate) fn check_params(
    path: &str,
    cfg: &ModelConfig,
    layout: &Layout,
    params: &[f32],
) -> Result<()> {
    check_layout(path, cfg, layout)?;
    if params.len() != layout.total {
        return Err(ModelError::Shape {
            what: "params",
            expected: layout.total,
            got: params.len(),
        });
    }
    Ok(())
}

/// Save `params` (laid out by `layout`, which must be `cfg`'s) to `path`
/// under Flotilla's tensor names and shapes, with `cfg` in the metadata
/// (plus `format = pt`, which PyTorch tooling expects).
pub fn save_flotilla(
    path: impl AsRef<Path>,
    cfg: &ModelConfig,
    layout: &Layout,
    params: &[f32],
) -> Result<()> {
    let path = path.as_ref();
    check_params(&show(path), cfg, layout, params)?;
    let mut w = TensorWriter::new(path);
    w.set_metadata("format", "pt");
    w.extend_metadata(config_to_metadata(cfg));
    for e in &layout.entries {
        w.add_f32(&e.name, &e.shape, &params[e.range()])?;
    }
    w.write()
}

/// Load the parameters of `cfg` (laid out by `layout`) from a Flotilla
/// safetensors file. If the file stores a config, it must equal `cfg`
/// (the error names the first differing field). Every layout tensor must be
/// present with its exact shape; tensors outside the layout (such as a
/// golden fixture's `grad.*`) are ignored.
pub fn load_flotilla(
    path: impl AsRef<Path>,
    cfg: &ModelConfig,
    layout: &Layout,
) -> Result<Vec<f32>> {
    let path = path.as_ref();
    let f = TensorFile::open(path)?;
    if let Some((field, theirs, ours)) = f.config()?.and_then(|stored| config_diff(&stored, cfg)) {
        return Err(io_err(
            f.path(),
            format!(
                "saved for a different config: {field} is {theirs} in the file, {ours} requested"
            ),
        ));
    }
    check_layout(f.path(), cfg, layout)?;
    f.read_flat(layout, "")
}

/// Load a Flotilla safetensors file together with the config stored in its
/// metadata (an error if it has none).
pub fn load_flotilla_with_config(path: impl AsRef<Path>) -> Result<(ModelConfig, Vec<f32>)> {
    load_flotilla_file(&TensorFile::open(path)?)
}

/// [`load_flotilla_with_config`] of a file already read (and, say, its checksum verified).
pub fn load_flotilla_file(f: &TensorFile) -> Result<(ModelConfig, Vec<f32>)> {
    let cfg = f.config()?.ok_or_else(|| {
        io_err(
            f.path(),
            format!(
                "no model config in the metadata (key `{CONFIG_PREFIX}layers` missing); use load_flotilla with a config"
            ),
        )
    })?;
    let data_bytes = (f.bytes.len() - f.data_start) as u64;
    metadata::check_fits(f.path(), &cfg, f.meta.tensors().len(), data_bytes)?;
    let layout = Layout::new(&cfg);
    if layout.total as u64 > data_bytes / 4 {
        return Err(io_err(
            f.path(),
            format!(
                "the config in the metadata has {} parameters, the file holds {data_bytes} bytes",
                layout.total
            ),
        ));
    }
    let params = f.read_flat(&layout, "")?;
    Ok((cfg, params))
}

/// Write `dir/flotilla_reference.safetensors` ([`REFERENCE_FILE`]) holding
/// `tokens` as I64 of shape (batch, T) and `logits` as F32 of shape
/// (batch*T, V), for `scripts/hf_check.py` to compare a Hugging Face model
/// against. `tokens.len()` must be a multiple of `batch`, and `logits.len()`
/// a multiple of `tokens.len()`.
pub fn write_reference(
    dir: impl AsRef<Path>,
    batch: usize,
    tokens: &[u32],
    logits: &[f32],
) -> Result<()> {
    let path = dir.as_ref().join(REFERENCE_FILE);
    let n = tokens.len();
    if batch == 0 || n == 0 || !n.is_multiple_of(batch) {
        return Err(io_err(
            show(&path),
            format!("{n} tokens do not split into {batch} sequences"),
        ));
    }
    if !logits.len().is_multiple_of(n) {
        return Err(io_err(
            show(&path),
            format!(
                "{} logits are not a whole number of rows for {n} tokens",
                logits.len()
            ),
        ));
    }
    let mut w = TensorWriter::new(&path);
    w.set_metadata("format", "pt");
    w.add_ids("tokens", &[batch, n / batch], tokens)?;
    w.add_f32("logits", &[n, logits.len() / n], logits)?;
    w.write()
}

/// Read back what [`write_reference`] wrote: `(batch, tokens, logits, vocab)`.
pub fn read_reference(dir: impl AsRef<Path>) -> Result<(usize, Vec<u32>, Vec<f32>, usize)> {
    let f = TensorFile::open(dir.as_ref().join(REFERENCE_FILE))?;
    let (ts, tokens) = f.read_ids("tokens")?;
    let (ls, logits) = f.read_f32("logits")?;
    if ts.len() != 2 || ls.len() != 2 || ls[0] != tokens.len() {
        return Err(io_err(
            f.path(),
            format!(
                "tokens {} and logits {} shapes do not match ((B, T) and (B*T, V))",
                fmt_shape(&ts),
                fmt_shape(&ls)
            ),
        ));
    }
    Ok((ts[0], tokens, logits, ls[1]))
}
