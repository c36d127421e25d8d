//! Finding input files: paths, globs and directories, each file with its format and
//! compression.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::compress::Compression;
use crate::error::{DataError, Result};

/// How an input file's bytes hold documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputFormat {
    /// Plain UTF-8 text, split into documents as [`TextDocs`] says (`.txt`, `.text`, `.md`).
    Text,
    /// JSON Lines: one object per line, its text in a named string field (`.jsonl`, `.json`,
    /// `.ndjson`).
    Jsonl,
    /// Apache Parquet: one document per row of a named string column (`.parquet`; needs the
    /// `parquet` feature).
    Parquet,
}

impl InputFormat {
    /// Every format, in the order their names are listed in errors.
    pub const ALL: [InputFormat; 3] = [InputFormat::Text, InputFormat::Jsonl, InputFormat::Parquet];

    /// The name `--format` accepts.
    pub const fn name(self) -> &'static str {
        match self {
            InputFormat::Text => "text",
            InputFormat::Jsonl => "jsonl",
            InputFormat::Parquet => "parquet",
        }
    }

    /// The format a file name's extension implies (case-insensitive), if any. A compression
    /// extension is looked through: `a.jsonl.gz` and `a.txt.zst` are JSON Lines and text
    /// (see [`Compression::from_path`]).
    pub fn from_path(path: &Path) -> Option<InputFormat> {
        let ext = Compression::inner_name(path)?
            .extension()?
            .to_str()?
            .to_ascii_lowercase();
        match ext.as_str() {
            "txt" | "text" | "md" => Some(InputFormat::Text),
            "jsonl" | "json" | "ndjson" => Some(InputFormat::Jsonl),
            "parquet" => Some(InputFormat::Parquet),
            _ => None,
        }
    }
}

impl fmt::Display for InputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for InputFormat {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self> {
        InputFormat::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| DataError::InvalidOption {
                option: "--format",
                value: s.to_string(),
                requirement: format!(
                    "one of {}",
                    InputFormat::ALL.map(InputFormat::name).join(", ")
                ),
            })
    }
}

/// Where one plain-text document ends and the next begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TextDocs {
    /// The whole file is one document.
    File,
    /// Every non-empty line is a document (its line terminator dropped).
    Line,
    /// Documents are separated by one or more blank (empty or whitespace-only) lines; a
    /// document's lines are joined with `\n`. The default: it suits prose, Markdown and most
    /// corpora distributed as text.
    #[default]
    Paragraph,
}

impl TextDocs {
    /// Every mode, in the order their names are listed in errors.
    pub const ALL: [TextDocs; 3] = [TextDocs::File, TextDocs::Line, TextDocs::Paragraph];

    /// The name `--text-docs` accepts.
    pub const fn name(self) -> &'static str {
        match self {
            TextDocs::File => "file",
            TextDocs::Line => "line",
            TextDocs::Paragraph => "paragraph",
        }
    }
}

impl fmt::Display for TextDocs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TextDocs {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self> {
        TextDocs::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| DataError::InvalidOption {
                option: "--text-docs",
                value: s.to_string(),
                requirement: format!("one of {}", TextDocs::ALL.map(TextDocs::name).join(", ")),
            })
    }
}

/// One input file and the format it is read in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputFile {
    /// The file.
    pub path: PathBuf,
    /// Its format: `--format` if given, else from its extension (the one before a
    /// compression extension).
    pub format: InputFormat,
    /// How the file as a whole is compressed: always from its last extension, also under
    /// `--format`.
    pub compression: Compression,
    /// Its size in bytes when it was found (for progress).
    pub bytes: u64,
}

/// Expands `inputs` into files, in order: each entry in turn, and within a glob or directory
/// the files sorted by path, so the same inputs always give the same dataset.
///
/// - An existing directory is walked recursively. Hidden files and directories (name starting
///   with `.`) are skipped, and so are files whose extension names no format (so a directory
///   may hold README files or a previous dataset's shards), even when `format` is given.
/// - An existing file is taken as is; its format is `format`, else its extension's.
/// - A `.gz` or `.zst` file is read decompressed; its format is `format`, else the extension
///   before the compression one (`a.jsonl.gz`), and such files are found in directories too.
/// - Anything else is a glob pattern (`glob` crate syntax); directories it matches are walked
///   as above, and matched files are taken as explicit files.
///
/// A file named twice (by two patterns) is read once, at its first position.
///
/// # Errors
/// [`DataError::NoInputFiles`] for an empty list; [`DataError::BadInput`] for an entry that is
/// not a file, directory or valid glob, or that matches no file; [`DataError::UnknownFormat`]
/// for an explicit file with no recognised extension and no `format`;
/// [`DataError::BadInputFile`] for a Parquet file compressed as a whole (Parquet compresses
/// its pages itself, and its reader needs to seek); [`DataError::Io`] for an unreadable
/// directory.
pub fn discover(inputs: &[String], format: Option<InputFormat>) -> Result<Vec<InputFile>> {
    if inputs.is_empty() {
        return Err(DataError::NoInputFiles);
    }
    let mut files: Vec<InputFile> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for pattern in inputs {
        let mut found = Vec::new();
        let path = Path::new(pattern);
        if path.is_dir() {
            walk(path, &mut found)?;
        } else if path.is_file() {
            found.push((path.to_path_buf(), true));
        } else {
            expand_glob(pattern, &mut found)?;
        }
        let mut accepted = 0;
        for (path, explicit) in found {
            let format = match (format, InputFormat::from_path(&path)) {
                (_, None) if !explicit => continue,
                (Some(f), _) | (None, Some(f)) => f,
                (None, None) => {
                    return Err(DataError::UnknownFormat {
                        extension: extension_of(&path),
                        path,
                    });
                }
            };
            let compression = Compression::from_path(&path);
            if format == InputFormat::Parquet && compression != Compression::None {
                return Err(DataError::BadInputFile {
                    path,
                    problem: format!(
                        "a Parquet file compressed as a whole ({compression}) cannot be read: \
                         Parquet compresses its own pages; decompress the file first"
                    ),
                });
            }
            let bytes = std::fs::metadata(&path)
                .map_err(|source| DataError::Io {
                    path: path.clone(),
                    source,
                })?
                .len();
            accepted += 1;
            if seen.insert(path.clone()) {
                files.push(InputFile {
                    path,
                    format,
                    compression,
                    bytes,
                });
            }
        }
        if accepted == 0 {
            return Err(DataError::BadInput {
                pattern: pattern.clone(),
                problem: if path.is_dir() {
                    "the directory holds no .txt/.text/.md/.jsonl/.json/.ndjson/.parquet file \
                     (text and JSON Lines also as .gz or .zst)"
                        .into()
                } else {
                    "no such file, and no file matches it as a glob".into()
                },
            });
        }
    }
    Ok(files)
}

fn extension_of(path: &Path) -> String {
    path.extension()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn is_hidden(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
}

/// Appends every non-hidden file under `dir`, sorted by path, as `(path, explicit = false)`.
fn walk(dir: &Path, out: &mut Vec<(PathBuf, bool)>) -> Result<()> {
    let io = |source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .map_err(io)?;
    entries.sort();
    for entry in entries {
        if is_hidden(&entry) {
            continue;
        }
        if entry.is_dir() {
            walk(&entry, out)?;
        } else if entry.is_file() {
            out.push((entry, false));
        }
    }
    Ok(())
}

fn expand_glob(pattern: &str, out: &mut Vec<(PathBuf, bool)>) -> Result<()> {
    let bad = |problem: String| DataError::BadInput {
        pattern: pattern.to_string(),
        problem,
    };
    let paths = glob::glob(pattern).map_err(|e| bad(format!("not a valid glob: {e}")))?;
    let mut matched = Vec::new();
    for entry in paths {
        let path =
            entry.map_err(|e| bad(format!("cannot read {}: {}", e.path().display(), e.error())))?;
        if !is_hidden(&path) {
            matched.push(path);
        }
    }
    matched.sort();
    for path in matched {
        if path.is_dir() {
            walk(&path, out)?;
        } else if path.is_file() {
            out.push((path, true));
        }
    }
    Ok(())
}
