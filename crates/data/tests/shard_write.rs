//! A shard larger than the writer's 4 MiB write chunk, with documents that cross chunk edges,
//! reads back token for token, verifies, and its file length is exactly the format's.

use data::shard::file_len;
use data::{Shard, ShardWriter};

#[test]
fn a_shard_of_several_write_chunks_reads_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.fts");
    let vocab = 70_000; // u32 ids: 4 bytes a token
    let token = |i: u64| ((i * 2_654_435_761) % u64::from(vocab)) as u32;
    // Odd document lengths, so chunk edges fall inside documents and at no fixed phase.
    let lens: Vec<u64> = (0..40).map(|d| 100_003 + 7_919 * d).collect();
    let mut w = ShardWriter::create(&path, vocab, "test").unwrap();
    let mut at = 0u64;
    for &len in &lens {
        let ids: Vec<u32> = (at..at + len).map(token).collect();
        w.push_doc(&ids).unwrap();
        at += len;
    }
    let info = w.finish().unwrap();
    assert!(
        info.bytes > 3 * (4 << 20),
        "{} bytes: not several chunks",
        info.bytes
    );
    assert_eq!(Some(info.bytes), file_len(at, lens.len() as u64, 4));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), info.bytes);

    let shard = Shard::open(&path).unwrap();
    shard.verify(Some(info.checksum)).unwrap();
    let mut got = vec![0u32; at as usize];
    shard.read_tokens(0, &mut got).unwrap();
    let want: Vec<u32> = (0..at).map(token).collect();
    assert!(got == want, "token array differs");
    let mut start = 0;
    for (d, &len) in lens.iter().enumerate() {
        assert_eq!(shard.doc_range(d as u64), Some(start..start + len));
        start += len;
    }
}
