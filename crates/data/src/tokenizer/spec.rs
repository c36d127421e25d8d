//! Naming a tokenizer on a command line: a built-in kind or a `tokenizer.json` path.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::{Tokenizer, TokenizerKind};
use crate::error::{DataError, Result};

/// A tokenizer as a user names it: `byte`, `gpt2`, or the path of a Hugging Face
/// `tokenizer.json` (loaded by [`super::HfTokenizer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSpec {
    /// A built-in tokenizer.
    Builtin(TokenizerKind),
    /// A `tokenizer.json` file.
    File(PathBuf),
}

impl TokenizerSpec {
    /// Builds the tokenizer. `eot` names the end-of-text token of a `tokenizer.json`; it must be
    /// `None` for the built-in kinds, whose end-of-text id is fixed.
    ///
    /// # Errors
    /// [`DataError::InvalidOption`] for `eot` with a built-in kind;
    /// As [`TokenizerKind::build`] or [`super::HfTokenizer::from_file`].
    pub fn build(&self, eot: Option<&str>) -> Result<Box<dyn Tokenizer + Send + Sync>> {
        match self {
            TokenizerSpec::Builtin(kind) => match eot {
                None => kind.build(),
                Some(token) => Err(DataError::InvalidOption {
                    option: "--eot",
                    value: token.to_string(),
                    requirement: format!(
                        "applies to a tokenizer.json only; the {kind} tokenizer's end-of-text id is fixed"
                    ),
                }),
            },
            TokenizerSpec::File(path) => build_file(path, eot),
        }
    }
}

fn build_file(path: &Path, eot: Option<&str>) -> Result<Box<dyn Tokenizer + Send + Sync>> {
    Ok(Box::new(super::HfTokenizer::from_file(path, eot)?))
}

impl fmt::Display for TokenizerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerSpec::Builtin(kind) => write!(f, "{kind}"),
            TokenizerSpec::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Parses a built-in kind's name (any case), else anything that looks like a file: a string
/// with a path separator, ending in `.json`, or naming an existing file.
impl FromStr for TokenizerSpec {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self> {
        if let Ok(kind) = s.parse::<TokenizerKind>() {
            return Ok(TokenizerSpec::Builtin(kind));
        }
        let path = Path::new(s.trim());
        let looks_like_file = s.contains(std::path::MAIN_SEPARATOR)
            || s.contains('/')
            || path.extension().is_some_and(|e| e == "json")
            || path.is_file();
        if looks_like_file {
            return Ok(TokenizerSpec::File(path.to_path_buf()));
        }
        Err(DataError::UnknownTokenizer {
            name: s.to_string(),
            accepted: format!(
                "{}, or the path of a tokenizer.json",
                TokenizerKind::ALL.map(TokenizerKind::name).join(", ")
            ),
        })
    }
}
