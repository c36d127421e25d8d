//! Parquet inputs (feature `parquet`), written here with the `parquet` crate's own writer.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use data::{ByteTokenizer, DataError};
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int32Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use super::{config, read_texts, run};

/// Writes `groups` (one row group each; `None` is a null) as columns `n: int32`, `text: utf8`.
fn write_parquet(path: &Path, groups: &[Vec<Option<&str>>], compression: Compression) {
    let schema =
        parse_message_type("message doc { required int32 n; optional binary text (UTF8); }")
            .unwrap();
    let props = WriterProperties::builder()
        .set_compression(compression)
        .build();
    let mut w = SerializedFileWriter::new(
        File::create(path).unwrap(),
        Arc::new(schema),
        Arc::new(props),
    )
    .unwrap();
    for rows in groups {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let ns: Vec<i32> = (0..rows.len() as i32).collect();
        col.typed::<Int32Type>()
            .write_batch(&ns, None, None)
            .unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = rows.iter().flatten().map(|s| ByteArray::from(*s)).collect();
        let defs: Vec<i16> = rows.iter().map(|r| i16::from(r.is_some())).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, Some(&defs), None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

#[test]
fn parquet_rows_are_documents_nulls_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let snappy = tmp.path().join("a.parquet");
    write_parquet(
        &snappy,
        &[
            vec![Some("alpha"), None, Some("beta\ngamma")],
            vec![Some(""), Some("delta")],
        ],
        Compression::SNAPPY,
    );
    let plain = tmp.path().join("b.parquet");
    let many: Vec<String> = (0..3000).map(|i| format!("row {i}")).collect();
    write_parquet(
        &plain,
        &[many.iter().map(|s| Some(s.as_str())).collect()],
        Compression::UNCOMPRESSED,
    );
    let out = tmp.path().join("ds");
    let s = run(&config(&[&snappy, &plain], &out), &ByteTokenizer).unwrap();
    let docs = read_texts(&out);
    assert_eq!(docs[..3], ["alpha", "beta\ngamma", "delta"]);
    assert_eq!(docs[3..], many[..], "more rows than one read batch");
    assert_eq!(s.skipped, 1, "the null row");
}

#[test]
fn a_missing_or_non_string_column_is_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("a.parquet");
    write_parquet(&input, &[vec![Some("x")]], Compression::SNAPPY);
    let mut cfg = config(&[&input], &tmp.path().join("ds"));
    cfg.field = "body".into();
    let err = run(&cfg, &ByteTokenizer).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, DataError::BadInputFile { .. }), "{err:?}");
    assert!(
        msg.contains("a.parquet") && msg.contains("\"body\"") && msg.contains("n, text"),
        "{msg}"
    );
    cfg.field = "n".into();
    let msg = run(&cfg, &ByteTokenizer).unwrap_err().to_string();
    assert!(msg.contains("INT32") && msg.contains("BYTE_ARRAY"), "{msg}");

    let fake = tmp.path().join("fake.parquet");
    std::fs::write(&fake, "this is not parquet").unwrap();
    let msg = run(&config(&[&fake], &tmp.path().join("ds2")), &ByteTokenizer)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("fake.parquet") && msg.contains("not a readable Parquet file"),
        "{msg}"
    );
}
