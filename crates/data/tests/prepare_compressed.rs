//! `data::prepare` on compressed inputs: gzip and zstd text and JSON Lines files, and Parquet
//! files with snappy, gzip and zstd pages, must give the very shards their plain versions give.

mod common;

use common::config;
use std::io::Write;
use std::path::{Path, PathBuf};

use data::prepare::{Compression, InputFormat, PrepareConfig, TextDocs, prepare};
use data::{ByteTokenizer, DataError, MANIFEST_FILE, Manifest, PrepareSummary};

/// Runs `prepare` with the byte tokenizer, checking the progress it reports on the way: the
/// bytes read never pass the (compressed) size of the inputs.
fn run(cfg: &PrepareConfig) -> data::Result<PrepareSummary> {
    prepare(cfg, &ByteTokenizer, &mut |p| {
        assert!(
            p.input_bytes_done <= p.input_bytes,
            "{} of {} input bytes read",
            p.input_bytes_done,
            p.input_bytes
        );
    })
}

/// A compressor: the data and the number of gzip members or zstd frames to make of it.
type Pack = fn(&[u8], usize) -> Vec<u8>;

/// `data` gzip-compressed, as `parts` concatenated members (as `cat a.gz b.gz` makes).
fn gzip(data: &[u8], parts: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for chunk in data.chunks(data.len().div_ceil(parts).max(1)) {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(chunk).unwrap();
        out.extend(enc.finish().unwrap());
    }
    out
}

/// `data` zstd-compressed, as `parts` concatenated frames, each with a content checksum as
/// the `zstd` command writes by default (without one, a flipped bit can decode silently).
fn zstd(data: &[u8], parts: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for chunk in data.chunks(data.len().div_ceil(parts).max(1)) {
        let mut enc = zstd::stream::write::Encoder::new(&mut out, 3).unwrap();
        enc.include_checksum(true).unwrap();
        enc.write_all(chunk).unwrap();
        enc.finish().unwrap();
    }
    out
}

fn write(path: &Path, bytes: &[u8]) -> PathBuf {
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

/// The dataset in `dir`: its manifest and every shard file's bytes, in order.
fn dataset(dir: &Path) -> (Manifest, Vec<Vec<u8>>) {
    let manifest = Manifest::read(dir).unwrap();
    let shards = manifest
        .shards
        .iter()
        .map(|s| std::fs::read(dir.join(&s.file)).unwrap())
        .collect();
    (manifest, shards)
}

/// Asserts that the datasets in `dirs` are byte for byte the same (and have several shards).
fn assert_identical(dirs: &[PathBuf]) {
    let (first, first_shards) = dataset(&dirs[0]);
    assert!(first.shards.len() > 1, "the test wants several shards");
    for dir in &dirs[1..] {
        let (m, shards) = dataset(dir);
        assert_eq!(m.snapshot, first.snapshot, "{}", dir.display());
        assert_eq!(m, first, "{}", dir.display());
        assert!(
            shards == first_shards,
            "{}: shard bytes differ",
            dir.display()
        );
    }
}

/// JSON Lines with escapes, non-ASCII text, a blank line and CRLF endings.
fn jsonl_text() -> String {
    let mut s = String::new();
    for i in 0..400 {
        let text = format!("document {i}: \\\"quoted\\\" caf\u{e9} \u{4e16}\u{754c}\\nsecond line");
        s.push_str(&format!("{{\"id\": {i}, \"text\": \"{text}\"}}"));
        s.push_str(if i % 7 == 0 { "\r\n" } else { "\n" });
        if i % 50 == 0 {
            s.push('\n');
        }
    }
    s
}

/// Plain text in paragraphs.
fn plain_text() -> String {
    (0..300)
        .map(|i| format!("paragraph {i}, line one\nline two of {i}\n\n"))
        .collect()
}

#[test]
fn gzip_and_zstd_inputs_prepare_to_the_same_shards_as_plain_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let (jsonl, text) = (jsonl_text(), plain_text());
    let mut outs = Vec::new();
    let codecs: [(&str, Pack); 3] = [("", |d, _| d.to_vec()), (".gz", gzip), (".zst", zstd)];
    for (ext, compress) in codecs {
        let a = write(
            &tmp.path().join(format!("a.jsonl{ext}")),
            &compress(jsonl.as_bytes(), 3),
        );
        let b = write(
            &tmp.path().join(format!("b.txt{ext}")),
            &compress(text.as_bytes(), 1),
        );
        let out = tmp.path().join(format!("ds{ext}"));
        let mut cfg = config(&[&a, &b], &out);
        cfg.shard_bytes = 4096;
        cfg.batch_bytes = 3000;
        let s = run(&cfg).unwrap();
        assert_eq!(s.docs, 400 + 300, "{ext}");
        outs.push(out);
    }
    assert_identical(&outs);
}

#[test]
fn compression_comes_from_the_last_extension_and_format_from_the_one_before() {
    let cases = [
        ("a.jsonl.gz", Some(InputFormat::Jsonl), Compression::Gzip),
        ("a.json.GZ", Some(InputFormat::Jsonl), Compression::Gzip),
        ("a.ndjson.zst", Some(InputFormat::Jsonl), Compression::Zstd),
        ("a.TXT.zstd", Some(InputFormat::Text), Compression::Zstd),
        ("a.md.gz", Some(InputFormat::Text), Compression::Gzip),
        ("a.text.zst", Some(InputFormat::Text), Compression::Zstd),
        ("a.jsonl", Some(InputFormat::Jsonl), Compression::None),
        ("a.tar.gz", None, Compression::Gzip),
        ("a.gz", None, Compression::Gzip),
        ("a.zip", None, Compression::None),
    ];
    for (name, format, compression) in cases {
        let path = Path::new("dir.d").join(name);
        assert_eq!(InputFormat::from_path(&path), format, "{name}");
        assert_eq!(Compression::from_path(&path), compression, "{name}");
    }
}

#[test]
fn format_flag_names_the_format_and_the_extension_still_the_compression() {
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = "{\"text\": \"one\"}\n{\"text\": \"two\"}\n";
    let a = write(&tmp.path().join("a.jsonl.gz"), &gzip(jsonl.as_bytes(), 1));
    let b = write(&tmp.path().join("dump.zst"), &zstd(jsonl.as_bytes(), 1));
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&a, &b], &out);
    cfg.format = Some(InputFormat::Jsonl);
    assert_eq!(run(&cfg).unwrap().docs, 4);

    // Without --format a bare `.zst` names no format.
    let err = run(&config(&[&b], &tmp.path().join("ds2"))).unwrap_err();
    assert!(matches!(err, DataError::UnknownFormat { .. }), "{err:?}");

    // --format text reads the JSON Lines file decompressed, as text.
    cfg.format = Some(InputFormat::Text);
    cfg.text_docs = TextDocs::Line;
    cfg.force = true;
    assert_eq!(run(&cfg).unwrap().docs, 4);
}

#[test]
fn directories_yield_compressed_text_and_jsonl_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("corpus");
    std::fs::create_dir(&dir).unwrap();
    write(
        &dir.join("a.jsonl.gz"),
        &gzip(b"{\"text\": \"from gzip\"}\n", 1),
    );
    write(&dir.join("b.txt.zst"), &zstd(b"from zstd", 1));
    write(&dir.join("c.tar.gz"), &gzip(b"not an input", 1));
    write(&dir.join("README"), b"not an input");
    let out = tmp.path().join("ds");
    let s = run(&config(&[&dir], &out)).unwrap();
    assert_eq!((s.files, s.docs), (2, 2));
}

/// Runs `prepare` on one file holding `bytes`, expecting a [`DataError::BadInputFile`] that
/// names the file and contains every piece of `want`; checks no manifest is written.
fn expect_bad_file(name: &str, bytes: &[u8], want: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(&tmp.path().join(name), bytes);
    let out = tmp.path().join("ds");
    let mut cfg = config(&[&input], &out);
    // A stream that does not decode is not a bad line: skipping lines must not hide it.
    cfg.skip_bad_lines = true;
    let err = run(&cfg).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, DataError::BadInputFile { ref path, .. } if *path == input),
        "{name}: {err:?}"
    );
    assert!(msg.contains(name), "{msg}");
    for w in want {
        assert!(msg.contains(w), "{name}: {msg:?} lacks {w:?}");
    }
    assert!(!out.join(MANIFEST_FILE).exists(), "{name}");
}

#[test]
fn corrupt_truncated_or_mislabelled_files_fail_naming_the_file_and_codec() {
    let text: String = (0..2000)
        .map(|i| format!("{{\"text\": \"doc {i}\"}}\n"))
        .collect();
    let gz = gzip(text.as_bytes(), 1);
    let zst = zstd(text.as_bytes(), 1);

    expect_bad_file("plain.jsonl.gz", text.as_bytes(), &["gzip", "not gzip"]);
    expect_bad_file("plain.jsonl.zst", text.as_bytes(), &["zstd", "not zstd"]);
    expect_bad_file("swapped.jsonl.gz", &zst, &["gzip"]);
    expect_bad_file("swapped.jsonl.zst", &gz, &["zstd"]);
    expect_bad_file("truncated.jsonl.gz", &gz[..gz.len() / 2], &["gzip"]);
    expect_bad_file("truncated.jsonl.zst", &zst[..zst.len() / 2], &["zstd"]);
    expect_bad_file("no-trailer.txt.gz", &gz[..gz.len() - 4], &["gzip"]);
    expect_bad_file("empty.txt.zst", b"", &["zstd"]);
    let mut flipped = gz.clone();
    flipped[gz.len() / 2] ^= 0x5a;
    expect_bad_file("flipped.jsonl.gz", &flipped, &["gzip"]);
    let mut flipped = zst.clone();
    flipped[zst.len() / 2] ^= 0x5a;
    expect_bad_file("flipped.jsonl.zst", &flipped, &["zstd"]);
    // A valid stream followed by garbage is not quietly cut short either.
    let mut trailing = gz.clone();
    trailing.extend_from_slice(b"garbage after the member");
    expect_bad_file("trailing.jsonl.gz", &trailing, &["gzip"]);
}

#[test]
fn a_parquet_file_compressed_whole_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(&tmp.path().join("rows.parquet.zst"), &zstd(b"PAR1", 1));
    let err = run(&config(&[&input], &tmp.path().join("ds"))).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, DataError::BadInputFile { .. }), "{err:?}");
    assert!(
        msg.contains("rows.parquet.zst") && msg.contains("decompress the file first"),
        "{msg}"
    );
}

/// A few MB of one repeated byte compress to a few KB: every reader must still hold at most
/// one capped document of it, and cut it (text) or refuse it (a JSON line) as it would the
/// plain file.
#[test]
fn a_decompression_bomb_is_read_in_capped_documents() {
    const BIG: usize = 4 << 20;
    const CAP: usize = 64 << 10;
    let tmp = tempfile::tempdir().unwrap();
    let blob = vec![b'x'; BIG];
    for (ext, packed) in [("gz", gzip(&blob, 1)), ("zst", zstd(&blob, 1))] {
        assert!(packed.len() * 100 < BIG, "{ext}: {} bytes", packed.len());
        let input = write(&tmp.path().join(format!("bomb.txt.{ext}")), &packed);
        let mut cfg = config(&[&input], &tmp.path().join(format!("ds-{ext}")));
        cfg.text_docs = TextDocs::File;
        cfg.max_doc_bytes = CAP;
        cfg.batch_bytes = 4 * CAP;
        let s = run(&cfg).unwrap();
        assert_eq!(
            (s.docs, s.split_docs),
            ((BIG / CAP) as u64, (BIG / CAP - 1) as u64)
        );
        assert_eq!(s.text_bytes, BIG as u64);
    }

    // One JSON line of the whole blob: over the line cap, an error naming the line, or skipped.
    let mut jsonl = b"{\"text\": \"".to_vec();
    jsonl.extend_from_slice(&blob);
    jsonl.extend_from_slice(b"\"}\n{\"text\": \"after the bomb\"}\n");
    for (ext, packed) in [("gz", gzip(&jsonl, 1)), ("zst", zstd(&jsonl, 1))] {
        let input = write(&tmp.path().join(format!("bomb.jsonl.{ext}")), &packed);
        let mut cfg = config(&[&input], &tmp.path().join(format!("dj-{ext}")));
        cfg.max_doc_bytes = CAP;
        let err = run(&cfg).unwrap_err();
        assert!(
            matches!(err, DataError::BadRecord { line: 1, .. }),
            "{ext}: {err:?}"
        );
        assert!(err.to_string().contains("longer than"), "{err}");
        cfg.skip_bad_lines = true;
        let s = run(&cfg).unwrap();
        assert_eq!((s.docs, s.skipped), (1, 1), "{ext}");
    }
}

#[cfg(feature = "parquet")]
mod parquet_pages {
    use std::fs::File;
    use std::sync::Arc;

    use parquet::basic::{Compression, GzipLevel, ZstdLevel};
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    use super::*;

    /// Writes `rows` as a one-column (`text: utf8`) file, `per_group` rows per row group.
    fn write_parquet(path: &Path, rows: &[String], per_group: usize, compression: Compression) {
        let schema = parse_message_type("message doc { required binary text (UTF8); }").unwrap();
        let props = WriterProperties::builder()
            .set_compression(compression)
            .build();
        let file = File::create(path).unwrap();
        let mut w = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
        for group in rows.chunks(per_group) {
            let mut rg = w.next_row_group().unwrap();
            let mut col = rg.next_column().unwrap().unwrap();
            let values: Vec<ByteArray> =
                group.iter().map(|s| ByteArray::from(s.as_str())).collect();
            col.typed::<ByteArrayType>()
                .write_batch(&values, None, None)
                .unwrap();
            col.close().unwrap();
            rg.close().unwrap();
        }
        w.close().unwrap();
    }

    #[test]
    fn parquet_pages_in_every_codec_prepare_to_identical_shards() {
        let tmp = tempfile::tempdir().unwrap();
        let rows: Vec<String> = (0..3000)
            .map(|i| format!("row {i}: some repeated text, row {i} again\nand a second line"))
            .collect();
        let codecs = [
            ("plain", Compression::UNCOMPRESSED),
            ("snappy", Compression::SNAPPY),
            ("gzip", Compression::GZIP(GzipLevel::default())),
            ("zstd", Compression::ZSTD(ZstdLevel::default())),
        ];
        let (mut outs, mut sizes) = (Vec::new(), Vec::new());
        for (name, codec) in codecs {
            let input = tmp.path().join(format!("{name}.parquet"));
            write_parquet(&input, &rows, 1200, codec);
            sizes.push(std::fs::metadata(&input).unwrap().len());
            let out = tmp.path().join(format!("ds-{name}"));
            let mut cfg = config(&[&input], &out);
            cfg.shard_bytes = 16 << 10;
            let s = run(&cfg).unwrap();
            assert_eq!(s.docs, rows.len() as u64, "{name}");
            outs.push(out);
        }
        sizes.sort_unstable();
        sizes.dedup();
        assert_eq!(sizes.len(), codecs.len(), "each codec wrote its own bytes");
        assert_identical(&outs);
    }
}
