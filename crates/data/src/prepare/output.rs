//! The output directory: clearing an interrupted run's leftovers, and cutting shards.

use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};
use crate::manifest::MANIFEST_FILE;
use crate::shard::{EXTENSION, ShardInfo, ShardWriter};

/// File name of shard `i`: `shard-00000.fts`, `shard-00001.fts`, ...
pub fn shard_file_name(i: usize) -> String {
    format!("shard-{i:05}.{EXTENSION}")
}

/// Whether `name` is a file `prepare` writes: a shard, a shard's or the manifest's temporary,
/// or (`with_manifest`) the manifest itself. Nothing else is ever deleted.
fn is_ours(name: &str, with_manifest: bool) -> bool {
    let shard = |n: &str| {
        n.strip_prefix("shard-")
            .and_then(|rest| rest.strip_suffix(&format!(".{EXTENSION}")))
            .is_some_and(|digits| digits.len() >= 5 && digits.bytes().all(|b| b.is_ascii_digit()))
    };
    let tmp_of_shard = name.strip_suffix(".tmp").is_some_and(shard);
    shard(name)
        || tmp_of_shard
        || name == format!("{MANIFEST_FILE}.tmp")
        || (with_manifest && name == MANIFEST_FILE)
}

/// Whether `path` is a file of the dataset being written to `out_dir` (a shard, temporary or
/// manifest), so an output directory inside an input directory is not read back as input.
pub(crate) fn is_output_file(out_dir: &Path, path: &Path) -> bool {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return false;
    };
    let same_dir = match (parent.canonicalize(), out_dir.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    same_dir && is_ours(&name.to_string_lossy(), true)
}

/// Makes `dir` ready for a new dataset and returns how many old files were removed.
///
/// `dir` is created if needed. Without a manifest, it holds at most an interrupted run's
/// leftovers: those are removed. With a manifest, the dataset is replaced only when `force`
/// is set: the manifest goes first (so a crash part-way leaves a directory that reads as
/// interrupted, never as a dataset with missing shards), then its shards. Files `prepare`
/// does not write (see the shard naming in [`shard_file_name`]) are never touched.
///
/// # Errors
/// [`DataError::DatasetExists`] for a manifest without `force`; [`DataError::Io`] naming the
/// directory or file that could not be created, listed or removed.
pub fn prepare_output_dir(dir: &Path, force: bool) -> Result<usize> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let manifest = dir.join(MANIFEST_FILE);
    let mut removed = 0;
    if manifest.exists() {
        if !force {
            return Err(DataError::DatasetExists {
                dir: dir.to_path_buf(),
            });
        }
        std::fs::remove_file(&manifest).map_err(io(&manifest))?;
        removed += 1;
    }
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        if entry.file_type().map_err(io(&entry.path()))?.is_file() {
            names.push(entry.file_name());
        }
    }
    for name in names {
        if is_ours(&name.to_string_lossy(), false) {
            let path = dir.join(&name);
            std::fs::remove_file(&path).map_err(io(&path))?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Writes documents into consecutive shards of about a target size.
///
/// A document is never split across shards: a shard is closed once its token bytes reach the
/// target, so shards run over the target by at most one document.
pub(crate) struct Sharder {
    dir: PathBuf,
    vocab: u32,
    tokenizer: String,
    target: u64,
    current: Option<ShardWriter>,
    done: Vec<ShardInfo>,
}

impl Sharder {
    pub(crate) fn new(dir: &Path, vocab: u32, tokenizer: &str, target: u64) -> Self {
        Sharder {
            dir: dir.to_path_buf(),
            vocab,
            tokenizer: tokenizer.to_string(),
            target: target.max(1),
            current: None,
            done: Vec::new(),
        }
    }

    /// Appends one document's ids, opening and closing shards as needed.
    pub(crate) fn push(&mut self, ids: &[u32]) -> Result<()> {
        let writer = match self.current.as_mut() {
            Some(w) => w,
            None => {
                let path = self.dir.join(shard_file_name(self.done.len()));
                self.current
                    .insert(ShardWriter::create(&path, self.vocab, &self.tokenizer)?)
            }
        };
        writer.push_doc(ids)?;
        if writer.token_bytes() >= self.target {
            self.close()?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if let Some(writer) = self.current.take() {
            self.done.push(writer.finish()?);
        }
        Ok(())
    }

    /// Shards finished so far.
    pub(crate) fn finished(&self) -> &[ShardInfo] {
        &self.done
    }

    /// Closes the last shard and returns them all.
    pub(crate) fn finish(mut self) -> Result<Vec<ShardInfo>> {
        self.close()?;
        Ok(self.done)
    }
}
