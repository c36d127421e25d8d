//! Reading documents out of input files: plain text and JSON Lines (Parquet is in `parquet.rs`).
//!
//! Every reader streams its file with bounded memory: lines are read at most `max_doc_bytes`
//! at a time, and a document that would grow past `max_doc_bytes` is cut at a line boundary
//! into several documents (a single line longer than the cap is cut at a character boundary).
//! A gzip or zstd file is decompressed on the way in ([`Decoded`]), and these bounds hold on
//! the decompressed bytes, so a highly compressible file cannot exhaust memory either.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use super::compress::{Compression, Decoded};
use super::inputs::TextDocs;
use crate::error::{DataError, Result};

/// A source of documents, one input file.
pub(crate) trait DocReader: Send {
    /// The next document's text, or `None` after the last one.
    fn next_doc(&mut self) -> Result<Option<String>>;
    /// Bytes of the file consumed so far (for progress).
    fn consumed(&self) -> u64;
    /// Records skipped so far: bad JSON Lines lines under `skip_bad_lines`, Parquet nulls.
    fn skipped(&self) -> u64;
    /// Documents cut into more than one because they exceeded the cap (pieces beyond the first).
    fn splits(&self) -> u64;
}

/// One piece of a line: the whole line, or a part of an over-long one.
struct Piece {
    /// Starts at the beginning of a line.
    at_line_start: bool,
    /// Ends its line (`term` says with which terminator).
    ends_line: bool,
    /// The line terminator removed from the end: `"\n"`, `"\r\n"` or `""`.
    term: &'static str,
}

/// Reads a file (decompressed) line by line, never holding more than `max` bytes of one line.
struct LineReader {
    inner: BufReader<Decoded>,
    max: usize,
    buf: Vec<u8>,
    /// Bytes of a character cut by the previous piece, to lead the next one.
    carry: Vec<u8>,
    at_line_start: bool,
    line: u64,
}

impl LineReader {
    fn open(path: &Path, compression: Compression, max: usize) -> Result<Self> {
        Ok(LineReader {
            inner: BufReader::with_capacity(1 << 20, Decoded::open(path, compression)?),
            max: max.max(8),
            buf: Vec::new(),
            carry: Vec::new(),
            at_line_start: true,
            line: 0,
        })
    }

    /// Bytes of the file read so far (compressed bytes for a compressed file).
    fn consumed(&self) -> u64 {
        self.inner.get_ref().file_bytes_read()
    }

    /// Reads the next piece into `self.buf` (terminator removed); `None` at end of file.
    fn next_piece(&mut self) -> Result<Option<Piece>> {
        self.buf.clear();
        self.buf.append(&mut self.carry);
        let limit = (self.max - self.buf.len()) as u64;
        let read = (&mut self.inner)
            .take(limit)
            .read_until(b'\n', &mut self.buf);
        let n = read.map_err(|source| self.inner.get_ref().error(source))?;
        if self.buf.is_empty() {
            return Ok(None);
        }
        let at_line_start = self.at_line_start;
        if at_line_start {
            self.line += 1;
        }
        let (ends_line, term) = if self.buf.ends_with(b"\r\n") {
            self.buf.truncate(self.buf.len() - 2);
            (true, "\r\n")
        } else if self.buf.ends_with(b"\n") {
            self.buf.pop();
            (true, "\n")
        } else if (n as u64) < limit {
            (true, "") // the last line, without a terminator
        } else {
            // Cut inside an over-long line: keep a character split at the cut for next time.
            if let Err(e) = std::str::from_utf8(&self.buf)
                && e.error_len().is_none()
            {
                self.carry.extend_from_slice(&self.buf[e.valid_up_to()..]);
                self.buf.truncate(e.valid_up_to());
            }
            (false, "")
        };
        self.at_line_start = ends_line;
        Ok(Some(Piece {
            at_line_start,
            ends_line,
            term,
        }))
    }
}

/// Gathers pieces of lines into documents according to a [`TextDocs`] mode and a size cap.
pub(crate) struct DocAccumulator {
    mode: TextDocs,
    max: usize,
    cur: String,
    ready: VecDeque<String>,
    splits: u64,
}

impl DocAccumulator {
    pub(crate) fn new(mode: TextDocs, max: usize) -> Self {
        DocAccumulator {
            mode,
            max: max.max(8),
            cur: String::new(),
            ready: VecDeque::new(),
            splits: 0,
        }
    }

    fn flush(&mut self) {
        if !self.cur.trim().is_empty() {
            self.ready.push_back(std::mem::take(&mut self.cur));
        }
        self.cur.clear();
    }

    fn push(&mut self, text: &str, piece: &Piece) {
        let whole_blank_line = piece.at_line_start && piece.ends_line && text.trim().is_empty();
        let (sep, end) = match self.mode {
            TextDocs::File => ("", piece.term),
            TextDocs::Line | TextDocs::Paragraph => {
                if whole_blank_line {
                    self.flush();
                    return;
                }
                let sep = if self.mode == TextDocs::Paragraph && piece.at_line_start {
                    "\n"
                } else {
                    ""
                };
                (sep, "")
            }
        };
        let sep = if self.cur.is_empty() { "" } else { sep };
        if !self.cur.is_empty() && self.cur.len() + sep.len() + text.len() + end.len() > self.max {
            self.flush();
            self.splits += 1;
            self.push_text("", text, end);
        } else {
            self.push_text(sep, text, end);
        }
        if self.mode == TextDocs::Line && piece.ends_line {
            self.flush();
        }
    }

    fn push_text(&mut self, sep: &str, text: &str, end: &str) {
        self.cur.push_str(sep);
        self.cur.push_str(text);
        self.cur.push_str(end);
    }

    fn finish(&mut self) {
        self.flush();
    }

    /// Cuts one over-long document (a JSON or Parquet value) as [`TextDocs::File`] would.
    pub(crate) fn split_long(text: &str, max: usize, splits: &mut u64) -> Vec<String> {
        let mut acc = DocAccumulator::new(TextDocs::File, max);
        for line in text.split_inclusive('\n') {
            let (body, term) = match line.strip_suffix("\r\n") {
                Some(b) => (b, "\r\n"),
                None => match line.strip_suffix('\n') {
                    Some(b) => (b, "\n"),
                    None => (line, ""),
                },
            };
            let mut rest = body;
            let mut at_line_start = true;
            loop {
                let mut cut = rest.len().min(acc.max);
                while !rest.is_char_boundary(cut) {
                    cut -= 1;
                }
                let (head, tail) = rest.split_at(cut);
                let ends_line = tail.is_empty();
                let piece = Piece {
                    at_line_start,
                    ends_line,
                    term: if ends_line { term } else { "" },
                };
                acc.push(head, &piece);
                if ends_line {
                    break;
                }
                rest = tail;
                at_line_start = false;
            }
        }
        acc.finish();
        *splits += acc.splits;
        acc.ready.into()
    }
}

/// Plain text, cut into documents as [`TextDocs`] says.
pub(crate) struct TextReader {
    lines: LineReader,
    acc: DocAccumulator,
    done: bool,
}

impl TextReader {
    pub(crate) fn open(
        path: &Path,
        compression: Compression,
        mode: TextDocs,
        max_doc_bytes: usize,
    ) -> Result<Self> {
        Ok(TextReader {
            lines: LineReader::open(path, compression, max_doc_bytes)?,
            acc: DocAccumulator::new(mode, max_doc_bytes),
            done: false,
        })
    }
}

impl DocReader for TextReader {
    fn next_doc(&mut self) -> Result<Option<String>> {
        while self.acc.ready.is_empty() && !self.done {
            match self.lines.next_piece()? {
                Some(piece) => {
                    let text = String::from_utf8_lossy(&self.lines.buf);
                    self.acc.push(&text, &piece);
                }
                None => {
                    self.acc.finish();
                    self.done = true;
                }
            }
        }
        Ok(self.acc.ready.pop_front())
    }

    fn consumed(&self) -> u64 {
        self.lines.consumed()
    }

    fn skipped(&self) -> u64 {
        0
    }

    fn splits(&self) -> u64 {
        self.acc.splits
    }
}

/// JSON Lines: one object per line, the document in a string field.
pub(crate) struct JsonlReader {
    lines: LineReader,
    field: String,
    skip_bad_lines: bool,
    max_doc_bytes: usize,
    ready: VecDeque<String>,
    skipped: u64,
    splits: u64,
}

/// How much longer than the document cap a JSON line may be (escapes, other fields).
const JSON_LINE_FACTOR: usize = 4;

impl JsonlReader {
    pub(crate) fn open(
        path: &Path,
        compression: Compression,
        field: &str,
        skip_bad_lines: bool,
        max_doc_bytes: usize,
    ) -> Result<Self> {
        let max_line = max_doc_bytes.saturating_mul(JSON_LINE_FACTOR);
        Ok(JsonlReader {
            lines: LineReader::open(path, compression, max_line)?,
            field: field.to_string(),
            skip_bad_lines,
            max_doc_bytes,
            ready: VecDeque::new(),
            skipped: 0,
            splits: 0,
        })
    }

    /// The text of the line now in the buffer, or what is wrong with it.
    fn parse_line(&self) -> std::result::Result<Option<String>, String> {
        let bytes = self.lines.buf.trim_ascii();
        if bytes.is_empty() {
            return Ok(None);
        }
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON: {e}"))?;
        let serde_json::Value::Object(mut object) = value else {
            return Err(format!(
                "expected a JSON object, found {}",
                json_kind(&value)
            ));
        };
        match object.remove(&self.field) {
            Some(serde_json::Value::String(text)) => Ok(Some(text)),
            Some(other) => Err(format!(
                "field {:?} is {}, expected a string",
                self.field,
                json_kind(&other)
            )),
            None => Err(format!("the object has no field {:?}", self.field)),
        }
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

impl DocReader for JsonlReader {
    fn next_doc(&mut self) -> Result<Option<String>> {
        while self.ready.is_empty() {
            let Some(piece) = self.lines.next_piece()? else {
                return Ok(None);
            };
            let line = self.lines.line;
            let parsed = if piece.ends_line {
                self.parse_line()
            } else {
                // Over-long line: consume the rest of it so a skip resumes at the next line.
                while let Some(p) = self.lines.next_piece()? {
                    if p.ends_line {
                        break;
                    }
                }
                Err(format!(
                    "line is longer than {} bytes ({JSON_LINE_FACTOR} x the document cap)",
                    self.lines.max
                ))
            };
            match parsed {
                Ok(None) => {}
                Ok(Some(text)) if text.is_empty() => {}
                Ok(Some(text)) if text.len() <= self.max_doc_bytes => self.ready.push_back(text),
                Ok(Some(text)) => {
                    let docs =
                        DocAccumulator::split_long(&text, self.max_doc_bytes, &mut self.splits);
                    self.ready.extend(docs);
                }
                Err(_) if self.skip_bad_lines => self.skipped += 1,
                Err(problem) => {
                    return Err(DataError::BadRecord {
                        path: self.lines.inner.get_ref().path().to_path_buf(),
                        line,
                        problem,
                    });
                }
            }
        }
        Ok(self.ready.pop_front())
    }

    fn consumed(&self) -> u64 {
        self.lines.consumed()
    }

    fn skipped(&self) -> u64 {
        self.skipped
    }

    fn splits(&self) -> u64 {
        self.splits
    }
}
