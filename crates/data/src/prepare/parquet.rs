//! Parquet inputs (feature `parquet`): one document per row of a named top-level string column.
//!
//! The column is read row group by row group, page by page, 1024 rows at a time, through the
//! `parquet` crate's low-level column reader (no Arrow), so memory stays at a few pages however
//! large the file or its row groups are. Null rows are skipped and counted. Pages may be
//! uncompressed or compressed with snappy, gzip or zstd; other codecs (brotli, LZ4) are
//! reported as an error naming the file.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::Type as PhysicalType;
use parquet::column::reader::{ColumnReader, ColumnReaderImpl, get_column_reader};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::reader::FileReader;
use parquet::file::serialized_reader::{SerializedFileReader, SerializedPageReader};
use parquet::schema::types::ColumnDescPtr;

use super::readers::{DocAccumulator, DocReader};
use crate::error::{DataError, Result};

/// Rows read per call into the column reader.
const BATCH_ROWS: usize = 1024;

/// Reads one string column of a Parquet file.
pub(crate) struct ParquetReader {
    path: PathBuf,
    file: Arc<File>,
    meta: ParquetMetaData,
    column: usize,
    descr: ColumnDescPtr,
    row_group: usize,
    reader: Option<ColumnReaderImpl<ByteArrayType>>,
    defs: Vec<i16>,
    values: Vec<ByteArray>,
    ready: VecDeque<String>,
    max_doc_bytes: usize,
    consumed: u64,
    nulls: u64,
    splits: u64,
}

impl ParquetReader {
    /// Opens `path` and finds the top-level column `field`.
    ///
    /// # Errors
    /// [`DataError::Io`] if it cannot be opened; [`DataError::BadInputFile`] if it is not
    /// Parquet, has no such column, or the column is not a non-repeated string (BYTE_ARRAY).
    pub(crate) fn open(path: &Path, field: &str, max_doc_bytes: usize) -> Result<Self> {
        let bad = |problem: String| DataError::BadInputFile {
            path: path.to_path_buf(),
            problem,
        };
        let file = File::open(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let clone = file.try_clone().map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let meta = SerializedFileReader::new(clone)
            .map_err(|e| bad(format!("not a readable Parquet file: {e}")))?
            .metadata()
            .clone();
        let schema = meta.file_metadata().schema_descr();
        let found = schema
            .columns()
            .iter()
            .position(|c| c.path().parts() == [field.to_string()]);
        let Some(column) = found else {
            let names: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
            return Err(bad(format!(
                "no top-level column {field:?} (columns: {})",
                names.join(", ")
            )));
        };
        let descr = schema.column(column);
        if descr.physical_type() != PhysicalType::BYTE_ARRAY || descr.max_rep_level() != 0 {
            return Err(bad(format!(
                "column {field:?} is {} (repetition level {}), expected a non-repeated string (BYTE_ARRAY)",
                descr.physical_type(),
                descr.max_rep_level()
            )));
        }
        Ok(ParquetReader {
            path: path.to_path_buf(),
            file: Arc::new(file),
            meta,
            column,
            descr,
            row_group: 0,
            reader: None,
            defs: Vec::new(),
            values: Vec::new(),
            ready: VecDeque::new(),
            max_doc_bytes,
            consumed: 0,
            nulls: 0,
            splits: 0,
        })
    }

    fn row_group_error(&self, e: parquet::errors::ParquetError) -> DataError {
        DataError::BadInputFile {
            path: self.path.clone(),
            problem: format!(
                "row group {}, column {:?}: {e}",
                self.row_group,
                self.descr.name()
            ),
        }
    }

    /// Starts the next row group's column reader; `false` after the last one.
    fn next_row_group(&mut self) -> Result<bool> {
        if self.row_group >= self.meta.num_row_groups() {
            return Ok(false);
        }
        let rg = self.meta.row_group(self.row_group);
        let chunk = rg.column(self.column);
        let rows = usize::try_from(rg.num_rows()).unwrap_or(0);
        let pages = SerializedPageReader::new(self.file.clone(), chunk, rows, None)
            .map_err(|e| self.row_group_error(e))?;
        match get_column_reader(self.descr.clone(), Box::new(pages)) {
            ColumnReader::ByteArrayColumnReader(r) => self.reader = Some(r),
            _ => {
                return Err(DataError::BadInputFile {
                    path: self.path.clone(),
                    problem: format!("column {:?} is not BYTE_ARRAY", self.descr.name()),
                });
            }
        }
        Ok(true)
    }

    /// Reads up to [`BATCH_ROWS`] rows into `ready`; `false` when the row group is exhausted.
    fn read_batch(&mut self) -> Result<bool> {
        let Some(reader) = self.reader.as_mut() else {
            return Ok(false);
        };
        self.defs.clear();
        self.values.clear();
        let max_def = self.descr.max_def_level();
        let defs = (max_def > 0).then_some(&mut self.defs);
        let read = reader.read_records(BATCH_ROWS, defs, None, &mut self.values);
        let (records, values, _) = read.map_err(|e| self.row_group_error(e))?;
        if records == 0 {
            return Ok(false);
        }
        self.nulls += (records - values.min(records)) as u64;
        for value in self.values.drain(..) {
            let text = String::from_utf8_lossy(value.data());
            if text.is_empty() {
                continue;
            }
            if text.len() <= self.max_doc_bytes {
                self.ready.push_back(text.into_owned());
            } else {
                let docs = DocAccumulator::split_long(&text, self.max_doc_bytes, &mut self.splits);
                self.ready.extend(docs);
            }
        }
        Ok(true)
    }
}

impl DocReader for ParquetReader {
    fn next_doc(&mut self) -> Result<Option<String>> {
        while self.ready.is_empty() {
            if self.read_batch()? {
                continue;
            }
            if self.reader.take().is_some() {
                let rg = self.meta.row_group(self.row_group);
                self.consumed += u64::try_from(rg.compressed_size()).unwrap_or(0);
                self.row_group += 1;
            }
            if !self.next_row_group()? {
                return Ok(None);
            }
        }
        Ok(self.ready.pop_front())
    }

    fn consumed(&self) -> u64 {
        self.consumed
    }

    fn skipped(&self) -> u64 {
        self.nulls
    }

    fn splits(&self) -> u64 {
        self.splits
    }
}
